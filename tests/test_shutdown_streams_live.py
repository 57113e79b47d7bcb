"""A real node stopped with SIGTERM while it streams an answer ends the stream with the
dialect's in-band error, exits within a bounded time, and logs no ASGI traceback (the
in-process counterpart for every dialect: `exo.api.tests.test_shutdown_streams`)."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from exo.testing.processes import ExoNode
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_checkout

READY_TIMEOUT_SECONDS = 120.0
# Slow decoding keeps the answer streaming while the node is told to stop.
DECODE_STEP_SECONDS = 0.2
# uvicorn's graceful-shutdown timeout (2 s) plus the runner's shutdown, on a busy machine.
EXIT_BOUND_SECONDS = 20.0


@pytest.mark.slow  # ~28 s on the shared 2-core machine (a node start and a model load)
def test_sigterm_ends_an_open_stream_with_its_in_band_error(tmp_path: Path) -> None:
    model_dir = save_tiny_checkout(tmp_path / "slow-decode")
    mark_model_dir(model_dir, decode_step_seconds=DECODE_STEP_SECONDS)
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",))
    lines: list[str] = []
    first_token = threading.Event()

    def stream(model_id: str) -> None:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": "w1 w2"}],
            "max_tokens": 1000,
            "stream": True,
        }
        with httpx.stream(
            "POST", f"{node.url}/v1/chat/completions", json=body, timeout=60
        ) as response:
            for line in response.iter_lines():
                lines.append(line)
                if '"delta":{"role"' not in line and line.startswith("data: {"):
                    first_token.set()  # answer or reasoning text: the model is decoding

    try:
        node.launch()
        node.wait_api()
        model_id, _ = node.serve_local_model(model_dir, timeout=READY_TIMEOUT_SECONDS)
        reader = threading.Thread(target=stream, args=(model_id,), daemon=True)
        reader.start()
        assert first_token.wait(timeout=60), lines
        stopping = time.monotonic()
        code = node.stop(signal.SIGTERM, timeout=EXIT_BOUND_SECONDS)
        assert time.monotonic() - stopping < EXIT_BOUND_SECONDS
        reader.join(timeout=10)
    finally:
        if node.process is not None and node.process.poll() is None:
            node.kill()
    assert code == 0, node.log()
    data = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert data[-1] == "[DONE]", lines
    error = json.loads(data[-2])["error"]
    assert (error["message"], error["code"]) == ("the node is shutting down", "node_shutting_down")
    log = node.log_path.read_text(errors="replace")
    assert "Exception in ASGI application" not in log and "CancelledError" not in log, log
