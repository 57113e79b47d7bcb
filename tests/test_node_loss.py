"""Node loss on three real `exo` processes on loopback: the master stays, healthy
instances keep serving without a failed request, a lost instance is placed again and
serves (a chat sent meanwhile waits for it), and a restarting node acts only on the
cluster's current state.

One cluster runs every scenario in turn, so the start-ups are paid once. Figures are
printed, never asserted on.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from exo.api.serving.accepted_generation import REPLACEMENT_WAIT_SECONDS
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until
from tests.test_cluster import (
    FORM_TIMEOUT_SECONDS,
    identical_states,
    make_cluster,
    place_on,
    running,
    same_master,
)

POLL_SECONDS = 0.2
# "Answer in one sentence." keeps SmolLM2's greedy answer ("The capital of France is Paris.")
# clear of near ties: without it the first token leads "The" over "L" by one bfloat16 step
# (25.25 vs 25.125), and the concurrent chats here, computed in a batch, may take "L" and answer
# "L'Étoile, ..." without Paris. With it, every step leads by 1.0 or more.
QUESTION = "What is the capital of France? Answer in one sentence."
READY_SECONDS = 300.0


# A question whose answer runs to max_tokens (SmolLM2 answers QUESTION in ~8 tokens): the
# chats that must be in flight on the dying node when it is killed.
LONG_QUESTION = "Write a long story about a lighthouse keeper and a storm."


def chat(
    node: ExoNode, max_tokens: int, timeout: float = 180.0, question: str = QUESTION
) -> httpx.Response:
    return httpx.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": question}],
            "temperature": 0,
            "max_tokens": max_tokens,
        },
        timeout=timeout,
    )


def nodes_of(instance: dict[str, Any]) -> set[str]:
    return set(instance["shard_assignments"]["node_to_runner"])


@dataclass
class Watch:
    """Polls, on threads, chats through one node (one every `POLL_SECONDS`, or as soon as
    the previous one answered when that takes longer: one at a time, as a client would)
    and the master that given nodes report, until stopped."""

    via: ExoNode
    observers: list[ExoNode]
    expected_master: str
    results: list[tuple[float, int, str]] = field(default_factory=list)
    masters_seen: set[str | None] = field(default_factory=set)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Watch:
        for target in (self._chats, self._masters):
            thread = threading.Thread(target=target, daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=200)

    def failures(self) -> list[tuple[float, int, str]]:
        return [result for result in self.results if result[1] != 200]

    def _chats(self) -> None:
        while not self._stop.is_set():
            sent = time.monotonic()
            try:
                response = chat(self.via, max_tokens=4)
                outcome = (response.status_code, response.text[:300])
            except httpx.HTTPError as error:
                outcome = (0, repr(error))
            self.results.append((time.monotonic() - sent, *outcome))
            self._stop.wait(max(0.0, POLL_SECONDS - (time.monotonic() - sent)))

    def _masters(self) -> None:
        while not self._stop.is_set():
            for node in self.observers:
                try:
                    self.masters_seen.add(node.cluster()["master"])
                except httpx.HTTPError as error:
                    self.masters_seen.add(f"unreachable: {error!r}")
            self._stop.wait(0.1)


def unfinished_task_on(node: ExoNode, instance_id: str) -> bool:
    return any(
        task["instance_id"] == instance_id
        and task["status"]["kind"] in ("TaskPending", "TaskRunning")
        for task in node.state()["tasks"].values()
    )


def queue_behind(node: ExoNode, instance_id: str, pool: ThreadPoolExecutor) -> list[Future[Any]]:
    """Send long chats (~2 s each here) through `node` until one is in flight on
    `instance_id` (routing sends each to the least busy instance, so a few suffice). A task
    is pending only for the moment until its runner takes it into the batch, too short to
    catch by polling; a non-streaming answer lost mid-way is sent again whole, as one with
    no token yet."""
    sent: list[Future[Any]] = []
    for _ in range(6):
        sent.append(pool.submit(chat, node, 160, 180.0, LONG_QUESTION))
        try:
            wait_until(lambda: unfinished_task_on(node, instance_id), 3, 0.05)
            return sent
        except TimeoutError:
            continue
    raise AssertionError(f"no request was ever in flight on {instance_id}")


def caught_up(node: ExoNode, master: ExoNode) -> bool:
    """`node` holds the master's history as of now: its instances, its nodes (chats keep
    going meanwhile, so tasks and runner statuses may differ by a moment)."""
    ahead = master.state()
    mine = node.state()
    return (
        mine["last_event_applied_idx"] >= ahead["last_event_applied_idx"]
        and mine["instances"] == ahead["instances"]
        and set(mine["node_info"]) == set(ahead["node_info"])
        and len(mine["node_info"]) == 3
    )


def measure(what: str, started: float, condition: Callable[[], Any], timeout: float) -> Any:
    result = wait_until(condition, timeout, interval=0.2, what=what)
    print(f"{what}: {time.monotonic() - started:.1f} s")
    return result


def test_node_loss_is_a_non_event_for_everyone_not_using_that_node(
    tmp_path: Path, shared_models_dir: Path
) -> None:
    nodes = make_cluster(tmp_path, shared_models_dir, 3, first_args=("--force-master",))
    a, b, c = nodes
    with running(nodes):
        master = wait_until(lambda: same_master(nodes), FORM_TIMEOUT_SECONDS, what="one master")
        assert master == a.node_id()
        wait_until(lambda: identical_states(nodes), FORM_TIMEOUT_SECONDS, what="same state")
        b_id, c_id = b.node_id(), c.node_id()
        on_b, on_c = place_on(a, b_id), place_on(a, c_id)
        for instance_id in (on_b, on_c):
            wait_until(lambda i=instance_id: a.serving(i), READY_SECONDS, what="both ready")  # type: ignore[misc]

        # 1. B (not the master, holding one of two instances) dies while chats go through
        # A every 0.2 s and a long request is in flight on B's instance.
        watch = Watch(via=a, observers=[a, c], expected_master=master).start()
        with ThreadPoolExecutor(6) as pool:
            long_chats = queue_behind(a, on_b, pool)
            b.kill()
            killed = time.monotonic()
            measure(
                "B's instance unavailable in A's state",
                killed,
                lambda: on_b in a.state()["unavailable_instances"],
                30,
            )
            moved = measure(
                "B's instance re-placed and serving",
                killed,
                lambda: a.serving(on_b),
                READY_SECONDS,
            )
            assert b_id not in nodes_of(moved) and nodes_of(moved) <= {a.node_id(), c_id}
            long_answers = [future.result(timeout=200) for future in long_chats]
        time.sleep(1.0)  # a few more polls after the recovery
        watch.stop()
        latencies = sorted(result[0] for result in watch.results)
        print(
            f"chats through A: {len(watch.results)}, failed: {len(watch.failures())}, "
            f"slowest {latencies[-1]:.1f} s; masters seen: {watch.masters_seen}"
        )
        assert watch.failures() == []
        assert [answer.status_code for answer in long_answers] == [200] * len(long_answers)
        assert watch.masters_seen == {master}
        assert any(e["kind"] == "NodeLost" and e["node_id"] == b_id for e in a.events())
        assert f"node {b_id} left (link lost)" in a.log_path.read_text()
        assert "lost its instance before answering; sent again" in a.log_path.read_text()

        # 2. B restarts from its own log, which still places an instance on it: it starts
        # no runner and announces nothing before it holds the cluster's state; joining
        # does not unseat the master.
        watch = Watch(via=c, observers=[a, c], expected_master=master).start()
        restarted = ExoNode(
            b.home,
            shared_models_dir,
            extra_args=("--no-default-model",),
            namespace=a.namespace,
            bootstrap=(a,),
        )
        log_before = b.log_path.read_text()
        with running([restarted]):
            wait_until(lambda: caught_up(restarted, a), 60, what="B caught up")
            time.sleep(2.0)  # room for a wrongly started runner to show
            assert restarted.runner_processes() == []
            new_lines = restarted.log_path.read_text()[len(log_before) :]
            assert " is ready" not in new_lines, new_lines
            watch.stop()
            assert watch.failures() == [] and watch.masters_seen == {master}

            # 3. The only instance's node dies: it is placed again on a survivor, and a
            # chat sent meanwhile waits for it instead of a 503.
            for instance_id in (on_b, on_c):
                deleted = httpx.delete(f"{a.url}/instance/{instance_id}", timeout=60)
                assert deleted.status_code == 200, deleted.text
            only = place_on(a, c_id)
            wait_until(lambda: a.serving(only), READY_SECONDS, what="the only instance ready")
            c.kill()
            killed = time.monotonic()
            measure(
                "the only instance unavailable in A's state",
                killed,
                lambda: only in a.state()["unavailable_instances"],
                30,
            )
            sent = time.monotonic()
            waited = chat(a, max_tokens=8, timeout=REPLACEMENT_WAIT_SECONDS + 60)
            print(
                f"a chat sent during the recovery: {waited.status_code} after "
                f"{time.monotonic() - sent:.1f} s {waited.text[:300]}"
            )
            assert waited.status_code == 200 and "Paris" in waited.text, waited.text
            assert "being placed again" in a.log_path.read_text()  # it waited for it
            again = measure(
                "the only instance re-placed and serving",
                killed,
                lambda: a.serving(only),
                READY_SECONDS,
            )
            assert nodes_of(again) <= {a.node_id(), restarted.node_id()}
            answer = chat(a, max_tokens=8)
            assert answer.status_code == 200 and "Paris" in answer.text, answer.text
            # Nothing of the deleted instances stays in the state.
            state = a.state()
            assert set(state["instances"]) == {only}
            stale = [r for r in state["runners"] if not r.startswith(only)]
            assert stale == [] and state["instance_failures"] == {}
