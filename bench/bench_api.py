"""Prefill and decode speed of the default model through the HTTP API (streaming).

Starts a local `exo` node (or uses `--url`), then for each prompt size sends streaming
chat requests and prints, per size, the median over the runs of:
- TTFT (s): request sent -> first content chunk;
- prefill tok/s: prompt tokens / TTFT (includes HTTP, scheduling and the first decode step);
- decode tok/s: (completion tokens - 1) / (last chunk time - first chunk time).

Usage: python bench/bench_api.py [--url http://127.0.0.1:52415] [--runs 5] [--sizes 32,128,512]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
FILLER = "The quick brown fox jumps over the lazy dog while the cat sleeps. "


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def start_node() -> tuple[subprocess.Popen[bytes], str, Path]:
    home = Path(tempfile.mkdtemp(prefix="exo-bench-"))
    port = free_port()
    env = {**os.environ, "EXO_HOME": str(home)}
    env.setdefault("EXO_MODELS_DIR", str(Path.home() / ".local" / "share" / "exo" / "models"))
    exo = shutil.which("exo") or str(Path(sys.executable).parent / "exo")
    process = subprocess.Popen(
        [exo, "--api-host", "127.0.0.1", "--api-port", str(port), "-q"],
        env=env,
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    return process, f"http://127.0.0.1:{port}", home


def wait_ready(url: str, timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            state = httpx.get(f"{url}/state", timeout=2).json()
            if any(s.get("kind") == "RunnerReady" for s in state["runners"].values()):
                return
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise TimeoutError("the node did not get ready")


def prompt_of(size_tokens: int) -> str:
    # About 14 tokens per filler sentence for this tokenizer; usage reports the exact count.
    repeats = max(1, size_tokens // 14)
    return FILLER * repeats + "\nContinue counting: 1, 2, 3,"


def one_run(client: httpx.Client, url: str, prompt: str, max_tokens: int) -> dict[str, float]:
    body = {
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent = time.perf_counter()
    first = last = 0.0
    usage: dict[str, int] = {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[len("data: ") :])
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices", []):
                if choice["delta"].get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    ttft = first - sent
    decoded = usage["completion_tokens"]
    return {
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": decoded,
        "ttft": ttft,
        "prefill": usage["prompt_tokens"] / ttft,
        "decode": (decoded - 1) / (last - first) if decoded > 1 and last > first else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="use a running node instead of starting one")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="32,128,512")
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    process = None
    url = args.url
    if url is None:
        process, url, _ = start_node()
    try:
        wait_ready(url)
        print(
            f"{'prompt':>7} {'decoded':>8} {'TTFT s':>8} {'prefill tok/s':>14} {'decode tok/s':>13}"
        )
        with httpx.Client(timeout=300) as client:
            one_run(client, url, prompt_of(32), 8)  # first request after warm-up
            for size in (int(s) for s in args.sizes.split(",")):
                runs = [
                    one_run(client, url, prompt_of(size), args.max_tokens) for _ in range(args.runs)
                ]
                median = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
                print(
                    f"{median['prompt_tokens']:>7.0f} {median['completion_tokens']:>8.0f} "
                    f"{median['ttft']:>8.3f} {median['prefill']:>14.1f} {median['decode']:>13.1f}"
                )
    finally:
        if process is not None:
            process.send_signal(signal.SIGINT)
            process.wait(timeout=30)


if __name__ == "__main__":
    main()
