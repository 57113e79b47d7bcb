"""Decode and prefill with the runner's weights on huge pages or not, interleaved.

A node advises its runners' malloc to back memory with transparent huge pages where the
kernel's mode is "madvise" (`exo.utils.heap.advise_huge_pages`: `GLIBC_TUNABLES=
glibc.malloc.hugetlb=1`). The tunable is read when a process starts, so this bench starts
two engine processes on the same model, one with the tunable and one without, keeps both
loaded, and alternates one request at a time between them (which goes first alternates by
round): prefill tok/s (prompt tokens / time to the first token) and decode tok/s (tokens
after the first / time from the first to the last) per round, then the median and range
per process, and each process's RSS and `AnonHugePages` (from /proc) after loading.

The default model is bench_moe.py's cached random GGUF of Qwen3-30B-A3B's shapes (18 of
48 layers; run bench_moe.py once to build it), whose decode reads 8 experts of ~1 MB per
layer; `--model` takes any converted model directory. Numbers only; nothing is asserted.

Usage: python bench/bench_huge_pages.py [--model DIR] [--rounds 5] [--prompt 128]
    [--decode 32] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

DEFAULT_MODEL = Path.home() / ".cache/exo-bench-moe/qwen3-30b-a3b-shapes-18L-q4_k.exo"
WORKER = r"""
import json, sys
import torch
torch.set_num_threads(int(sys.argv[2]))
from pathlib import Path
from exo.benchmark.engine_runner import load_engine_for_bench, run_engine
from exo.benchmark.prompts import ModelText
model_dir = Path(sys.argv[1])
engine = load_engine_for_bench(model_dir)
text = ModelText.load(model_dir)
memory = {}
for name, path in (("rss_kib", "/proc/self/status"), ("huge_kib", "/proc/self/smaps_rollup")):
    for line in open(path):
        if line.startswith("VmRSS:" if name == "rss_kib" else "AnonHugePages:"):
            memory[name] = int(line.split()[1])
print(json.dumps(memory), flush=True)
for line in sys.stdin:
    length, decode, seed = (int(v) for v in line.split())
    prompt = text.random_prompt(length, seed)[0]
    result = run_engine(engine, [prompt], decode, text)
    timing = result.requests[0]
    prefill = timing.prompt_tokens / (timing.first_token_s - timing.submitted_s)
    decode_s = timing.last_token_s - timing.first_token_s
    print(json.dumps({"prefill": prefill, "decode": (timing.completion_tokens - 1) / decode_s}),
          flush=True)
"""


def _start(model: Path, threads: int, huge: bool) -> subprocess.Popen[str]:
    env = dict(os.environ)
    tunables = [t for t in env.get("GLIBC_TUNABLES", "").split(":") if t]
    tunables = [t for t in tunables if not t.startswith("glibc.malloc.hugetlb")]
    if huge:
        tunables.append("glibc.malloc.hugetlb=1")
    env["GLIBC_TUNABLES"] = ":".join(tunables)
    return subprocess.Popen(
        [sys.executable, "-c", WORKER, str(model), str(threads)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )  # fmt: skip


def _answer(process: subprocess.Popen[str]) -> dict[str, float]:
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line:
        raise RuntimeError(f"an engine process ended (exit {process.wait()})")
    answer: dict[str, float] = json.loads(line)
    return answer


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if not args.model.is_dir():
        raise SystemExit(f"{args.model} is no model directory (run bench/bench_moe.py first)")
    print(
        f"model {args.model.name}, {args.threads} threads, prompt {args.prompt}, decode "
        f"{args.decode}, {args.rounds} rounds; load average {os.getloadavg()[0]:.1f}"
    )
    names = ("4 KiB pages", "huge pages advised")
    processes = {}
    try:
        for name, huge in zip(names, (False, True), strict=True):
            processes[name] = _start(args.model, args.threads, huge)
            memory = _answer(processes[name])  # loads one at a time: their peaks apart
            print(
                f"  {name}: RSS {memory['rss_kib'] / 1024:.0f} MiB, AnonHugePages "
                f"{memory['huge_kib'] / 1024:.0f} MiB"
            )
        results: dict[str, list[dict[str, float]]] = {name: [] for name in names}
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                process = processes[name]
                assert process.stdin is not None
                process.stdin.write(f"{args.prompt} {args.decode} {round_index}\n")
                process.stdin.flush()
                results[name].append(_answer(process))
        for name in names:
            for key in ("prefill", "decode"):
                values = [result[key] for result in results[name]]
                print(
                    f"  {name:18s} {key:7s} tok/s median {statistics.median(values):7.2f} "
                    f"(range {min(values):.2f}-{max(values):.2f})"
                )
        print(f"load average after {os.getloadavg()[0]:.1f}")
    finally:
        for process in processes.values():
            if process.stdin is not None:
                process.stdin.close()
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()


if __name__ == "__main__":
    main()
