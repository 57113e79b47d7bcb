"""Load on request on a live node: SmolLM2 is downloaded (the shared models directory) but
not placed; requests in several dialects at once place it once and are answered when it is
ready; Ollama's `keep_alive: 0` unloads it and its runner stops."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until

# "Answer in one sentence." keeps SmolLM2's greedy answer ("The capital of France is Paris.")
# clear of near ties: without it the first token leads "The" over "L" by one bfloat16 step
# (25.25 vs 25.125), and concurrent requests, computed in a batch, may take "L" and answer
# "L'Étoile, ..." without Paris. With it, every step leads by 1.0 or more.
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
REQUEST_TIMEOUT_SECONDS = 300.0


def test_requests_place_the_model_once_and_keep_alive_zero_unloads_it(
    tmp_path: Path, shared_models_dir: Path
) -> None:
    node = ExoNode(
        tmp_path / "home", models_dir=shared_models_dir, extra_args=("--no-default-model",)
    )
    node.start()
    try:
        wait_until(lambda: node.state()["node_info"], timeout=30, what="node info")
        assert node.state()["instances"] == {}
        openai_client = openai.OpenAI(
            base_url=f"{node.url}/v1",
            api_key="unused",
            timeout=REQUEST_TIMEOUT_SECONDS,
            max_retries=0,
        )
        ollama_client = ollama.Client(host=f"{node.url}/ollama", timeout=REQUEST_TIMEOUT_SECONDS)
        answers: dict[str, Any] = {}

        def ask_openai_streaming() -> None:
            stream = openai_client.chat.completions.create(
                model="smollm2:135m", messages=QUESTION, temperature=0, max_tokens=12, stream=True
            )
            answers["openai"] = "".join(
                chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices
            )

        def ask_ollama() -> None:
            reply = ollama_client.chat(
                model="smollm2:135m",
                messages=QUESTION,
                options={"temperature": 0, "num_predict": 12},
            )
            answers["ollama"] = reply.message.content
            answers["ollama_load_duration"] = reply.load_duration

        def ask_completions() -> None:
            answers["completions"] = (
                openai_client.completions.create(
                    model=DEFAULT_MODEL_ID,
                    prompt="The capital of France is",
                    max_tokens=4,
                    temperature=0,
                )
                .choices[0]
                .text
            )

        threads = [
            threading.Thread(target=ask)
            for ask in (ask_openai_streaming, ask_ollama, ask_completions)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=REQUEST_TIMEOUT_SECONDS)
        assert set(answers) == {"openai", "ollama", "ollama_load_duration", "completions"}, (
            node.log()
        )
        assert "Paris" in answers["openai"] and "Paris" in answers["ollama"]
        assert answers["completions"].strip()
        # Ollama's load_duration: the wait for the load, then 0 on the loaded model.
        assert answers["ollama_load_duration"] > 0
        warm = ollama_client.generate(
            model="smollm2:135m", prompt="Hi", options={"temperature": 0, "num_predict": 2}
        )
        assert warm.done and warm.load_duration == 0
        placed = [event for event in node.events() if event["kind"] == "InstanceCreated"]
        assert len(placed) == 1  # three requests, one placement
        assert len(node.runner_processes()) == 1

        # Ollama's unload request: no prompt, keep_alive 0.
        unloaded = ollama_client.generate(model="smollm2:135m", keep_alive=0)
        assert unloaded.done and unloaded.done_reason == "unload"
        wait_until(lambda: not node.state()["instances"], timeout=60, what="the instance deleted")
        wait_until(lambda: not node.runner_processes(), timeout=30, what="the runner stopped")
        assert httpx.get(f"{node.url}/ollama/api/ps", timeout=10).json()["models"] == []
    finally:
        node.stop()
