"""Cluster figures on one machine: formation time, failover time, and the latency a
second node adds to a chat stream.

Starts three `exo` nodes on loopback (bootstrap peers, distinct ports, fresh data dirs,
the default model converted once into the shared models directory), then prints:
- formation: launch of the three processes -> one master and identical state everywhere
  (includes ~3 s of Python start-up per process);
- per-token latency of a stream from node A (which runs the instance) asked directly,
  and asked through node B: median inter-chunk gap and TTFT over several requests;
- failover: SIGKILL of the master -> the survivors agree on a new master and a state.

Usage: python bench/bench_cluster.py [--requests 5] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until

QUESTION = [{"role": "user", "content": "Tell me about the history of Paris."}]


def stream_timings(node: ExoNode, max_tokens: int) -> tuple[float, list[float]]:
    """(TTFT s, gaps between content chunks in s) of one streaming request."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": QUESTION,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
    }
    arrivals: list[float] = []
    sent = time.perf_counter()
    with httpx.stream(
        "POST", f"{node.url}/v1/chat/completions", json=body, timeout=120
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.perf_counter())
    gaps = [later - earlier for earlier, later in itertools.pairwise(arrivals)]
    return arrivals[0] - sent, gaps


def agreed_master(nodes: list[ExoNode], excluded: str | None = None) -> str | None:
    masters = {node.cluster()["master"] for node in nodes}
    if len(masters) != 1:
        return None
    master = masters.pop()
    return master if master not in (None, excluded) else None


def same_state(nodes: list[ExoNode], expected_nodes: int) -> bool:
    states = []
    for node in nodes:
        state = node.state()
        state.pop("topology")
        states.append(state)
    return all(s == states[0] for s in states) and len(states[0]["node_info"]) == expected_nodes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path.home() / ".local" / "share" / "exo" / "models",
        help="where the default model is (or will be) converted",
    )
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="exo-bench-cluster-"))
    a = ExoNode(root / "a", args.models_dir, extra_args=("--no-default-model", "-q"))
    b = ExoNode(
        root / "b", args.models_dir, ("--no-default-model", "-q"), namespace=a.namespace,
        bootstrap=(a,),
    )  # fmt: skip
    c = ExoNode(
        root / "c", args.models_dir, ("--no-default-model", "-q"), namespace=a.namespace,
        bootstrap=(a,),
    )  # fmt: skip
    nodes = [a, b, c]
    try:
        launched = time.monotonic()
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_api()
        wait_until(lambda: agreed_master(nodes), 60, interval=0.05)
        wait_until(lambda: same_state(nodes, 3), 60, interval=0.05)
        formation = time.monotonic() - launched

        placed = httpx.post(
            f"{a.url}/place_instance",
            json={"model_id": DEFAULT_MODEL_ID, "node_ids": [a.node_id()]},
            timeout=600,
        )
        placed.raise_for_status()
        a.wait_ready()
        stream_timings(a, 8)  # first request after warm-up
        results = {}
        for name, node in (("A (runs the instance)", a), ("B (forwards to A)", b)):
            ttfts, gaps = [], []
            for _ in range(args.requests):
                ttft, request_gaps = stream_timings(node, args.max_tokens)
                ttfts.append(ttft)
                gaps.extend(request_gaps)
            results[name] = (statistics.median(ttfts), statistics.median(gaps))

        master_id = agreed_master(nodes)
        master = next(node for node in nodes if node.node_id() == master_id)
        survivors = [node for node in nodes if node is not master]
        killed = time.monotonic()
        master.kill()
        wait_until(lambda: agreed_master(survivors, excluded=master_id), 60, interval=0.05)
        # The dead node stays in the state until it times out (30 s); agreement is enough.
        wait_until(lambda: same_state(survivors, 3), 60, interval=0.05)
        failover = time.monotonic() - killed

        print(f"3-node cluster formed in {formation:.1f} s (from process launch)")
        print(f"failover after SIGKILL of the master: {failover:.1f} s")
        print(f"{'asked node':<24} {'TTFT ms':>8} {'per-token ms':>13} {'tok/s':>7}")
        for name, (ttft, gap) in results.items():
            print(f"{name:<24} {ttft * 1000:>8.1f} {gap * 1000:>13.2f} {1 / gap:>7.1f}")
        direct, forwarded = results["A (runs the instance)"], results["B (forwards to A)"]
        print(
            f"added by the extra hop: {(forwarded[1] - direct[1]) * 1000:+.2f} ms per token, "
            f"{(forwarded[0] - direct[0]) * 1000:+.1f} ms TTFT"
        )
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
