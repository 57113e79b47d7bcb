"""Cluster figures on one machine: formation time, the latency a second node adds to a
chat stream, and what each kind of node loss costs the model's users.

Starts three `exo` nodes on loopback (bootstrap peers, distinct ports, fresh data dirs,
the default model converted once into the shared models directory), then prints:
- formation: launch of the three processes -> one master and identical state everywhere
  (includes ~3 s of Python start-up per process);
- per-token latency of a stream from node A (which runs the instance) asked directly,
  and asked through node B: median inter-chunk gap and TTFT over several requests;
- node loss, for each kind (a non-master node holding one of two instances; the master
  node holding one of two instances; a node of the only instance, split over two nodes):
  SIGKILL of the node while a client asks a surviving node for a short chat every 0.2 s
  (one at a time); prints the failed requests, the seconds the model was unavailable
  (the longest time between two answers), the slowest answer,
  and how long until the lost instance served again (placed anew on the remaining nodes).
  The killed node is started again (same data directory) before the next kind.
- join sync (first, and alone with `--join-sync-only`, which needs no model): a master
  whose history holds 100 and then 100,000 events, written with the `EventLog` API into
  its data directory before it starts (it compacts the long one into a snapshot when it
  loads it); a fresh node joins it: launch -> it holds the master's history (same
  history id, the master's last event). Also written to `--json`.

Usage: python bench/bench_cluster.py [--requests 5] [--max-tokens 64] [--join-sync-only]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from exo.node.event_log import EventLog
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    Event,
    IndexedEvent,
    TopologyEdgeMeasured,
)
from exo.shared.types.nodes import TopologyEdge
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


@dataclass
class ChatPoller:
    """A client asking `node` for a short chat every `interval` seconds, one at a time."""

    node: ExoNode
    interval: float = 0.2
    results: list[tuple[float, float, int]] = field(default_factory=list)
    """(sent, seconds, HTTP status or 0 for a transport error), in order."""
    errors: set[str] = field(default_factory=set)
    """The distinct error bodies (first 240 characters)."""
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> ChatPoller:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=300)

    def _run(self) -> None:
        body = {
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 4,
            "temperature": 0,
        }
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                response = httpx.post(
                    f"{self.node.url}/v1/chat/completions", json=body, timeout=180
                )
                status = response.status_code
                if status != 200:
                    self.errors.add(f"{status} {response.text[:240]}")
            except httpx.HTTPError as error:
                status = 0
                self.errors.add(repr(error))
            self.results.append((sent, time.monotonic() - sent, status))
            self._stop.wait(max(0.0, self.interval - (time.monotonic() - sent)))

    def failed(self) -> int:
        return sum(status != 200 for _, _, status in self.results)

    def unavailable_seconds(self) -> float:
        """The longest time the model answered no request: between two consecutive
        answers (a failed request in between counts as no answer)."""
        answered = sorted(sent + seconds for sent, seconds, status in self.results if status == 200)
        return max(
            (later - earlier for earlier, later in itertools.pairwise(answered)), default=0.0
        )

    def slowest(self) -> float:
        return max((seconds for _, seconds, _ in self.results), default=0.0)


def place(via: ExoNode, node_ids: list[str], sharding: str = "pipeline") -> str:
    placed = httpx.post(
        f"{via.url}/place_instance",
        json={"model_id": DEFAULT_MODEL_ID, "node_ids": node_ids, "sharding": sharding,
              "min_nodes": len(node_ids)},
        timeout=600,
    )  # fmt: skip
    placed.raise_for_status()
    instance_id: str = placed.json()["instance_id"]
    return instance_id


def delete_all(via: ExoNode) -> None:
    for instance_id in list(via.state()["instances"]):
        httpx.delete(f"{via.url}/instance/{instance_id}", timeout=60).raise_for_status()


def loss(
    name: str,
    victim: ExoNode,
    via: ExoNode,
    lost_instance: str,
    others: list[str],
    survivors: list[ExoNode],
) -> tuple[str, int, int, float, float, float, float]:
    """Kill `victim` while polling chats through `via`; returns the figures."""
    for instance_id in [lost_instance, *others]:
        wait_until(lambda i=instance_id: via.serving(i), 600, interval=0.2)  # type: ignore[misc]
    victim_id = victim.node_id()
    poller = ChatPoller(via).start()
    time.sleep(2.0)  # a few answered requests before the loss
    victim.kill()
    killed = time.monotonic()
    wait_until(lambda: agreed_master(survivors, excluded=victim_id), 60, interval=0.05)
    master_seconds = time.monotonic() - killed
    wait_until(lambda: via.serving(lost_instance), 600, interval=0.1)
    serving_again = time.monotonic() - killed
    time.sleep(2.0)
    poller.stop()
    for error in sorted(poller.errors):
        print(f"  {name}: {error}")
    return (
        name,
        len(poller.results),
        poller.failed(),
        poller.unavailable_seconds(),
        poller.slowest(),
        master_seconds,
        serving_again,
    )


def restart(node: ExoNode, models_dir: Path, bootstrap: ExoNode) -> ExoNode:
    """The same node (data directory, id) started again, on new ports."""
    again = ExoNode(
        node.home, models_dir, ("--no-default-model", "-q"), namespace=bootstrap.namespace,
        bootstrap=(bootstrap,),
    )  # fmt: skip
    return again.start()


def write_history(home: Path, count: int) -> None:
    """A history of `count` events for the node of `home` (its node id written too):
    mostly refused commands (no state change), every tenth an edge measurement between
    two machines that never join."""
    master = NodeId.new()
    home.mkdir(parents=True, exist_ok=True)
    (home / "node_id").write_text(master)
    source, sink = NodeId("bench-source"), NodeId("bench-sink")
    events: list[IndexedEvent] = []
    for idx in range(count):
        event: Event
        if idx == 0:
            event = ClusterHistoryStarted(history_id=f"bench-{count}", master=master)
        elif idx % 10 == 0:
            edge = TopologyEdge(
                source=source, sink=sink, address="192.0.2.1",
                latency_ms=float(idx % 97), bandwidth_mbps=1000.0,
            )  # fmt: skip
            event = TopologyEdgeMeasured(edge=edge)
        else:
            event = CommandRejected(
                command_id=CommandId(f"bench-{idx}"), origin=master, reason="bench", status_code=400
            )
        events.append(IndexedEvent(idx=idx, event=event))
    log = EventLog(home / "event_log.jsonl")
    log.append(events)
    log.close()


def join_sync(root: Path, count: int) -> dict[str, float]:
    """Seconds: the master's launch -> API, and a joining node's launch -> API and ->
    holding the master's whole history."""
    master = ExoNode(root / f"master-{count}", None, ("--no-default-model", "-q", "--force-master"))
    write_history(master.home, count)
    joiner = ExoNode(
        root / f"joiner-{count}", None, ("--no-default-model", "-q"),
        namespace=master.namespace, bootstrap=(master,),
    )  # fmt: skip
    try:
        launched = time.monotonic()
        master.start()
        master_api = time.monotonic() - launched
        wait_until(lambda: master.cluster()["master"] == master.node_id(), 120, interval=0.05)
        target = master.state()
        launched = time.monotonic()
        joiner.launch()
        joiner.wait_api()
        joiner_api = time.monotonic() - launched

        def synced() -> bool:
            state = joiner.state()
            return bool(
                state["history_id"] == target["history_id"]
                and state["last_event_applied_idx"] >= target["last_event_applied_idx"]
            )

        wait_until(synced, 300, interval=0.05)
        joined = time.monotonic() - launched
    finally:
        joiner.stop()
        master.stop()
    return {"events": count, "master_api_s": master_api, "joiner_api_s": joiner_api,
            "join_sync_s": joined}  # fmt: skip


