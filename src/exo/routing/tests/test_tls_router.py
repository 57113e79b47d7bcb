"""NetworkRouter with a cluster secret on 127.0.0.1: members mesh over mutual TLS; a router
with another secret, an open router and raw zenoh sessions in the same namespace and
multicast group never link to a member, receive nothing, and inject nothing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import zenoh

from exo.routing.cluster_tls import ClusterSecret, TlsFiles
from exo.routing.zenoh_router import NetworkRouter
from exo.shared.types.commands import ForwarderCommand, PlaceInstance
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.testing.ports import free_port

pytestmark = pytest.mark.anyio

NAMESPACE = "tls-test"
MODEL = ModelId("test/model")
# How long a rogue is given to link, receive or inject after the members exchanged
# messages; a real link forms within a second on loopback (bounded, not measured).
QUIET_SECONDS = 3.0


def _router(
    node_id: str, group: str, tls: TlsFiles | None, bootstrap: Sequence[str] = ()
) -> NetworkRouter:
    return NetworkRouter(
        node_id,
        NAMESPACE,
        zenoh_port=free_port(),  # reserved: zenoh binds it later, no race
        listen_host="127.0.0.1",
        bootstrap_peers=bootstrap,
        multicast=True,
        multicast_address=group,
        tls=tls,
    )


def _command(origin: str, name: str) -> ForwarderCommand:
    return ForwarderCommand(
        origin=NodeId(origin), command=PlaceInstance(command_id=CommandId(name), model_id=MODEL)
    )


def _raw_session(group: str, connect: Sequence[str], tls: TlsFiles | None = None) -> zenoh.Session:
    """A bare zenoh peer in the members' multicast group, dialing `connect`."""
    link: dict[str, Any] = {}
    if tls is not None:
        link["tls"] = tls.zenoh_tls_config()
    protocol = "tcp" if tls is None else "tls"
    config = {
        "mode": "peer",
        "listen": {"endpoints": [f"{protocol}/127.0.0.1:{free_port()}"]},
        "connect": {"endpoints": list(connect)},
        "scouting": {"multicast": {"enabled": True, "address": group, "interface": "127.0.0.1"}},
        "transport": {"link": link},
    }
    return zenoh.open(zenoh.Config.from_json5(json.dumps(config)))


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


async def test_only_routers_with_the_secret_link_and_exchange_messages(tmp_path: Path) -> None:
    group = f"224.0.0.224:{free_port()}"
    secret = ClusterSecret("correct horse battery staple")
    first = _router("member-a", group, secret.write_tls_files(tmp_path / "a"))
    second = _router(
        "member-b", group, secret.write_tls_files(tmp_path / "b"), [first.listen_endpoint]
    )
    members = (first, second)
    tcp_form = first.listen_endpoint.replace("tls/", "tcp/")
    foreign_files = ClusterSecret("another cluster's secret").write_tls_files(tmp_path / "rogue")
    foreign = _router("rogue-tls", group, foreign_files, [first.listen_endpoint])
    open_router = _router("rogue-open", group, None, [tcp_form])
    rogues = (foreign, open_router)
    seen: list[str] = []  # every key and payload the raw sessions receive
    member_subscriptions = [member.commands.subscribe() for member in members]
    rogue_subscriptions = [rogue.commands.subscribe() for rogue in rogues]
    raw_sessions = [
        _raw_session(group, [tcp_form, first.listen_endpoint]),
        _raw_session(group, [first.listen_endpoint], foreign_files),
    ]
    try:
        for session in raw_sessions:
            session.declare_subscriber(
                "**", lambda sample: seen.append(f"{sample.key_expr} {sample.payload.to_string()}")
            )
            session.liveliness().declare_subscriber(
                "**", lambda sample: seen.append(str(sample.key_expr)), history=True
            )
        assert first.listen_endpoint.startswith("tls/127.0.0.1:")
        async with _running(*members, *rogues):
            with anyio.fail_after(20):
                while first.peers != {second.node_id} or second.peers != {first.node_id}:
                    await anyio.sleep(0.05)
            first.commands.publish(_command(first.node_id, "from-a"))
            for subscription in member_subscriptions:
                with anyio.fail_after(10):
                    assert (await subscription.receive()).command.command_id == "from-a"

            # Every rogue forges a command on the members' commands key.
            forged = _command("forger", "forged").model_dump_json().encode()
            for session in raw_sessions:
                session.put(f"exo/{NAMESPACE}/commands", forged)
            for rogue in rogues:
                rogue.commands.publish(_command("forger", "forged"))
            await anyio.sleep(QUIET_SECONDS)
            second.commands.publish(_command(second.node_id, "from-b"))
            for subscription in member_subscriptions:
                with anyio.fail_after(10):
                    assert (await subscription.receive()).command.command_id == "from-b"
                with pytest.raises(anyio.WouldBlock):
                    subscription.receive_nowait()

            for router in (*members, *rogues):
                others = {r.node_id for r in members if r is not router}
                assert router.peers == (others if router in members else frozenset())
            for subscription in rogue_subscriptions:
                # A rogue hears itself (and the other rogues), never a member.
                heard = [(await subscription.receive()).command.command_id]
                with contextlib.suppress(anyio.WouldBlock):
                    while True:
                        heard.append(subscription.receive_nowait().command.command_id)
                assert set(heard) == {"forged"}
            # No link ever formed to a raw session: it saw no key, token or payload.
            member_ids = {str(m.zenoh_session.zid()) for m in members if m.zenoh_session}
            for session in raw_sessions:
                assert not {str(zid) for zid in session.info.peers_zid()} & member_ids
            # They do hear the rogues they link with; never a member's id or message.
            assert seen, "the raw sessions heard not even the rogues"
            assert [text for text in seen if "member-" in text or "from-" in text] == []
    finally:
        for session in raw_sessions:
            session.close()
