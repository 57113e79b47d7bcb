"""A node warns once per peer that runs with another cluster secret (zenoh refuses such a
link in silence): the bootstrap peers and the peers scouting hears are probed with a TLS
handshake of this node's own; a certificate the cluster CA did not sign is one warning
naming the peer, however many rounds follow; a peer with the same secret, a linked peer
and a `tcp/` peer are never warned about."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest
from loguru import logger

from exo.routing.cluster_tls import ClusterSecret, TlsFiles
from exo.routing.secret_mismatch import (
    ProbeVerdict,
    SecretMismatchWatch,
    probe_tls,
    tls_address,
)
from exo.routing.zenoh_router import NetworkRouter
from exo.testing.ports import free_port

SECRET = "correct horse battery staple"


@pytest.fixture
def tls_files(tmp_path: Path) -> TlsFiles:
    return ClusterSecret(SECRET).write_tls_files(tmp_path / "node")


@pytest.fixture
def warnings() -> Iterator[list[tuple[str, str]]]:
    """(thread name, message) of every warning logged while the test runs."""
    logged: list[tuple[str, str]] = []
    sink = logger.add(
        lambda message: logged.append((message.record["thread"].name, message.record["message"])),
        level="WARNING",
        format="{message}",
    )
    try:
        yield logged
    finally:
        logger.remove(sink)


class ScriptedProbe:
    """`probe_tls` stand-in: a fixed verdict per (host, port), every call recorded."""

    def __init__(self, verdicts: dict[tuple[str, int], ProbeVerdict]) -> None:
        self.verdicts = verdicts
        self.calls: list[tuple[str, int]] = []

    def __call__(self, host: str, port: int, tls: TlsFiles, timeout: float) -> ProbeVerdict:
        self.calls.append((host, port))
        return self.verdicts.get((host, port), "no answer")


def _watch(
    tls: TlsFiles, probe: ScriptedProbe, bootstrap: tuple[str, ...], linked: set[str]
) -> SecretMismatchWatch:
    return SecretMismatchWatch(
        "me", tls, bootstrap, None, lambda: linked, "own-zid", interval_seconds=60, probe=probe
    )


def test_a_peer_with_another_secret_is_warned_about_once(
    tls_files: TlsFiles, warnings: list[tuple[str, str]]
) -> None:
    probe = ScriptedProbe({("10.0.0.7", 52414): "another secret"})
    watch = _watch(tls_files, probe, ("tls/10.0.0.7:52414",), set())
    rounds = [watch.check_once() for _ in range(5)]
    assert [len(warned) for warned in rounds] == [1, 0, 0, 0, 0]
    assert probe.calls == [("10.0.0.7", 52414)]  # settled: never probed again
    (message,) = [message for _, message in warnings]
    assert message.startswith("tls/10.0.0.7:52414 presents a TLS certificate")
    assert "the cluster secrets differ" in message


def test_unanswered_peers_are_retried_and_same_secret_peers_settled(
    tls_files: TlsFiles, warnings: list[tuple[str, str]]
) -> None:
    probe = ScriptedProbe({("10.0.0.8", 1): "same secret"})
    watch = _watch(tls_files, probe, ("tls/10.0.0.8:1", "tls/10.0.0.9:2", "tcp/10.0.0.5:3"), set())
    for _ in range(3):
        assert watch.check_once() == []
    assert probe.calls == [("10.0.0.8", 1), ("10.0.0.9", 2), ("10.0.0.9", 2), ("10.0.0.9", 2)]
    assert warnings == []


def test_scouted_peers_are_probed_unless_linked_or_this_node(tls_files: TlsFiles) -> None:
    probe = ScriptedProbe({("127.0.0.1", 5): "another secret", ("127.0.0.1", 6): "another secret"})
    watch = _watch(tls_files, probe, (), {"linked-zid"})

    class Hello:
        def __init__(self, zid: str, locators: list[str]) -> None:
            self.zid, self.locators = zid, locators

    for hello in (
        Hello("own-zid", ["tls/127.0.0.1:4"]),
        Hello("linked-zid", ["tls/127.0.0.1:6"]),
        Hello("rogue-zid", ["tcp/127.0.0.1:9", "tls/127.0.0.1:5"]),
    ):
        watch.heard(hello)  # type: ignore[arg-type]  # a zenoh.Hello's two properties
    (warning,) = watch.check_once()
    assert warning.startswith("zenoh peer rogue-zid at tls/127.0.0.1:5 presents")
    assert probe.calls == [("127.0.0.1", 5)]


@pytest.mark.parametrize(
    ("locator", "address"),
    [
        ("tls/127.0.0.1:7447", ("127.0.0.1", 7447)),
        ("tls/[::1]:7447", ("::1", 7447)),
        ("tls/192.168.1.2:7447#iface=eth0", ("192.168.1.2", 7447)),
        ("tcp/127.0.0.1:7447", None),
        ("tls/nohost", None),
    ],
)
def test_tls_address(locator: str, address: tuple[str, int] | None) -> None:
    assert tls_address(locator) == address


# ---------------------------------------------------------------- real routers, loopback


def _router(
    node_id: str, group: str, tls: TlsFiles, bootstrap: tuple[str, ...] = ()
) -> NetworkRouter:
    return NetworkRouter(
        node_id,
        "secret-mismatch-test",
        zenoh_port=free_port(),
        listen_host="127.0.0.1",
        bootstrap_peers=bootstrap,
        multicast_address=group,
        tls=tls,
        secret_check_seconds=0.2,
    )


@asynccontextmanager
async def _running(*routers: NetworkRouter) -> AsyncIterator[None]:
    try:
        with anyio.fail_after(20):
            for router in routers:
                await router.start()
        yield
    finally:
        for router in routers:
            await router.close()


@pytest.mark.anyio
async def test_routers_with_different_secrets_each_warn_once_about_the_other(
    tmp_path: Path, warnings: list[tuple[str, str]]
) -> None:
    group = f"224.0.0.224:{free_port()}"
    secret = ClusterSecret(SECRET)
    first = _router("member-a", group, secret.write_tls_files(tmp_path / "a"))
    second = _router(
        "member-b", group, secret.write_tls_files(tmp_path / "b"), (first.listen_endpoint,)
    )
    foreign_files = ClusterSecret("another cluster's secret").write_tls_files(tmp_path / "c")
    rogue = _router("rogue", group, foreign_files, (first.listen_endpoint,))

    def about(watcher: NetworkRouter, peer: NetworkRouter) -> list[str]:
        return [
            message
            for thread, message in warnings
            if thread == f"exo-secret-watch-{watcher.node_id}" and peer.listen_endpoint in message
        ]

    async with _running(first, second, rogue):
        with anyio.fail_after(20):
            while not (
                about(first, rogue) and about(second, rogue) and about(rogue, first)
                and about(rogue, second)
            ):  # fmt: skip
                await anyio.sleep(0.05)
        await anyio.sleep(2.0)  # ten more rounds: no second warning about anyone
        assert first.peers == {second.node_id} and rogue.peers == frozenset()
    for watcher, peer in ((first, rogue), (second, rogue), (rogue, first), (rogue, second)):
        assert len(about(watcher, peer)) == 1, (watcher.node_id, peer.node_id, warnings)
    # Members never warn about each other.
    assert about(first, second) == [] and about(second, first) == []


def test_a_probe_of_nothing_listening_is_no_answer(tls_files: TlsFiles) -> None:
    # Real listeners with the same and another secret: the routers' test above.
    assert probe_tls("127.0.0.1", free_port(), tls_files, 1.0) == "no answer"
