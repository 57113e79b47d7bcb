"""A model that can never load, on a live node: a tiny checkpoint with one tensor of the wrong
shape, which `POST /models/add` accepts (it reads no tensor) and only the runner's load
check refuses. A request places it on request; the runner fails to load it, is retried and
the instance deleted; the client gets a final 500 naming the tensor (not the 503 it would
retry, placing the model again each time), and the next requests, in two dialects, get the
same answer at once without a second placement. (In-process counterpart, every dialect:
`exo.api.tests.test_load_failure`.)"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from safetensors.torch import load_file, save_file

from exo.testing.processes import ExoNode, wait_until
from exo.testing.tiny_models import save_tiny_checkout

BROKEN_TENSOR = "model.layers.1.mlp.down_proj.weight"
# Three loads of the tiny model in fresh runner processes, 1 s and 2 s apart (the worker's
# backoff), on a loaded 2-core machine: a bound, not a measure.
LOAD_FAILURE_SECONDS = 300.0
# A remembered failure is answered from the state: no load, no placement.
REMEMBERED_SECONDS = 30.0


def save_misshapen_checkout(directory: Path) -> Path:
    """A tiny Llama checkout whose `BROKEN_TENSOR` lacks its last column."""
    save_tiny_checkout(directory)
    weights = directory / "model.safetensors"
    tensors = load_file(str(weights))
    tensors[BROKEN_TENSOR] = tensors[BROKEN_TENSOR][:, :-1].contiguous()
    save_file(tensors, str(weights), metadata={"format": "pt"})
    return directory


@pytest.mark.slow  # a node start and three failing loads: ~1-2 min on the shared 2-core machine
def test_a_model_that_cannot_load_is_a_final_error_and_is_not_placed_again(
    tmp_path: Path,
) -> None:
    model_dir = save_misshapen_checkout(tmp_path / "misshapen")
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",))
    try:
        node.launch()
        node.wait_api()
        added = httpx.post(f"{node.url}/models/add", json={"model_id": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        model_id = added.json()["model_id"]
        chat = {"model": model_id, "messages": [{"role": "user", "content": "w1 w2"}]}

        first = httpx.post(
            f"{node.url}/v1/chat/completions", json=chat, timeout=LOAD_FAILURE_SECONDS
        )
        assert first.status_code == 500, (first.text, node.log())
        error = first.json()["error"]
        assert error["code"] == "model_load_failed", error
        assert BROKEN_TENSOR in error["message"] and "has shape" in error["message"], error

        started = time.monotonic()
        again = httpx.post(f"{node.url}/v1/chat/completions", json=chat, timeout=REMEMBERED_SECONDS)
        ollama = httpx.post(
            f"{node.url}/ollama/api/chat",
            json={**chat, "stream": False},
            timeout=REMEMBERED_SECONDS,
        )
        assert time.monotonic() - started < REMEMBERED_SECONDS
        assert again.status_code == 500 and again.json()["error"]["code"] == "model_load_failed"
        assert ollama.status_code == 500 and BROKEN_TENSOR in ollama.json()["error"], ollama.text
        placements = [event for event in node.events() if event["kind"] == "InstanceCreated"]
        assert len(placements) == 1
        [deleted] = [event for event in node.events() if event["kind"] == "InstanceDeleted"]
        assert BROKEN_TENSOR in deleted["load_failure"]["reason"]
        wait_until(lambda: not node.runner_processes(), timeout=30, what="no runner left")
    finally:
        node.stop()
