"""Several real `exo` processes on loopback forming one cluster."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import openai

from exo.testing.processes import (
    API_TIMEOUT_SECONDS,
    DEFAULT_MODEL_ID,
    ExoNode,
    stop_all,
    wait_until,
)

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
# A bound on forming a cluster or failing over, not a measure of its speed (printed):
# three nodes on a loaded 2-core machine take far longer than on an idle one.
FORM_TIMEOUT_SECONDS = 60.0
LATE_JOIN_SECONDS = 30.0


def ask(node: ExoNode, timeout: float = 120.0) -> str:
    client = openai.OpenAI(
        base_url=f"{node.url}/v1", api_key="unused", timeout=timeout, max_retries=0
    )
    completion = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=30
    )
    return completion.choices[0].message.content or ""


def comparable_state(node: ExoNode) -> dict[str, Any]:
    state = node.state()
    # Link measurements are per observer and keep changing; everything else must match.
    state.pop("topology")
    return state


def same_master(nodes: list[ExoNode]) -> str | None:
    masters = {node.cluster()["master"] for node in nodes}
    if len(masters) == 1 and None not in masters:
        return masters.pop()
    return None


def identical_states(nodes: list[ExoNode]) -> dict[str, Any] | None:
    states = [comparable_state(node) for node in nodes]
    if all(state == states[0] for state in states) and len(states[0]["node_info"]) == len(nodes):
        return states[0]
    return None


@contextmanager
def running(nodes: list[ExoNode]) -> Iterator[list[ExoNode]]:
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_api()
        yield nodes
    finally:
        stop_all(nodes)


def make_cluster(
    root: Path, models: Path, count: int, first_args: tuple[str, ...] = ()
) -> list[ExoNode]:
    first = ExoNode(root / "node-0", models, extra_args=("--no-default-model", *first_args))
    others = [
        ExoNode(
            root / f"node-{i}",
            models,
            extra_args=("--no-default-model",),
            namespace=first.namespace,
            bootstrap=(first,),
        )
        for i in range(1, count)
    ]
    return [first, *others]


def place_on(node: ExoNode, target_node_id: str) -> str:
    response = httpx.post(
        f"{node.url}/place_instance",
        json={"model_id": DEFAULT_MODEL_ID, "node_ids": [target_node_id]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    instance_id: str = response.json()["instance_id"]
    return instance_id


def test_three_nodes_form_one_cluster_and_serve_from_any_node(
    tmp_path: Path, shared_models_dir: Path
) -> None:
    with running(make_cluster(tmp_path, shared_models_dir, 3)) as nodes:
        started = time.monotonic()
        master = wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        state = wait_until(
            lambda: identical_states(nodes), FORM_TIMEOUT_SECONDS, what="identical states"
        )
        print(f"cluster formed in {time.monotonic() - started:.1f}s")
        node_ids = {node.node_id() for node in nodes}
        assert master in node_ids
        assert set(state["node_info"]) == node_ids
        assert all(info["memory"]["total_bytes"] > 0 for info in state["node_info"].values())
        for node in nodes:
            assert set(node.cluster()["peers"]) == node_ids - {node.node_id()}

        # Every node measures its links to the others.
        wait_until(
            lambda: all(
                len(nodes[0].state()["topology"].get(node_id, {})) == 2 for node_id in node_ids
            ),
            timeout=30,
            what="topology edges between all nodes",
        )

        # A model placed through node A on node A answers through B and C.
        a, b, c = nodes
        place_on(a, a.node_id())
        a.wait_ready(timeout=120)
        for node in (b, c):
            assert "Paris" in ask(node)
        # The chunks went straight to the asking node, the runner ran on A only.
        assert a.runner_processes() and not b.runner_processes() and not c.runner_processes()


def test_master_failover_keeps_state_and_instances(tmp_path: Path, shared_models_dir: Path) -> None:
    nodes = make_cluster(tmp_path, shared_models_dir, 3, first_args=("--force-master",))
    with running(nodes):
        master, b, c = nodes
        assert wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS) == master.node_id()
        wait_until(lambda: identical_states(nodes), FORM_TIMEOUT_SECONDS, what="same state")
        instance_id = place_on(c, b.node_id())
        b.wait_ready(timeout=120)
        assert "Paris" in ask(c)

        old_master = master.node_id()
        master.kill()
        killed_at = time.monotonic()
        survivors = [b, c]
        new_master = wait_until(
            lambda: (m := same_master(survivors)) and m != old_master and m,
            FORM_TIMEOUT_SECONDS,
            what="a new master",
        )
        wait_until(
            lambda: comparable_state(b) == comparable_state(c),
            FORM_TIMEOUT_SECONDS,
            what="survivors agree",
        )
        print(f"failover took {time.monotonic() - killed_at:.1f}s")
        assert new_master in {b.node_id(), c.node_id()}
        assert instance_id in c.state()["instances"]
        assert "Paris" in ask(c)

        # New commands work under the new master.
        deleted = httpx.delete(f"{c.url}/instance/{instance_id}", timeout=60)
        assert deleted.status_code == 200, deleted.text
        wait_until(lambda: not b.runner_processes(), timeout=30, what="runner on B stopped")
        place_on(b, c.node_id())
        c.wait_ready(timeout=120)
        assert "Paris" in ask(b)


def test_namespaces_isolate_clusters(tmp_path: Path, shared_models_dir: Path) -> None:
    alpha = ExoNode(tmp_path / "alpha", shared_models_dir, extra_args=("--no-default-model",))
    # Beta even connects to alpha's links: only the namespace keeps them apart.
    beta = ExoNode(
        tmp_path / "beta",
        shared_models_dir,
        extra_args=("--no-default-model",),
        bootstrap=(alpha,),
    )
    with running([alpha, beta]):
        for node in (alpha, beta):
            wait_until(lambda n=node: n.cluster()["master"], FORM_TIMEOUT_SECONDS)  # type: ignore[misc]
        wait_until(
            lambda: alpha.state()["node_info"] and beta.state()["node_info"],
            FORM_TIMEOUT_SECONDS,
            what="both nodes' own reports",
        )
        time.sleep(3)  # give stray messages, if any, time to arrive before checking
        for node in (alpha, beta):
            view = node.cluster()
            assert view["master"] == view["node_id"]
            assert view["peers"] == []
            assert list(node.state()["node_info"]) == [view["node_id"]]


def test_late_joiner_catches_up(tmp_path: Path, shared_models_dir: Path) -> None:
    nodes = make_cluster(tmp_path, shared_models_dir, 2)
    with running(nodes):
        started = time.monotonic()
        wait_until(lambda: identical_states(nodes), FORM_TIMEOUT_SECONDS, what="same state")
        first = nodes[0]
        place_on(first, first.node_id())
        first.wait_ready(timeout=120)
        # Enough history that the newcomer must replay it.
        assert "Paris" in ask(nodes[1])
        # The scenario: a node that starts 30 s after the others.
        time.sleep(max(0.0, LATE_JOIN_SECONDS - (time.monotonic() - started)))
        late = ExoNode(
            tmp_path / "late",
            shared_models_dir,
            extra_args=("--no-default-model",),
            namespace=first.namespace,
            bootstrap=(nodes[1],),
        )
        with running([late]):
            everyone = [*nodes, late]
            # The same state and the same last event applied, read in one pass: the cluster
            # keeps appending events (node reports), so one may land between two reads.
            wait_until(
                lambda: (
                    identical_states(everyone)
                    and late.state()["last_event_applied_idx"]
                    == first.state()["last_event_applied_idx"]
                ),
                FORM_TIMEOUT_SECONDS,
                what="late node caught up, at the same last event",
            )
            assert "Paris" in ask(late)


def node_reports_agree(nodes: list[ExoNode]) -> bool:
    """One master, and every node's state holds every node's report."""
    if same_master(nodes) is None:
        return False
    node_ids = {node.node_id() for node in nodes}
    return all(set(node.state()["node_info"]) == node_ids for node in nodes)


def place_and_delete(node: ExoNode, moment: str) -> str:
    """Place the default model through `node`, check the instance is in `node`'s state,
    delete it (so no runner stays loading), and return its id."""
    sent_at = time.monotonic()
    placed = httpx.post(
        f"{node.url}/place_instance", json={"model_id": DEFAULT_MODEL_ID}, timeout=90
    )
    print(f"placement at {moment} answered in {time.monotonic() - sent_at:.1f}s")
    assert placed.status_code == 200, placed.text
    instance_id: str = placed.json()["instance_id"]
    assert instance_id in node.state()["instances"]
    deleted = httpx.delete(f"{node.url}/instance/{instance_id}", timeout=60)
    assert deleted.status_code == 200, deleted.text
    return instance_id


def delete_missing(node: ExoNode, instance_id: str) -> str:
    """A command that needs no node report: sent at once, even before a master is known."""
    deleted = httpx.delete(f"{node.url}/instance/{instance_id}", timeout=60)
    assert deleted.status_code == 404, deleted.text
    return instance_id


def test_placements_from_the_first_answer_on_are_applied_exactly_once(
    tmp_path: Path, shared_models_dir: Path
) -> None:
    """Commands sent at any moment after the API answers — while the nodes still start,
    connect and elect — are carried out exactly once (none lost, none twice)."""
    nodes = make_cluster(tmp_path, shared_models_dir, 3)
    placements: list[Future[str]] = []
    refusals: list[Future[str]] = []
    try:
        with ThreadPoolExecutor(max_workers=9) as pool:
            for node in nodes:
                node.launch()
            # Each node gets a placement and a deletion of a missing instance the moment
            # its API first answers (the deletion is sent during the election).
            waiting = list(nodes)
            deadline = time.monotonic() + API_TIMEOUT_SECONDS
            while waiting and time.monotonic() < deadline:
                for node in [n for n in waiting if api_answers(n)]:
                    placements.append(pool.submit(place_and_delete, node, "first answer"))
                    probe = f"missing-{len(waiting)}"
                    refusals.append(pool.submit(delete_missing, node, probe))
                    waiting.remove(node)
                time.sleep(0.02)
            assert not waiting, f"a node's API did not answer within {API_TIMEOUT_SECONDS:.0f} s"
            wait_until(lambda: node_reports_agree(nodes), FORM_TIMEOUT_SECONDS, what="nodes agree")
            agreed_at = time.monotonic()
            for node, delay in zip(nodes, (0.0, 1.0, 3.0), strict=True):
                time.sleep(max(0.0, agreed_at + delay - time.monotonic()))
                placements.append(pool.submit(place_and_delete, node, f"agreement +{delay:.0f}s"))
            instance_ids = [placement.result(timeout=120) for placement in placements]
            probes = [refusal.result(timeout=120) for refusal in refusals]

        assert len(set(instance_ids)) == len(instance_ids) == 6
        wait_until(
            lambda: all(
                sum(e["kind"] == "InstanceDeleted" for e in n.events()) >= len(instance_ids)
                for n in nodes
            ),
            30,
            what="every node holds the deletions",
        )
        for node in nodes:
            events = node.events()
            created = [e for e in events if e["kind"] == "InstanceCreated"]
            assert sorted(e["instance"]["instance_id"] for e in created) == sorted(instance_ids)
            assert len({e["command_id"] for e in created}) == len(created)
            deleted = [e["instance_id"] for e in events if e["kind"] == "InstanceDeleted"]
            assert sorted(deleted) == sorted(instance_ids)
            rejected = [e for e in events if e["kind"] == "CommandRejected"]
            assert sorted(e["reason"] for e in rejected) == sorted(
                f"no instance '{probe}'" for probe in probes
            )
    finally:
        with ThreadPoolExecutor(max_workers=len(nodes)) as stopping:
            list(stopping.map(ExoNode.stop, nodes))  # all at once: a node waits for its runners


def api_answers(node: ExoNode) -> bool:
    try:
        return httpx.get(f"{node.url}/node_id", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
