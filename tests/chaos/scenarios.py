"""The chaos scenarios: each injects one fault into real `exo` processes on loopback under a
load of streaming chats, checks that nothing hangs and every request ends cleanly, and
returns its row of the table (fault, seconds until the cluster serves again, requests sent
while it recovered, how many failed cleanly). `pytest -m chaos` (tests/chaos/test_chaos.py)
and `bench/chaos.py` run the same functions.

The SIGKILL scenarios come in two forms: `runner_killed_mid_stream(root, models)` and the
like start their own fresh nodes (`bench/chaos.py`); `kill_runner_mid_stream(node)` and the
like inject the same fault, with the same checks, into nodes already running, which is how
the default run plays them on the cluster it shares with the failover tests
(tests/test_failover.py).

A scenario raises AssertionError (or TimeoutError, past a generous deadline) when the
cluster misbehaves. Times are measured from the fault and printed, never asserted on
beyond the deadlines.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until
from tests.chaos.harness import Load, Row, serves, short_chat
from tests.test_cluster import FORM_TIMEOUT_SECONDS, make_cluster, place_on, running, same_master

READY_SECONDS = 600.0
RECOVERY_SECONDS = 600.0
STOP_SECONDS = 40.0


def _recovered(row: Row, node: ExoNode, fault_at: float, timeout: float = RECOVERY_SECONDS) -> None:
    wait_until(lambda: serves(node), timeout, interval=0.5, what=f"{node.url} serving again")
    row.recovery_s = time.monotonic() - fault_at
    row.note(f"serving again {row.recovery_s:.1f} s after the fault")


def _check_load(row: Row, load: Load, fault_at: float) -> None:
    row.from_load(load, fault_at)
    assert row.unclean == 0, f"requests ended uncleanly: {[e.detail for e in load.unclean()]}"


def _master_pair(root: Path, models: Path) -> list[ExoNode]:
    return make_cluster(root, models, 2, first_args=("--force-master",))


def runner_killed_mid_stream(root: Path, models: Path) -> Row:
    """SIGKILL the runner of a lone node while chats stream: they fail cleanly, the worker
    starts a new runner, and the node serves again."""
    node = ExoNode(root / "node", models)
    with running([node]):
        node.wait_ready(timeout=READY_SECONDS)
        return kill_runner_mid_stream(node)


def kill_runner_mid_stream(node: ExoNode) -> Row:
    """The runner scenario on a running `node` whose one runner serves the cluster's only
    instance of the default model (so no other instance can take its stream over)."""
    row = Row("SIGKILL a runner mid-stream")
    [runner] = node.runner_processes()
    load = Load(node).start()
    try:
        load.wait_mid_stream()
        runner.send_signal(signal.SIGKILL)
        fault_at = time.monotonic()
        _recovered(row, node, fault_at)
        new = node.runner_processes()
        assert [r.pid for r in new] != [runner.pid], "the killed runner was not replaced"
        time.sleep(2.0)
    finally:
        load.stop()
    _check_load(row, load, fault_at)
    assert load.count("failed", fault_at) >= 1, "the stream in flight did not fail"
    return row


def master_killed_mid_stream(root: Path, models: Path) -> Row:
    """SIGKILL the master while chats stream through the other node to an instance on it:
    the other node becomes master and keeps serving."""
    nodes = _master_pair(root, models)
    with running(nodes):
        wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        return kill_master_mid_stream(*nodes)


def kill_master_mid_stream(a: ExoNode, b: ExoNode) -> Row:
    """The master scenario on two running nodes of one cluster, `a` its master (and no
    other node alive): an instance of the default model is placed on `b`, chats stream
    through `b`, `a` is killed; `b` must elect itself and serve."""
    row = Row("SIGKILL the master mid-stream")
    b_id = b.node_id()
    instance = place_on(a, b_id)
    wait_until(lambda: b.serving(instance), READY_SECONDS, interval=0.5, what="ready on B")
    load = Load(b).start()
    try:
        load.wait_mid_stream()
        fault_at = time.monotonic()  # before: `kill` returns once the node is reaped
        a.kill()
        wait_until(lambda: b.cluster()["master"] == b_id, 60, what="B elected")
        row.note(f"B master {time.monotonic() - fault_at:.1f} s after the kill")
        _recovered(row, b, fault_at)
        time.sleep(2.0)
    finally:
        load.stop()
    _check_load(row, load, fault_at)
    return row


def pipeline_rank_node_killed(root: Path, models: Path) -> Row:
    """SIGKILL the node holding one rank of a two-node pipeline instance mid-stream: the
    instance is placed again on the survivor and serves; the stream in flight either goes
    on there (mid-stream failover, `api/serving/failover.py`, once the new instance is
    ready within its deadline) or fails cleanly, never uncleanly."""
    nodes = _master_pair(root, models)
    with running(nodes):
        wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        return kill_pipeline_rank_node(*nodes)


def kill_pipeline_rank_node(a: ExoNode, b: ExoNode) -> Row:
    """The pipeline scenario on two running nodes of one cluster, no other node alive (`a`
    serves the chats and survives, `b` is killed), the cluster holding no instance yet. A
    chat sent once the instance is marked unavailable (being placed again on `a`) waits
    for it and is answered (`accepted_generation.Generation.submit`)."""
    row = Row("SIGKILL a pipeline rank's node")
    body = {
        "model_id": DEFAULT_MODEL_ID,
        "sharding": "pipeline",
        "node_ids": [a.node_id(), b.node_id()],
        "min_nodes": 2,
    }

    def place() -> httpx.Response | None:
        # 400 until the nodes have measured their link to each other.
        answer = httpx.post(f"{a.url}/place_instance", json=body, timeout=60)
        return answer if answer.status_code == 200 else None

    placed = wait_until(place, 120, interval=1.0, what="a pipeline placement")
    instance = placed.json()["instance_id"]
    wait_until(lambda: a.serving(instance), READY_SECONDS, interval=0.5, what="both ranks")
    load = Load(a).start()
    try:
        load.wait_mid_stream()
        # Before the kill: `kill` returns only once the node is reaped (up to seconds on a
        # loaded machine), and a stream that ended meanwhile was in flight at the fault.
        fault_at = time.monotonic()
        b.kill()
        # A new request while the instance is being placed again waits for it, no 503.
        wait_until(
            lambda: instance in a.state()["unavailable_instances"], 60, interval=0.1,
            what="the instance marked unavailable",
        )  # fmt: skip
        sent = time.monotonic()
        answer = short_chat(a)
        assert answer.status_code == 200, f"refused while re-placed: {answer.text[:300]}"
        row.note(
            f"a chat sent {sent - fault_at:.1f} s after the kill, the instance being placed "
            f"again, answered {time.monotonic() - sent:.1f} s later"
        )
        _recovered(row, a, fault_at)
        time.sleep(2.0)
    finally:
        load.stop()
    _check_load(row, load, fault_at)
    in_flight = [e for e in load.ended if e.sent < fault_at <= e.sent + e.seconds]
    assert in_flight, "no stream was in flight at the kill"
    continued = sum(e.kind == "ok" for e in in_flight)
    row.note(
        f"in flight at the kill: {continued} continued on the re-placed instance, "
        f"{len(in_flight) - continued} failed cleanly"
    )
    return row


def node_stopped_40_s(root: Path, models: Path) -> Row:
    """SIGSTOP a node (and its runners) for 40 s, then SIGCONT: the other node removes it
    once its lease runs out, requests to its instance fail cleanly (none hangs), the
    instance is placed again, and the stopped node rejoins when it resumes."""
    row = Row(f"SIGSTOP a node {STOP_SECONDS:.0f} s, SIGCONT")
    nodes = _master_pair(root, models)
    a, b = nodes
    with running(nodes):
        wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        b_id = b.node_id()
        instance = place_on(a, b_id)
        wait_until(lambda: a.serving(instance), READY_SECONDS, interval=0.5, what="ready on B")
        load = Load(a).start()
        assert b.process is not None
        try:
            load.wait_mid_stream()
            os.killpg(b.process.pid, signal.SIGSTOP)
            fault_at = time.monotonic()
            try:
                wait_until(
                    lambda: b_id not in a.state()["node_info"], STOP_SECONDS, what="B removed"
                )
                row.note(f"B removed from A's state {time.monotonic() - fault_at:.1f} s in")
                _recovered(row, a, fault_at, timeout=STOP_SECONDS * 10)
            finally:
                time.sleep(max(0.0, fault_at + STOP_SECONDS - time.monotonic()))
                os.killpg(b.process.pid, signal.SIGCONT)
            resumed = time.monotonic()
            wait_until(
                lambda: b_id in a.state()["node_info"] and b.cluster()["master"] == a.node_id(),
                120,
                what="B rejoined",
            )
            row.note(f"B rejoined {time.monotonic() - resumed:.1f} s after SIGCONT")
            wait_until(lambda: serves(b), 120, what="B's API serving after it resumed")
            time.sleep(2.0)
        finally:
            load.stop()
        _check_load(row, load, fault_at)
        slowest = max(e.seconds for e in load.ended)
        row.note(f"slowest request {slowest:.1f} s")
    return row


def event_log_truncated_while_stopped(root: Path, models: Path) -> Row:
    """Stop a lone node, cut its event log mid-record, restart it: it sets the damaged log
    aside, continues from the good records and serves (recovery = restart to serving)."""
    row = Row("truncate the event log while stopped")
    node = ExoNode(root / "node", models)
    with running([node]):
        node.wait_ready(timeout=READY_SECONDS)
        assert serves(node)
    log = node.home / "event_log.jsonl"
    data = log.read_bytes()
    log.write_bytes(data[: len(data) - 17])
    row.note(f"event log cut from {len(data)} to {len(data) - 17} bytes")
    restarted = ExoNode(node.home, models)
    restarted_at = time.monotonic()
    with running([restarted]):
        _recovered(row, restarted, restarted_at)
    set_aside = sorted(p.name for p in node.home.glob("event_log.jsonl.corrupt-*"))
    assert set_aside, "the damaged log was not set aside"
    row.note(f"set aside: {set_aside}")
    return row