def print_join_sync(results: list[dict[str, float]]) -> None:
    print(
        f"{'history events':>14} {'master up s':>11} {'joiner up s':>11} {'joined s':>8} "
        f"{'joined after up s':>17}"
    )
    for row in results:
        print(
            f"{row['events']:>14,.0f} {row['master_api_s']:>11.1f} "
            f"{row['joiner_api_s']:>11.1f} {row['join_sync_s']:>8.1f} "
            f"{row['join_sync_s'] - row['joiner_api_s']:>17.2f}"
        )
    print(
        "(joined: the new node's launch -> it holds the master's history; up: launch -> API "
        "answering, Python start-up included; the master's up includes reading and "
        "compacting its history)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--models-dir",
        type=Path,
        default=Path.home() / ".local" / "share" / "exo" / "models",
        help="where the default model is (or will be) converted",
    )
    parser.add_argument("--join-sync-only", action="store_true", help="only the join-sync table")
    parser.add_argument("--json", type=Path, help="also write the join-sync figures here")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="exo-bench-cluster-"))
    sync_results = [join_sync(root, count) for count in (100, 100_000)]
    print_join_sync(sync_results)
    if args.json is not None:
        args.json.write_text(json.dumps({"join_sync": sync_results}, indent=2))
    if args.join_sync_only:
        return
    a = ExoNode(
        root / "a", args.models_dir, extra_args=("--no-default-model", "-q", "--force-master")
    )
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

        losses = []
        delete_all(a)
        # 1. A non-master node holding one of two instances (chats through the master).
        on_b, on_c = place(a, [b.node_id()]), place(a, [c.node_id()])
        losses.append(loss("non-master node (1 of 2 instances)", b, a, on_b, [on_c], [a, c]))
        nodes[1] = b = restart(b, args.models_dir, a)
        wait_until(lambda: same_state(nodes, 3), 120, interval=0.2)
        # 2. The node of a split instance, the model's only one (chats through the master).
        delete_all(a)
        split = place(a, [b.node_id(), c.node_id()])
        losses.append(loss("node of a split instance (only instance)", c, a, split, [], [a, b]))
        nodes[2] = c = restart(c, args.models_dir, a)
        wait_until(lambda: same_state(nodes, 3), 120, interval=0.2)
        # 3. The master node holding one of two instances (chats through another node).
        delete_all(a)
        on_a, on_c = place(a, [a.node_id()]), place(a, [c.node_id()])
        losses.append(loss("master node (1 of 2 instances)", a, c, on_a, [on_c], [b, c]))

        print(f"3-node cluster formed in {formation:.1f} s (from process launch)")
        print(f"{'asked node':<24} {'TTFT ms':>8} {'per-token ms':>13} {'tok/s':>7}")
        for name, (ttft, gap) in results.items():
            print(f"{name:<24} {ttft * 1000:>8.1f} {gap * 1000:>13.2f} {1 / gap:>7.1f}")
        direct, forwarded = results["A (runs the instance)"], results["B (forwards to A)"]
        print(
            f"added by the extra hop: {(forwarded[1] - direct[1]) * 1000:+.2f} ms per token, "
            f"{(forwarded[0] - direct[0]) * 1000:+.1f} ms TTFT"
        )
        print("node loss (SIGKILL), a chat every 0.2 s through a surviving node:")
        print(
            f"{'lost':<42} {'requests':>8} {'failed':>6} {'unavailable s':>13} "
            f"{'slowest s':>9} {'master s':>8} {'serving again s':>15}"
        )
        for name, requests, failed, unavailable, slowest, master_s, again in losses:
            print(
                f"{name:<42} {requests:>8} {failed:>6} {unavailable:>13.1f} "
                f"{slowest:>9.1f} {master_s:>8.1f} {again:>15.1f}"
            )
        print(
            "(unavailable: the longest time between two answers, normal service included; "
            "slowest: the longest request, a retried one waiting for the re-placed instance "
            "included; master: until the survivors agree on a master; serving again: the "
            "lost instance placed anew and ready)"
        )
    finally:
        for node in nodes:
            node.stop()


if __name__ == "__main__":
    main()
