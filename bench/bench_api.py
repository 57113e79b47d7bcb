"""Prefill and decode speed of the default model through the HTTP API (streaming).

Starts a local `exo` node (or uses `--url`), then for each prompt size sends streaming
chat requests and prints, per size, the median over the runs of:
- TTFT (s): request sent -> first content chunk;
- prefill tok/s: prompt tokens / TTFT (includes HTTP, scheduling and the first decode step);
- decode tok/s: (completion tokens - 1) / (last chunk time - first chunk time).

With `--cpu` it measures instead what streaming costs the node: for each dialect's streaming
endpoint (OpenAI chat, OpenAI responses, Claude messages, Ollama chat), the CPU time of the
node process (API, worker and master; not its runner subprocess, which decodes) per streamed
token, from `psutil.Process(pid).cpu_times()` around `--runs` requests of `--max-tokens`
tokens. CPU time, unlike tok/s, barely moves when the machine is busy. The node's idle CPU
(measured first, per second) is shown, and the last column takes it out of the figure (on a
busy machine decoding slows down, and the node's background work then adds up per token).

Usage: python bench/bench_api.py [--url http://127.0.0.1:52415] [--runs 5] [--sizes 32,128,512]
       python bench/bench_api.py --cpu [--url URL --pid NODE_PID] [--runs 5] [--max-tokens 200]
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
import psutil

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Greedy, SmolLM2 answers this with more than 200 tokens (only chat takes a logit_bias).
LONG_ANSWER_PROMPT = "Write a very long essay about the history of Rome, in many paragraphs."
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
    # This interpreter's own script first: a shim in between would not be the node's pid.
    beside = Path(sys.executable).parent / "exo"
    exo = str(beside) if beside.exists() else shutil.which("exo") or "exo"
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


def _streamed_tokens(dialect: str, line: str) -> int | None:
    """The completion-token count a dialect's final streamed event reports, else None."""
    if dialect == "ollama":
        event = json.loads(line)
        return int(event["eval_count"]) if event.get("done") else None
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    event = json.loads(line[len("data: ") :])
    if dialect == "chat" and event.get("usage"):
        return int(event["usage"]["completion_tokens"])
    if dialect == "responses" and event.get("type") in (
        "response.completed",
        "response.incomplete",
    ):
        return int(event["response"]["usage"]["output_tokens"])
    if dialect == "claude" and event.get("type") == "message_delta":
        return int(event["usage"]["output_tokens"])
    return None


def _dialect_request(dialect: str, max_tokens: int) -> tuple[str, dict[str, object]]:
    """(path, body) of one greedy streaming request in `dialect`."""
    messages = [{"role": "user", "content": LONG_ANSWER_PROMPT}]
    match dialect:
        case "chat":
            return "/v1/chat/completions", {
                "model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True},
            }  # fmt: skip
        case "responses":
            return "/v1/responses", {
                "model": MODEL_ID, "input": LONG_ANSWER_PROMPT, "max_output_tokens": max_tokens,
                "temperature": 0, "stream": True,
            }  # fmt: skip
        case "claude":
            return "/v1/messages", {
                "model": MODEL_ID, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0, "stream": True,
            }  # fmt: skip
        case "ollama":
            return "/ollama/api/chat", {
                "model": MODEL_ID, "messages": messages, "stream": True,
                "options": {"num_predict": max_tokens, "temperature": 0},
            }  # fmt: skip
    raise ValueError(dialect)


def stream_tokens(client: httpx.Client, url: str, dialect: str, max_tokens: int) -> int:
    """Stream one request in `dialect`; the completion tokens it reported."""
    path, body = _dialect_request(dialect, max_tokens)
    tokens = 0
    with client.stream("POST", f"{url}{path}", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line:
                tokens = _streamed_tokens(dialect, line) or tokens
    return tokens


def node_cpu_seconds(node: psutil.Process) -> float:
    """User + system CPU of the node process itself (its runner children excluded)."""
    times = node.cpu_times()
    return times.user + times.system


def cpu_per_token(url: str, pid: int, runs: int, max_tokens: int) -> None:
    """Print the node's CPU ms per streamed token for each dialect's streaming endpoint."""
    node = psutil.Process(pid)
    before, started = node_cpu_seconds(node), time.perf_counter()
    time.sleep(3.0)
    idle = (node_cpu_seconds(node) - before) / (time.perf_counter() - started)
    print(f"node idle CPU: {idle * 1000:.1f} ms/s")
    print(f"{'dialect':>10} {'tokens':>7} {'tok/s':>7} {'node CPU ms/token':>18} {'less idle':>10}")
    with httpx.Client(timeout=300) as client:
        for dialect in ("chat", "responses", "claude", "ollama"):
            stream_tokens(client, url, dialect, 16)  # warm this dialect's code paths
            tokens = 0
            before, started = node_cpu_seconds(node), time.perf_counter()
            for _ in range(runs):
                tokens += stream_tokens(client, url, dialect, max_tokens)
            elapsed = time.perf_counter() - started
            cpu = node_cpu_seconds(node) - before
            per_token = cpu * 1000 / max(1, tokens)
            busy = (cpu - idle * elapsed) * 1000 / max(1, tokens)
            rate = tokens / elapsed
            print(f"{dialect:>10} {tokens:>7} {rate:>7.1f} {per_token:>18.3f} {busy:>10.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--url", help="use a running node instead of starting one")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--sizes", default="32,128,512")
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128; 200 with --cpu")
    parser.add_argument("--cpu", action="store_true", help="node CPU ms per streamed token")
    parser.add_argument("--pid", type=int, help="the node's process id (with --url and --cpu)")
    args = parser.parse_args()
    if args.cpu and args.url is not None and args.pid is None:
        parser.error("--cpu with --url needs the node's --pid")
    process = None
    url = args.url
    home: Path | None = None
    if url is None:
        process, url, home = start_node()
    try:
        wait_ready(url)
        if args.cpu:
            pid = args.pid if args.pid is not None else process.pid  # type: ignore[union-attr]
            cpu_per_token(url, pid, args.runs, args.max_tokens or 200)
            return
        args.max_tokens = args.max_tokens or 128
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
        if home is not None:  # the node's temporary EXO_HOME
            shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
