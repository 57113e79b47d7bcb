"""Chaos: a node's link is cut and restored. Two nodes run in two network namespaces the
scenario creates, joined by one veth pair with addresses only inside them (10.231.0.1 and
10.231.0.2); both namespaces, and so the pair, are deleted at the end, even on failure. The
test process talks to each node's API from a thread that entered its namespace.

While cut, each side elects its own master and keeps serving its own instance; once the
link is back, the sides converge to one history (the election winner's) holding both
instances, and both nodes serve."""

from __future__ import annotations

import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

import httpx

from exo.testing.processes import (
    ExoNode,
    die_with_this_thread,
    exo_command,
    stop_all,
    wait_until,
)
from tests.chaos.harness import Load, Row, current_netns, enter_netns, serves
from tests.test_cluster import place_on

T = TypeVar("T")
SUBNET = "10.231.0"
READY_SECONDS = 600.0
HEAL_SECONDS = 300.0
API_SECONDS = 60.0


def _ip(*arguments: str) -> None:
    subprocess.run(["ip", *arguments], check=True, capture_output=True, timeout=30)


@contextmanager
def linked_namespaces() -> Iterator[tuple[str, str]]:
    """Two fresh network namespaces joined by a veth pair (`veth-a` 10.231.0.1/24 in the
    first, `veth-b` 10.231.0.2/24 in the second), loopback up in both; deleted afterwards."""
    tag = uuid.uuid4().hex[:8]
    names = (f"exo-chaos-{tag}-a", f"exo-chaos-{tag}-b")
    created: list[str] = []
    try:
        for name in names:
            _ip("netns", "add", name)
            created.append(name)
            _ip("-n", name, "link", "set", "lo", "up")
        _ip("-n", names[0], "link", "add", "veth-a", "type", "veth", "peer", "name", "veth-b",
            "netns", names[1])  # fmt: skip
        for index, (name, link) in enumerate(zip(names, ("veth-a", "veth-b"), strict=True)):
            _ip("-n", name, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", link)
            _ip("-n", name, "link", "set", link, "up")
        yield names
    finally:
        for name in created:
            subprocess.run(["ip", "netns", "del", name], check=False, timeout=30)


class NamespacedNode(ExoNode):
    """An `exo` node started inside a network namespace (`ip netns exec`), listening on
    every address of that namespace; the cluster link is its veth address."""

    def __init__(self, netns: str, address: str, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.netns = netns
        self.address = address
        self._thread = ThreadPoolExecutor(1, initializer=enter_netns, initargs=(netns,))

    @property
    def zenoh_endpoint(self) -> str:
        return f"tcp/{self.address}:{self.zenoh_port}"

    def launch(self) -> ExoNode:
        """As `ExoNode.launch`, through `ip netns exec` (which execs the node, so the
        process and its group are the node's own)."""
        self.home.mkdir(parents=True, exist_ok=True)
        self.process = subprocess.Popen(
            [
                "ip", "netns", "exec", self.netns, exo_command(),
                "--host", "0.0.0.0",
                "--api-port", str(self.port),
                "--zenoh-port", str(self.zenoh_port),
                "--namespace", self.namespace,
                "--no-multicast",
                "--bootstrap-peers", ",".join(p.zenoh_endpoint for p in self.bootstrap),
                *self.extra_args,
            ],
            env=self.environment(),
            stdout=self.log_path.open("ab"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_this_thread(),
        )  # fmt: skip
        return self

    def inside(self, call: Callable[[], T]) -> T:
        """`call()` on a thread inside this node's namespace (for its API); at once when
        the calling thread is already there."""
        if current_netns() == self.netns:
            return call()
        return self._thread.submit(call).result(timeout=300)

    def _get(self, path: str) -> dict[str, Any]:
        # Longer than ExoNode's 5-10 s: a node busy merging two histories on a loaded
        # machine has taken longer to answer.
        response = httpx.get(f"{self.url}{path}", timeout=API_SECONDS)
        response.raise_for_status()
        answer: dict[str, Any] = response.json()
        return answer

    def state(self) -> dict[str, Any]:
        return self.inside(lambda: self._get("/state"))

    def cluster(self) -> dict[str, Any]:
        return self.inside(lambda: self._get("/cluster"))

    def node_id(self) -> str:
        return self.inside(super().node_id)

    def _api_up(self) -> bool:
        return self.inside(super()._api_up)


def _comparable(node: NamespacedNode) -> dict[str, Any]:
    state = node.state()
    for volatile in ("topology", "tasks", "runners", "node_info", "downloads"):
        state.pop(volatile, None)
    return state


def link_cut_and_restored(root: Path, models: Path) -> Row:
    row = Row("cut a node's link (netns), restore it")
    with linked_namespaces() as (ns_a, ns_b):
        a = NamespacedNode(
            ns_a, f"{SUBNET}.1", root / "a", models, ("--no-default-model", "--force-master")
        )
        b = NamespacedNode(
            ns_b, f"{SUBNET}.2", root / "b", models, ("--no-default-model",),
            namespace=a.namespace, bootstrap=(a,),
        )  # fmt: skip
        for node in (a, b):
            node.launch()
        try:
            for node in (a, b):
                node.wait_api()
            a_id, b_id = a.node_id(), b.node_id()
            wait_until(
                lambda: a.cluster()["master"] == a_id == b.cluster()["master"],
                120,
                what="one master",
            )
            on_a = a.inside(lambda: place_on(a, a_id))
            on_b = a.inside(lambda: place_on(a, b_id))
            for node, instance in ((a, on_a), (b, on_b)):
                wait_until(
                    lambda n=node, i=instance: n.inside(lambda: n.serving(i)),  # type: ignore[misc]
                    READY_SECONDS,
                    interval=0.5,
                    what="both instances ready",
                )
            loads = [Load(a, netns=ns_a).start(), Load(b, netns=ns_b).start()]
            try:
                loads[1].wait_mid_stream()
                _ip("-n", ns_a, "link", "set", "veth-a", "down")
                cut_at = time.monotonic()
                wait_until(lambda: b.cluster()["master"] == b_id, 60, what="B's own master")
                row.note(f"split: B elected itself {time.monotonic() - cut_at:.1f} s in")
                for node in (a, b):
                    wait_until(lambda n=node: n.inside(lambda: serves(n)), 300,  # type: ignore[misc]
                               what="each side serving")  # fmt: skip
                row.note(f"both sides served while cut ({time.monotonic() - cut_at:.1f} s)")
                _ip("-n", ns_a, "link", "set", "veth-a", "up")
                healed_at = time.monotonic()

                last: list[str] = []

                def one_state() -> bool:
                    masters = {a.cluster()["master"], b.cluster()["master"]}
                    mine, theirs = _comparable(a), _comparable(b)
                    differ = sorted(k for k in mine if mine[k] != theirs.get(k))
                    last[:] = [
                        f"masters {masters}, differing {differ}, instances "
                        f"{sorted(mine['instances'])} / {sorted(theirs['instances'])}"
                    ]
                    return (
                        len(masters) == 1 and not differ and {on_a, on_b} <= set(mine["instances"])
                    )

                try:
                    wait_until(one_state, HEAL_SECONDS, interval=0.5, what="one state")
                except TimeoutError as error:
                    raise AssertionError(f"{error}; last seen: {last}") from error
                row.note(f"one state {time.monotonic() - healed_at:.1f} s after the heal")
                for node in (a, b):
                    wait_until(lambda n=node: n.inside(lambda: serves(n)), 300,  # type: ignore[misc]
                               what="both serving after the heal")  # fmt: skip
                row.recovery_s = time.monotonic() - healed_at
            finally:
                for load in loads:
                    load.stop()
            for load in loads:
                load_row = Row("side")
                load_row.from_load(load, cut_at)
                row.requests += load_row.requests
                row.failed += load_row.failed
                row.unclean += load_row.unclean
                row.notes.extend(load_row.notes)
            assert row.unclean == 0, row.notes
        finally:
            stop_all([a, b])
    return row
