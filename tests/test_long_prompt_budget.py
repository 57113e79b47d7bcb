"""A prompt longer than 8,192 tokens is served by a node started with default settings: the
KV-cache budget placement sizes from the node's memory holds it (a tiny random-weight model
with a 16k context, added from a local directory)."""

from __future__ import annotations

from pathlib import Path

import httpx

from exo.testing.processes import ExoNode
from exo.testing.tiny_models import save_tiny_checkout

CONTEXT = 16_384
PROMPT_TOKENS = 9_000
READY_TIMEOUT_SECONDS = 120.0


def test_a_prompt_past_8192_tokens_fits_the_default_budget(tmp_path: Path) -> None:
    model_dir = save_tiny_checkout(
        tmp_path / "long-context", config_update={"max_position_embeddings": CONTEXT}
    )
    # One token per word of the prompt: the checkout's word-level tokenizer splits words.
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",))
    try:
        node.launch()
        node.wait_api()
        model_id, runner_id = node.serve_local_model(model_dir, timeout=READY_TIMEOUT_SECONDS)
        state = node.state()
        (instance,) = state["instances"].values()
        budget = instance["kv_cache_tokens"]
        # Sized from memory: past the planned 8,192 tokens, as the runner holds it.
        assert budget > PROMPT_TOKENS
        assert state["runners"][runner_id]["kv_cache_tokens"] == budget
        prompt = " ".join(f"w{i % 61}" for i in range(PROMPT_TOKENS))
        answer = httpx.post(
            f"{node.url}/v1/completions",
            json={"model": model_id, "prompt": prompt, "max_tokens": 4, "temperature": 0},
            timeout=300,
        )
        assert answer.status_code == 200, answer.text
        usage = answer.json()["usage"]
        assert usage["prompt_tokens"] >= PROMPT_TOKENS and usage["completion_tokens"] == 4
    finally:
        node.stop()
