"""NetworkRouter over real zenoh sessions on 127.0.0.1 (distinct ports, loopback-only
multicast scouting on a private group port)."""

from __future__ import annotations

import json
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import zenoh
from anyio.abc import Process
from pydantic import TypeAdapter

from exo.node.election import ElectionMessage
from exo.routing.connections import PeerConnected, PeerDisconnected
from exo.routing.zenoh_router import NetworkRouter, NetworkTopic, open_failure_message
from exo.shared.types.chunks import TokenChunk
from exo.shared.types.commands import ForwarderCommand, PlaceInstance
from exo.shared.types.common import CommandId, ModelId, NodeId, RunnerId
from exo.shared.types.events import ForwarderEvent, IndexedEvent, RunnerDeleted
from exo.testing.ports import free_port

pytestmark = pytest.mark.anyio

COUNT = 200
MODEL = ModelId("test/model")


def _private_group() -> str:
    # A group port of our own (reserved across processes, see exo.testing.ports) so
    # concurrent test runs never scout each other.
    return f"224.0.0.224:{free_port()}"


def _router(
    node_id: str,
    namespace: str = "test",
    *,
    bootstrap: Sequence[str] = (),
    group: str | None = None,
) -> NetworkRouter:
    return NetworkRouter(
        node_id,
        namespace,
        zenoh_port=free_port(),  # reserved: zenoh binds it later, no race
        listen_host="127.0.0.1",
        bootstrap_peers=bootstrap,
        multicast=group is not None,
        multicast_address=group,
    )


@asynccontextmanager
async def _running(*routers: NetworkRouter) -> AsyncIterator[None]:
    try:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as task_group:
                for router in routers:
                    task_group.start_soon(router.start)
        yield
    finally:
        for router in routers:
            await router.close()


