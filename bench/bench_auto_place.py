"""Time from request to first token for a model loaded on request, against one already
loaded.

Usage: PYTHONPATH=src python bench/bench_auto_place.py [--models-dir DIR] [--runs 2]

Starts a node with `--no-default-model` on a models directory holding the default model
(SmolLM2-135M, converted from its PyPI package on first use), then, per run, sends a
streaming chat request for it while it is not placed (the request places it and waits for
the load), sends a second one to the loaded model, and unloads it with Ollama's
`keep_alive: 0`. Prints the seconds to the first streamed token of each. Numbers only;
nothing is asserted.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import httpx

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.processes import ExoNode, wait_until

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
REQUEST_TIMEOUT_S = 600.0


def seconds_to_first_token(node: ExoNode) -> float:
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
    }
    started = time.monotonic()
    with httpx.stream(
        "POST", f"{node.url}/v1/chat/completions", json=body, timeout=REQUEST_TIMEOUT_S
    ) as response:
        response.raise_for_status()
        lines = response.iter_lines()
        for line in lines:
            if line.startswith("data: ") and '"content"' in line:
                first = time.monotonic() - started
                break
        else:
            raise RuntimeError("the stream ended without a token")
        for _ in lines:
            pass
    return first


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--runs", type=int, default=2)
    args = parser.parse_args()
    models = args.models_dir or default_models_dir()
    prepare_model(load_builtin_cards()[DEFAULT_MODEL], models, offline=False)
    with tempfile.TemporaryDirectory() as home:
        node = ExoNode(Path(home), models_dir=models, extra_args=("--no-default-model",))
        node.start()
        try:
            wait_until(lambda: node.state()["node_info"], timeout=60, what="node info")
            print(f"{'run':>4}{'auto-placed TTFT s':>20}{'loaded TTFT s':>16}")
            for run in range(args.runs):
                cold = seconds_to_first_token(node)
                warm = seconds_to_first_token(node)
                print(f"{run:>4}{cold:>20.2f}{warm:>16.2f}")
                httpx.post(
                    f"{node.url}/ollama/api/generate",
                    json={"model": DEFAULT_MODEL, "keep_alive": 0, "stream": False},
                    timeout=60,
                ).raise_for_status()
                wait_until(
                    lambda: not node.state()["instances"] and not node.runner_processes(),
                    timeout=60,
                    what="the model unloaded",
                )
        finally:
            node.stop()


if __name__ == "__main__":
    main()