async def _wait_for_mesh(routers: Sequence[NetworkRouter], timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        for router in routers:
            expected = {other.node_id for other in routers if other is not router}
            while router.peers != expected:
                await anyio.sleep(0.01)


def _three_meshed() -> tuple[NetworkRouter, NetworkRouter, NetworkRouter]:
    first = _router("node-a")
    second = _router("node-b", bootstrap=[first.listen_endpoint])
    third = _router("node-c", bootstrap=[first.listen_endpoint])
    return first, second, third


async def test_multicast_scouting_finds_every_peer() -> None:
    group = _private_group()
    routers = [_router(f"node-{name}", group=group) for name in "abc"]
    async with _running(*routers):
        await _wait_for_mesh(routers)
        subscription = routers[2].commands.subscribe()
        sent = ForwarderCommand(
            origin=routers[0].node_id,
            command=PlaceInstance(command_id=CommandId("scouted"), model_id=MODEL),
        )
        routers[0].commands.publish(sent)
        with anyio.fail_after(5):
            assert await subscription.receive() == sent


async def test_bootstrap_peers_without_multicast_form_a_mesh() -> None:
    # b and c only know a; zenoh's gossip introduces them to each other.
    routers = _three_meshed()
    async with _running(*routers):
        await _wait_for_mesh(routers)
        for router in routers:
            assert router.multicast is False


async def test_bootstrap_peer_started_later_is_retried() -> None:
    first = _router("node-a")
    second = _router("node-b", bootstrap=[first.listen_endpoint])
    async with _running(second), _running(first):
        await _wait_for_mesh([first, second])


def _command(sender: int, number: int) -> ForwarderCommand:
    return ForwarderCommand(
        origin=NodeId(f"sender-{sender}"),
        command=PlaceInstance(command_id=CommandId(f"{sender}:{number}"), model_id=MODEL),
    )


def _command_number(item: ForwarderCommand) -> tuple[int, int]:
    sender, number = item.command.command_id.split(":")
    return int(sender), int(number)


def _local_event(sender: int, number: int) -> ForwarderEvent:
    return ForwarderEvent(
        origin=NodeId(f"sender-{sender}"),
        origin_session="session-1",
        origin_idx=number,
        event=RunnerDeleted(runner_id=RunnerId("runner")),
    )


def _local_event_number(item: ForwarderEvent) -> tuple[int, int]:
    return int(item.origin.removeprefix("sender-")), item.origin_idx


def _global_event(sender: int, number: int) -> IndexedEvent:
    return IndexedEvent(idx=sender * 100_000 + number, event=RunnerDeleted(runner_id=RunnerId("r")))


def _global_event_number(item: IndexedEvent) -> tuple[int, int]:
    return divmod(item.idx, 100_000)


def _ballot(sender: int, number: int) -> ElectionMessage:
    return ElectionMessage(
        node_id=NodeId(f"sender-{sender}"), clock=number, seniority=0, last_event_idx=-1
    )


def _ballot_number(item: ElectionMessage) -> tuple[int, int]:
    return int(item.node_id.removeprefix("sender-")), item.clock


async def _check_broadcast(
    topics: Sequence[NetworkTopic[Any]],
    make: Callable[[int, int], Any],
    number_of: Callable[[Any], tuple[int, int]],
) -> None:
    """Every router publishes COUNT numbered items; every router (publisher included)
    receives each exactly once, in order per publisher."""
    subscriptions = [topic.subscribe() for topic in topics]
    senders = [topic.sender() for topic in topics]
    for number in range(COUNT):
        for index, sender in enumerate(senders):
            sender.publish(make(index, number))
    with anyio.fail_after(20):
        for subscription in subscriptions:
            received: dict[int, list[int]] = {index: [] for index in range(len(topics))}
            while any(len(numbers) < COUNT for numbers in received.values()):
                sender_index, number = number_of(await subscription.receive())
                received[sender_index].append(number)
            # Any duplicate would have taken the place of a later number above.
            assert received == {index: list(range(COUNT)) for index in range(len(topics))}
            with pytest.raises(anyio.WouldBlock):
                subscription.receive_nowait()


async def test_every_topic_reaches_every_node_once_in_order() -> None:
    routers = _three_meshed()
    ballots: TypeAdapter[ElectionMessage] = TypeAdapter(ElectionMessage)
    elections = [router.election(ballots) for router in routers]
    async with _running(*routers):
        await _wait_for_mesh(routers)
        await _check_broadcast([r.commands for r in routers], _command, _command_number)
        await _check_broadcast([r.local_events for r in routers], _local_event, _local_event_number)
        await _check_broadcast(
            [r.global_events for r in routers], _global_event, _global_event_number
        )
        await _check_broadcast(elections, _ballot, _ballot_number)


async def test_a_lone_router_hears_itself_once() -> None:
    router = _router("alone")
    subscription = router.commands.subscribe()
    async with _running(router):
        router.commands.publish(_command(0, 0))
        router.commands.publish(_command(0, 1))
        with anyio.fail_after(5):
            assert _command_number(await subscription.receive()) == (0, 0)
            assert _command_number(await subscription.receive()) == (0, 1)
        with pytest.raises(anyio.WouldBlock):
            subscription.receive_nowait()


def _chunk(sender: str, owner: str, number: int, last: bool) -> TokenChunk:
    return TokenChunk(
        command_id=CommandId(f"{sender}.{owner}"),
        model=MODEL,
        text=str(number),
        finish_reason="stop" if last else None,
    )


async def test_chunks_reach_only_the_owner_of_the_command() -> None:
    routers = _three_meshed()
    subscriptions = {router.node_id: router.chunks.subscribe() for router in routers}
    chunk_count = 50
    async with _running(*routers):
        await _wait_for_mesh(routers)
        for number in range(chunk_count):
            for sender in routers:
                for owner in routers:
                    last = number == chunk_count - 1
                    sender.chunks.publish_to(
                        owner.node_id, _chunk(sender.node_id, owner.node_id, number, last)
                    )
        with anyio.fail_after(20):
            for owner_id, subscription in subscriptions.items():
                texts: dict[str, list[str]] = {router.node_id: [] for router in routers}
                finished: set[str] = set()
                while len(finished) < len(routers):
                    chunk = await subscription.receive()
                    assert isinstance(chunk, TokenChunk)
                    sender_id, addressed_to = chunk.command_id.split(".")
                    assert addressed_to == owner_id
                    texts[sender_id].append(chunk.text)
                    if chunk.finish_reason is not None:
                        finished.add(sender_id)
                expected = [str(number) for number in range(chunk_count)]
                assert texts == {router.node_id: expected for router in routers}
                with pytest.raises(anyio.WouldBlock):
                    subscription.receive_nowait()


async def test_own_chunks_are_delivered_at_once_in_order() -> None:
    # A node's own API gets its runners' chunks on the spot (no zenoh round trip): each is
    # readable as soon as publish_to returns, in publication order.
    router = _router("node-a")
    subscription = router.chunks.subscribe()
    async with _running(router):
        for number in range(5):
            router.chunks.publish_to(router.node_id, _chunk("node-a", "node-a", number, False))
            received = subscription.receive_nowait()
            assert isinstance(received, TokenChunk) and received.text == str(number)
        await anyio.sleep(0.2)  # nothing arrives a second time through zenoh
        with pytest.raises(anyio.WouldBlock):
            subscription.receive_nowait()


async def test_chunk_sender_looks_up_the_owner() -> None:
    first = _router("node-a")
    second = _router("node-b", bootstrap=[first.listen_endpoint])
    owners = {CommandId("known"): second.node_id}
    subscription = second.chunks.subscribe()
    async with _running(first, second):
        await _wait_for_mesh([first, second])
        publisher = first.chunks.sender(owners.get)
        publisher.publish(TokenChunk(command_id=CommandId("unknown"), model=MODEL, text="x"))
        publisher.publish(TokenChunk(command_id=CommandId("known"), model=MODEL, text="y"))
        with anyio.fail_after(5):
            received = await subscription.receive()
        assert isinstance(received, TokenChunk)
        assert received.text == "y"


async def test_namespaces_never_exchange_messages() -> None:
    alpha = _router("node-a", "alpha")
    alpha_peer = _router("node-b", "alpha", bootstrap=[alpha.listen_endpoint])
    # Same node id as alpha's peer, connected to alpha at the zenoh level.
    beta = _router("node-b", "beta", bootstrap=[alpha.listen_endpoint])
    beta_commands = beta.commands.subscribe()
    beta_chunks = beta.chunks.subscribe()
    beta_connections = beta.connections.subscribe()
    alpha_peer_commands = alpha_peer.commands.subscribe()
    alpha_peer_chunks = alpha_peer.chunks.subscribe()
    async with _running(alpha, alpha_peer, beta):
        await _wait_for_mesh([alpha, alpha_peer])
        session = beta.zenoh_session
        assert session is not None
        with anyio.fail_after(10):
            while not session.info.peers_zid():
                await anyio.sleep(0.01)
        alpha.commands.publish(_command(0, 0))
        alpha.chunks.publish_to(NodeId("node-b"), _chunk("node-a", "node-b", 0, last=True))
        with anyio.fail_after(5):
            assert _command_number(await alpha_peer_commands.receive()) == (0, 0)
            assert isinstance(await alpha_peer_chunks.receive(), TokenChunk)
        beta.commands.publish(_command(1, 0))
        with anyio.fail_after(5):
            assert _command_number(await beta_commands.receive()) == (1, 0)
        for subscription in (beta_commands, beta_chunks, beta_connections):
            with pytest.raises(anyio.WouldBlock):
                subscription.receive_nowait()
        assert beta.peers == frozenset()
        assert alpha.peers == {alpha_peer.node_id}


async def test_invalid_messages_are_dropped() -> None:
    router = _router("node-a")
    subscription = router.commands.subscribe()
    chunks = router.chunks.subscribe()
    async with _running(router):
        config = zenoh.Config.from_json5(
            json.dumps(
                {
                    "mode": "peer",
                    "listen": {"endpoints": []},
                    "connect": {"endpoints": [router.listen_endpoint]},
                    "scouting": {"multicast": {"enabled": False}},
                }
            )
        )
        raw = await anyio.to_thread.run_sync(zenoh.open, config)
        try:
            publisher = raw.declare_publisher(router.commands.key)
            with anyio.fail_after(10):
                while not publisher.matching_status:
                    await anyio.sleep(0.01)
            publisher.put(b"not json")
            publisher.put(b'{"origin": 3}')
            raw.put(f"{router.key_prefix}/chunks/{router.node_id}/x", b"[]")
            publisher.put(router.commands.adapter.dump_json(_command(0, 7)))
            with anyio.fail_after(5):
                assert _command_number(await subscription.receive()) == (0, 7)
            with pytest.raises(anyio.WouldBlock):
                chunks.receive_nowait()
        finally:
            await anyio.to_thread.run_sync(raw.close)


async def test_closing_a_router_disconnects_it_at_once() -> None:
    first = _router("node-a")
    second = _router("node-b", bootstrap=[first.listen_endpoint])
    connections = first.connections.subscribe()
    async with _running(first):
        async with _running(second):
            with anyio.fail_after(10):
                assert await connections.receive() == PeerConnected(node_id=second.node_id)
        # Well inside the lease: the token is withdrawn, not timed out.
        with anyio.fail_after(first.lease_seconds / 2):
            assert await connections.receive() == PeerDisconnected(node_id=second.node_id)
        assert first.peers == frozenset()


async def test_a_node_id_stays_connected_while_any_of_its_sessions_lives() -> None:
    observer = _router("observer")
    old = _router("twin", bootstrap=[observer.listen_endpoint])
    new = _router("twin", bootstrap=[observer.listen_endpoint])
    connections = observer.connections.subscribe()
    async with _running(observer):
        async with _running(new):
            async with _running(old):
                old_session, observer_session = old.zenoh_session, observer.zenoh_session
                assert old_session is not None
                assert observer_session is not None
                old_id = old_session.zid()
                with anyio.fail_after(10):
                    while len(observer_session.info.peers_zid()) < 2:
                        await anyio.sleep(0.01)
            with anyio.fail_after(10):
                while old_id in observer_session.info.peers_zid():
                    await anyio.sleep(0.01)
            with anyio.fail_after(5):
                assert await connections.receive() == PeerConnected(node_id=NodeId("twin"))
            with pytest.raises(anyio.WouldBlock):
                connections.receive_nowait()
            assert observer.peers == {NodeId("twin")}
        with anyio.fail_after(5):
            assert await connections.receive() == PeerDisconnected(node_id=NodeId("twin"))


@asynccontextmanager
async def _peer_process(router: NetworkRouter, node_id: str) -> AsyncIterator[Process]:
    """A router in another process, bootstrapped to `router`, connected on entry."""
    connections = router.connections.subscribe()
    process = await anyio.open_process(
        [
            sys.executable,
            "-m",
            "exo.routing.tests.peer_process",
            node_id,
            router.namespace,
            router.listen_endpoint,
        ]
    )
    try:
        with anyio.fail_after(30):
            assert await connections.receive() == PeerConnected(node_id=NodeId(node_id))
        yield process
    finally:
        connections.close()
        if process.returncode is None:
            process.kill()
        with anyio.fail_after(5), anyio.CancelScope(shield=True):
            await process.wait()
        await process.aclose()


@pytest.mark.parametrize(
    "how",
    [
        # The kernel closes a killed process's sockets: zenoh sees the link drop at once.
        signal.SIGKILL,
        # A frozen process (or a lost link) keeps its sockets: only the lease tells.
        signal.SIGSTOP,
    ],
)
async def test_a_lost_peer_process_is_reported_within_the_lease(how: signal.Signals) -> None:
    router = _router("node-a", "losing")
    connections = router.connections.subscribe()
    async with _running(router), _peer_process(router, "victim") as process:
        assert await connections.receive() == PeerConnected(node_id=NodeId("victim"))
        process.send_signal(how)
        lost_at = time.monotonic()
        with anyio.fail_after(router.lease_seconds + 2):
            assert await connections.receive() == PeerDisconnected(node_id=NodeId("victim"))
        print(f"{how.name}: peer reported gone after {time.monotonic() - lost_at:.2f} s")


def test_topic_names_and_ids_must_fit_in_a_key() -> None:
    router = _router("node-a")
    with pytest.raises(ValueError):
        _router("node/a")
    with pytest.raises(ValueError):
        _router("node-a", "name*space")
    with pytest.raises(ValueError):
        router.topic("chunks", TypeAdapter(int))
    with pytest.raises(ValueError):
        router.topic("commands", TypeAdapter(int))
    numbers: TypeAdapter[int] = TypeAdapter(int)
    assert router.topic("numbers", numbers) is router.topic("numbers", numbers)
    with pytest.raises(RuntimeError):
        router.commands.publish(_command(0, 0))


async def test_publishing_after_close_is_dropped() -> None:
    router = _router("node-a")
    async with _running(router):
        pass
    router.commands.publish(_command(0, 0))
    router.chunks.publish_to(router.node_id, _chunk("a", "a", 0, last=True))


async def test_a_node_whose_bootstrap_peers_never_connect_says_so_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # zenoh retries a bootstrap peer silently (and a TLS peer with another secret is
    # refused silently): a node with a wrong address or secret ran alone, its log mute.
    from loguru import logger

    from exo.routing import zenoh_router

    monkeypatch.setattr(zenoh_router, "ALONE_WARNING_SECONDS", 0.3)
    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(str(message)), level="WARNING")
    nobody = f"tcp/127.0.0.1:{free_port()}"  # nothing listens there
    alone = _router("node-a", bootstrap=[nobody])
    first = _router("node-b")
    joined = _router("node-c", bootstrap=[first.listen_endpoint])
    try:
        async with _running(alone, first, joined):
            await _wait_for_mesh([first, joined])
            await anyio.sleep(1.0)
    finally:
        logger.remove(sink)
    said = [w for w in warnings if "no peer has connected" in w]
    assert len(said) == 1 and nobody in said[0] and "cluster secret" in said[0]


async def test_a_picked_port_taken_before_zenoh_binds_it_is_picked_again() -> None:
    # Port 0 picks a free port when the router is made and zenoh binds it at start:
    # another process can take it in between (a CI run's connections did).
    router = NetworkRouter("node-a", "test", zenoh_port=0, listen_host="127.0.0.1", multicast=False)
    picked = router.listen_port
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", picked))
        squatter.listen()
        async with _running(router):
            assert router.listen_port != picked
            peer = _router("node-b", bootstrap=[router.listen_endpoint])
            connections = router.connections.subscribe()
            async with _running(peer):
                with anyio.fail_after(10):
                    assert await connections.receive() == PeerConnected(node_id=peer.node_id)


async def test_a_port_given_and_taken_fails_the_start() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        router = NetworkRouter(
            "node-a", "test", zenoh_port=taken, listen_host="127.0.0.1", multicast=False
        )
        with pytest.raises(zenoh.ZError, match="Address already in use"):
            await router.start()
        assert router.listen_port == taken
        await router.close()


def test_an_open_failure_is_one_line_without_rust_source_paths() -> None:
    router = NetworkRouter(
        "node-a", "test", zenoh_port=53999, listen_host="127.0.0.1", multicast=False
    )
    taken = zenoh.ZError(
        "Can not create a new TCP listener bound to tcp/127.0.0.1:53999: [127.0.0.1:53999: "
        "Address already in use (os error 98) at /root/.cargo/git/checkouts/zenoh-9c599d5ef3e"
        "0480e/cc83980/io/zenoh-link-commons/src/tcp.rs:61.] at /root/.cargo/git/checkouts/"
        "zenoh-9c599d5ef3e0480e/cc83980/io/zenoh-links/zenoh-link-tcp/src/unicast.rs:338."
    )
    assert open_failure_message(taken, router) == (
        "cannot listen on 127.0.0.1:53999 (the links between nodes, --zenoh-port): address "
        "already in use (another exo or program holds the port: start this node with a "
        "--zenoh-port of its own)"
    )
    other = zenoh.ZError("Invalid endpoint [x] at /home/u/zenoh/io/zenoh-links/src/lib.rs:12.")
    assert open_failure_message(other, router) == (
        "cannot open cluster links on tcp/127.0.0.1:53999: Invalid endpoint [x]"
    )
