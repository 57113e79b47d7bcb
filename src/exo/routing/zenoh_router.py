"""The networked router: the node's topics carried between exo processes over eclipse-zenoh.

One zenoh session per node, in peer mode. Peers find each other by multicast scouting
(UDP group 224.0.0.224:7446 unless configured) or through bootstrap endpoints, then talk
over TCP. Every topic is a key under `exo/{namespace}/`, so clusters with different
namespaces share nothing even when their sessions connect. Payloads are the JSON of the
pydantic wire types.

Components keep using `exo.utils.channels`: a `NetworkTopic` *is* a `Topic`, so
`subscribe()` and `sender()` hand out the usual `Subscription` and `Publisher`; only
`publish` goes through zenoh, which also delivers a session's publications to that
session's own subscriber (exactly once), so a node hears its own messages.

zenoh calls back on its own threads; items are validated there and handed to the node's
asyncio loop with `call_soon_threadsafe`, which keeps each publisher's order. Outgoing puts
run on one thread per router (`Outbox`), in call order, so a slow peer never stalls the loop.

With a cluster secret (`tls`, see `exo.routing.cluster_tls`) every link is TLS with mutual
authentication against the cluster's CA, and zenoh may use no other protocol: a session
without the secret cannot open a link to a member, nor a member to it. The zenoh id is
zenoh's random one, never derived from the exo node id: multicast scouting announces it.
zenoh refuses a peer with another secret without telling Python; `SecretMismatchWatch`
(`exo.routing.secret_mismatch`) finds such peers among the bootstrap peers and scouting's
answers and warns once per peer.

Peers are tracked with zenoh liveliness: each router declares the token
`exo/{namespace}/nodes/{node_id}/{zenoh session id}`; its appearance and disappearance
(graceful close at once, a silent peer after `lease_seconds`) become `PeerConnected` and
`PeerDisconnected` on `connections`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import re
from collections.abc import Callable, Sequence
from typing import Any, Self, TypeVar, cast

import anyio
import zenoh
from loguru import logger
from pydantic import TypeAdapter, ValidationError

from exo.routing.cluster_tls import TlsFiles
from exo.routing.connections import ConnectionMessage, PeerConnected, PeerDisconnected
from exo.routing.secret_mismatch import (
    DEFAULT_INTERVAL_SECONDS,
    PROBE_TIMEOUT_SECONDS,
    SecretMismatchWatch,
)
from exo.routing.zenoh_support import Outbox, close_session, free_tcp_port, is_loopback
from exo.shared.types.chunks import Chunk
from exo.shared.types.commands import ForwarderCommand
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.events import ForwarderEvent, IndexedEvent
from exo.utils.channels import Subscription, Topic

T = TypeVar("T")

DEFAULT_ZENOH_PORT = 52414
# How long a silent peer (killed process, pulled cable) stays "connected". zenoh's own
# default is 10 s; 3 s with 4 keep-alives per lease still tolerates ~2 s stalls.
DEFAULT_LEASE_SECONDS = 3.0
KEEP_ALIVES_PER_LEASE = 4
ELECTION_TOPIC = "election"
# Key chunks we build from names and ids: no '/', no zenoh wildcard or reserved characters.
_KEY_CHUNK = re.compile(r"[A-Za-z0-9._~+=,:@-]+")
_RESERVED_TOPICS = frozenset({"chunks", "nodes"})

_chunk_adapter: TypeAdapter[Chunk] = TypeAdapter(Chunk)


def check_key_chunk(what: str, value: str) -> str:
    """`value` (a namespace, node id, command id or topic name: `what`), checked to be one
    chunk of a zenoh key: no '/', no wildcard or reserved character.

    Raises:
        ValueError: it is empty or holds another character; the message says which are
            allowed.
    """
    if not _KEY_CHUNK.fullmatch(value):
        raise ValueError(
            f"{what} {value!r} cannot be part of a zenoh key: use letters, digits and ._~+=,:@-"
        )
    return value


# A node given bootstrap peers that none of them has reached after this long says so, once.
ALONE_WARNING_SECONDS = 30.0

# How many ports a router asked for port 0 tries when the one it picked is bound by another
# process before zenoh binds it.
PORT_PICKS = 5


def _address_in_use(error: BaseException) -> bool:
    """Whether zenoh could not open because its listen port was taken (EADDRINUSE: its
    message names the OS error)."""
    text = str(error)
    return "Address already in use" in text or "os error 98" in text


# zenoh's errors end each cause with the Rust source line that raised it
# (" at /root/.cargo/git/checkouts/zenoh-.../tcp.rs:61."): noise to a user.
_RUST_SOURCE = re.compile(r" at \S+\.rs:\d+\.?")


def open_failure_message(error: BaseException, router: NetworkRouter) -> str:
    """One line for the user when `router.start()` failed with `error`: a taken port names
    the port and the flag that moves it (as the API's own port-in-use message does); any
    other zenoh error is given without its Rust source paths."""
    if _address_in_use(error):
        return (
            f"cannot listen on {router.listen_host}:{router.listen_port} (the links between "
            "nodes, --zenoh-port): address already in use (another exo or program holds the "
            "port: start this node with a --zenoh-port of its own)"
        )
    return (
        f"cannot open cluster links on {router.listen_endpoint}: "
        f"{_RUST_SOURCE.sub('', str(error)).strip()}"
    )


class NetworkTopic(Topic[T]):
    """A broadcast topic of the cluster: `publish` reaches every node's subscribers, this
    node's included, each exactly once and in publication order."""

    def __init__(self, name: str, key: str, adapter: TypeAdapter[T], router: NetworkRouter) -> None:
        super().__init__(name)
        self.key = key
        self.adapter = adapter
        self._router = router
        self._zenoh_publisher: zenoh.Publisher | None = None

    def publish(self, item: T) -> None:
        """Send `item` to the cluster; never blocks (a thread of the router sends it).

        Raises:
            RuntimeError: the router was never started (after `close()` items are dropped).
        """
        publisher = self._zenoh_publisher
        if publisher is None:
            self._router._not_open(self.name)
            return
        self._router._send(functools.partial(publisher.put, self.adapter.dump_json(item)))

    def _declare(self, session: zenoh.Session) -> None:
        self._zenoh_publisher = session.declare_publisher(
            self.key,
            encoding=zenoh.Encoding.APPLICATION_JSON,
            congestion_control=zenoh.CongestionControl.BLOCK,
            reliability=zenoh.Reliability.RELIABLE,
        )
        self._router._keep(session.declare_subscriber(self.key, self._on_sample))

    def _on_sample(self, sample: zenoh.Sample) -> None:
        # On a zenoh thread: validate here, fan out on the loop.
        try:
            item = self.adapter.validate_json(sample.payload.to_bytes())
        except ValidationError as error:
            logger.warning(f"dropped an invalid message on {sample.key_expr}: {error}")
            return
        self._router._call_soon(self._deliver, item)

    def _deliver(self, item: T) -> None:
        Topic.publish(self, item)


class ChunkPublisher:
    """`publish(chunk)` for components that only hold a chunk: looks up the node that owns
    the chunk's command and sends it there."""

    def __init__(self, chunks: ChunkTopic, owner_of: Callable[[CommandId], NodeId | None]) -> None:
        self._chunks = chunks
        self._owner_of = owner_of

    def publish(self, item: Chunk) -> None:
        owner = self._owner_of(item.command_id)
        if owner is None:
            logger.warning(f"dropped a chunk of command {item.command_id}: owner unknown")
            return
        self._chunks.publish_to(owner, item)


class ChunkTopic:
    """Token chunks, point to point: a chunk of a command owned by node N goes to key
    `exo/{namespace}/chunks/{N}/{command_id}`; each node subscribes only to its own."""

    def __init__(self, router: NetworkRouter) -> None:
        self.name = "chunks"
        self._router = router
        self._local: Topic[Chunk] = Topic(self.name)

    def subscribe(self) -> Subscription[Chunk]:
        """Chunks addressed to this node, per sender in the order they were published."""
        return self._local.subscribe()

    def key_for(self, owner: NodeId, command_id: CommandId) -> str:
        check_key_chunk("node id", owner)
        check_key_chunk("command id", command_id)
        return f"{self._router.key_prefix}/chunks/{owner}/{command_id}"

    def publish_to(self, owner: NodeId, chunk: Chunk) -> None:
        """Send `chunk` to `owner`, the node whose API submitted the command (this node's
        own chunks are delivered at once, on the caller's thread: call it on the loop).

        Raises:
            ValueError: `owner` or the command id cannot be part of a zenoh key.
            RuntimeError: the router was never started.
        """
        key = self.key_for(owner, chunk.command_id)
        session = self._router._session
        if session is None:
            self._router._not_open(self.name)
            return
        if owner == self._router.node_id:
            # This node's own API: straight to its subscribers, in order, without the JSON
            # round trip and the two thread hand-overs (outbox, zenoh) of a network put.
            if not self._router._closed:
                self._local.publish(chunk)
            return
        self._router._send(
            functools.partial(
                session.put,
                key,
                _chunk_adapter.dump_json(chunk),
                encoding=zenoh.Encoding.APPLICATION_JSON,
                congestion_control=zenoh.CongestionControl.BLOCK,
            )
        )

    def sender(self, owner_of: Callable[[CommandId], NodeId | None]) -> ChunkPublisher:
        return ChunkPublisher(self, owner_of)

    def _declare(self, session: zenoh.Session) -> None:
        own_key = f"{self._router.key_prefix}/chunks/{self._router.node_id}/**"
        self._router._keep(session.declare_subscriber(own_key, self._on_sample))

    def _on_sample(self, sample: zenoh.Sample) -> None:
        try:
            chunk = _chunk_adapter.validate_json(sample.payload.to_bytes())
        except ValidationError as error:
            logger.warning(f"dropped an invalid chunk on {sample.key_expr}: {error}")
            return
        self._router._call_soon(self._local.publish, chunk)


class NetworkRouter:
    """The node's router over zenoh: the topics every component talks through, shared
    by every node of the namespace, plus `connections` (peer joins and leaves).

    Create every topic (`topic()`, `election()`) before `start()`: a peer that reports
    `PeerConnected(this node)` has then already seen all of this node's subscriptions, so
    whatever it publishes afterwards reaches this node.

    Args:
        node_id: this node's id; part of zenoh keys, so letters, digits and ._~+=,:@- only.
        namespace: clusters with different namespaces never see each other's messages.
        zenoh_port: TCP port zenoh listens on; 0 picks a free one (see `listen_port`).
        listen_host: address zenoh listens on ("0.0.0.0": every interface).
        bootstrap_peers: zenoh endpoints to connect to, e.g. "tcp/192.168.1.7:52414";
            for networks without multicast. Retried in the background until reachable.
        multicast: find peers by UDP multicast scouting.
        multicast_interface: interface (name or address) to scout on; default: the
            listen host when it is a loopback address, else zenoh's "auto".
        multicast_address: scouting group "address:port"; default zenoh's 224.0.0.224:7446.
        lease_seconds: a peer silent this long is reported disconnected.
        tls: the cluster secret's TLS files: links are then `tls/` only, mutually
            authenticated, and bootstrap peers must be `tls/` endpoints.
        secret_check_seconds: with `tls`, how often peers this node does not link with
            are checked for another secret (`SecretMismatchWatch`).

    Raises:
        ValueError: a bad port, lease, node id or namespace, or (with `tls`) a bootstrap
            peer that is not a `tls/` endpoint.
    """

    def __init__(
        self,
        node_id: str,
        namespace: str,
        *,
        zenoh_port: int = DEFAULT_ZENOH_PORT,
        listen_host: str = "0.0.0.0",
        bootstrap_peers: Sequence[str] = (),
        multicast: bool = True,
        multicast_interface: str | None = None,
        multicast_address: str | None = None,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        tls: TlsFiles | None = None,
        secret_check_seconds: float = DEFAULT_INTERVAL_SECONDS,
    ) -> None:
        if not 0 <= zenoh_port < 65536:
            raise ValueError(f"zenoh port must be between 0 and 65535, not {zenoh_port}")
        if lease_seconds <= 0:
            raise ValueError(f"lease must be positive, not {lease_seconds} s")
        self.node_id = NodeId(check_key_chunk("node id", node_id))
        self.namespace = check_key_chunk("namespace", namespace)
        self.key_prefix = f"exo/{namespace}"
        self.listen_host = listen_host
        self._port_picked = zenoh_port == 0  # re-picked if taken before zenoh binds it
        self.listen_port = zenoh_port or free_tcp_port(listen_host)
        self.bootstrap_peers = tuple(bootstrap_peers)
        self._ever_connected = False  # a peer's token was seen at least once
        self.tls = tls
        if tls is not None:
            for peer in self.bootstrap_peers:
                if not peer.startswith("tls/"):
                    raise ValueError(
                        f"bootstrap peer {peer!r}: with a cluster secret links are TLS, "
                        "so peers are tls/HOST:PORT"
                    )
        self.multicast = multicast
        if multicast_interface is None and is_loopback(listen_host):
            multicast_interface = listen_host
        self.multicast_interface = multicast_interface
        self.multicast_address = multicast_address
        self.lease_seconds = lease_seconds
        self._secret_check_seconds = secret_check_seconds
        self._secret_watch: SecretMismatchWatch | None = None

        self._peer_sessions: dict[NodeId, set[str]] = {}
        self._own_session_id = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: zenoh.Session | None = None
        self._declared: list[Any] = []
        self._token: zenoh.LivelinessToken | None = None
        self._outbox: Outbox | None = None
        self._closed = False
        self._topics: dict[str, NetworkTopic[Any]] = {}
        self.commands = self.topic("commands", TypeAdapter(ForwarderCommand))
        self.local_events = self.topic("local_events", TypeAdapter(ForwarderEvent))
        self.global_events = self.topic("global_events", TypeAdapter(IndexedEvent))
        self.chunks = ChunkTopic(self)
        self.connections: Topic[ConnectionMessage] = Topic("connections")

    # --- configuration -------------------------------------------------------------

    @property
    def listen_endpoint(self) -> str:
        host = f"[{self.listen_host}]" if ":" in self.listen_host else self.listen_host
        protocol = "tcp" if self.tls is None else "tls"
        return f"{protocol}/{host}:{self.listen_port}"

    def zenoh_config_json(self) -> dict[str, Any]:
        """The zenoh configuration this router opens its session with (JSON5 object)."""
        multicast: dict[str, Any] = {"enabled": self.multicast}
        if self.multicast_interface is not None:
            multicast["interface"] = self.multicast_interface
        if self.multicast_address is not None:
            multicast["address"] = self.multicast_address
        link: dict[str, Any] = {
            "tx": {
                "lease": round(self.lease_seconds * 1000),  # ms
                "keep_alive": KEEP_ALIVES_PER_LEASE,
            }
        }
        if self.tls is not None:
            # Only TLS, accepted or opened: scouting also finds open nodes' tcp/ endpoints.
            link["protocols"] = ["tls"]
            link["tls"] = self.tls.zenoh_tls_config()
        return {
            "mode": "peer",
            "listen": {"endpoints": [self.listen_endpoint]},
            "connect": {"endpoints": list(self.bootstrap_peers)},
            "scouting": {"multicast": multicast},
            "transport": {"link": link},
        }

    def zenoh_config(self) -> zenoh.Config:
        return zenoh.Config.from_json5(json.dumps(self.zenoh_config_json()))

    # --- topics --------------------------------------------------------------------

    def topic(self, name: str, adapter: TypeAdapter[T]) -> NetworkTopic[T]:
        """The broadcast topic `exo/{namespace}/{name}` carrying `adapter`'s type; the same
        object for the same name and adapter.

        Raises:
            ValueError: reserved or invalid name, or the name is taken by another adapter.
        """
        check_key_chunk("topic name", name)
        if name in _RESERVED_TOPICS:
            raise ValueError(f"topic name {name!r} is reserved")
        existing = self._topics.get(name)
        if existing is not None:
            if existing.adapter is not adapter:
                raise ValueError(f"topic {name!r} already exists with another type adapter")
            return cast(NetworkTopic[T], existing)
        created = NetworkTopic(name, f"{self.key_prefix}/{name}", adapter, self)
        self._topics[name] = created
        if self._session is not None:
            created._declare(self._session)
        return created

    def election(self, adapter: TypeAdapter[T]) -> NetworkTopic[T]:
        """The election topic; its message type is the election's to define."""
        return self.topic(ELECTION_TOPIC, adapter)

    @property
    def peers(self) -> frozenset[NodeId]:
        """Nodes of this namespace connected now (this node excluded)."""
        return frozenset(self._peer_sessions)

    @property
    def started(self) -> bool:
        return self._session is not None

    @property
    def zenoh_session(self) -> zenoh.Session | None:
        """The open zenoh session (for link information), None before start/after close."""
        return self._session

    # --- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        """Open the zenoh session, subscribe to every topic, then announce this node.

        Must run on the asyncio loop that consumes the subscriptions.

        Raises:
            RuntimeError: started twice, or after `close()`.
            zenoh.ZError: zenoh could not open (port taken, malformed endpoint).
        """
        if self._session is not None or self._closed:
            raise RuntimeError("a NetworkRouter starts once")
        self._loop = asyncio.get_running_loop()
        session = await self._open_session()
        self._session = session
        self._own_session_id = str(session.zid())
        self._outbox = Outbox(f"exo-router-{self.node_id}")
        try:
            await anyio.to_thread.run_sync(self._declare_all, session)
        except BaseException:
            await self.close()
            raise
        logger.info(
            f"router {self.node_id} in namespace {self.namespace!r} listening on "
            f"{self.listen_endpoint} (zenoh id {session.zid()})"
        )
        if self.bootstrap_peers:
            self._loop.call_later(ALONE_WARNING_SECONDS, self._warn_if_alone)
        if self.tls is not None:
            self._secret_watch = SecretMismatchWatch(
                self.node_id,
                self.tls,
                self.bootstrap_peers,
                self.zenoh_config_json()["scouting"] if self.multicast else None,
                lambda: [str(zenoh_id) for zenoh_id in session.info.peers_zid()],
                self._own_session_id,
                self._secret_check_seconds,
            )
            self._secret_watch.start()

    async def _open_session(self) -> zenoh.Session:
        """zenoh's session on `listen_port`; a port this router picked (port 0) that
        another process bound first is picked again, at most `PORT_PICKS` times."""
        for attempt in range(1, PORT_PICKS + 1):
            try:
                return await anyio.to_thread.run_sync(zenoh.open, self.zenoh_config())
            except zenoh.ZError as error:
                if not self._port_picked or attempt == PORT_PICKS or not _address_in_use(error):
                    raise
                taken = self.listen_port
                self.listen_port = free_tcp_port(self.listen_host)
                logger.info(f"port {taken} was taken before zenoh bound it; now {self.listen_port}")
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _warn_if_alone(self) -> None:
        """Say once why a node given peers to reach may be alone: zenoh retries its
        bootstrap peers silently, and a TLS handshake with another secret fails
        silently, so a node with a wrong address or secret looked like a 1-node cluster
        with nothing in its log."""
        if self._closed or self._ever_connected:
            return
        secret = (
            " and that every node runs with the same cluster secret (a peer found with "
            "another one is named in a warning of its own)"
            if self.tls is not None
            else " and that they run without a cluster secret too"
        )
        logger.warning(
            f"no peer has connected in {ALONE_WARNING_SECONDS:.0f} s although "
            f"--bootstrap-peers names {', '.join(self.bootstrap_peers)}: this node runs "
            f"alone until one does; check that they run, that the addresses and ports are "
            f"theirs{secret}"
        )

    def _declare_all(self, session: zenoh.Session) -> None:
        for topic in self._topics.values():
            topic._declare(session)
        self.chunks._declare(session)
        liveliness = session.liveliness()
        self._keep(
            liveliness.declare_subscriber(
                f"{self.key_prefix}/nodes/*/*", self._on_liveliness, history=True
            )
        )
        # Declared last: peers that see this token have seen our subscriptions already
        # (zenoh sends declarations in order on a link).
        self._token = liveliness.declare_token(
            f"{self.key_prefix}/nodes/{self.node_id}/{self._own_session_id}"
        )

    async def close(self) -> None:
        """Leave the cluster (peers see `PeerDisconnected` at once) and close the session.
        Idempotent; publishing afterwards drops the item."""
        self._closed = True
        session, self._session = self._session, None
        for topic in self._topics.values():
            topic._zenoh_publisher = None
        token, self._token = self._token, None
        outbox, self._outbox = self._outbox, None
        secret_watch, self._secret_watch = self._secret_watch, None
        self._declared.clear()
        self._peer_sessions.clear()
        if session is None:
            return
        with anyio.CancelScope(shield=True):
            if secret_watch is not None:
                await anyio.to_thread.run_sync(secret_watch.stop, PROBE_TIMEOUT_SECONDS + 1)
            if outbox is not None:
                # A put blocked on a silent peer ends when its lease expires.
                await anyio.to_thread.run_sync(outbox.stop, self.lease_seconds + 2)
            await anyio.to_thread.run_sync(close_session, session, token)
        self._loop = None
        logger.info(f"router {self.node_id} closed")

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *_exc_info: object) -> None:
        await self.close()

    # --- internals -----------------------------------------------------------------

    def _keep(self, declared: object) -> None:
        # Callback subscribers live as long as we hold them (and the session is open).
        self._declared.append(declared)

    def _call_soon(self, callback: Callable[[Any], None], item: object) -> None:
        """Run `callback(item)` on the node's loop; FIFO, so each publisher keeps its order."""
        loop = self._loop
        if loop is None or self._closed:
            return
        # RuntimeError: the loop closed under us, the node is gone.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(callback, item)

    def _on_liveliness(self, sample: zenoh.Sample) -> None:
        *_, node_id, session_id = str(sample.key_expr).split("/")
        present = sample.kind == zenoh.SampleKind.PUT
        self._call_soon(self._token_changed, (NodeId(node_id), session_id, present))

    def _token_changed(self, change: tuple[NodeId, str, bool]) -> None:
        # Counted per zenoh session: a node restarted under the same id may announce itself
        # before its old session's lease runs out, and that must not read as "gone".
        node_id, session_id, present = change
        if node_id == self.node_id:
            if present and session_id != self._own_session_id:
                logger.warning(f"another exo process uses this node id ({node_id})")
            return
        sessions = self._peer_sessions.setdefault(node_id, set())
        was_connected = bool(sessions)
        if present:
            sessions.add(session_id)
            self._ever_connected = True
        else:
            sessions.discard(session_id)
        if not sessions:
            del self._peer_sessions[node_id]
        if was_connected == bool(sessions):
            return
        message: ConnectionMessage
        if sessions:
            message = PeerConnected(node_id=node_id)
            logger.info(f"peer {node_id} connected")
        else:
            message = PeerDisconnected(node_id=node_id)
            logger.info(f"peer {node_id} disconnected")
        self.connections.publish(message)

    def _not_open(self, topic_name: str) -> None:
        if not self._closed:
            raise RuntimeError(f"publish on {topic_name!r} before NetworkRouter.start()")
        logger.debug(f"router closed: dropped a message on {topic_name!r}")

    def _send(self, put: Callable[[], object]) -> None:
        outbox = self._outbox
        if outbox is None:  # closed between the caller's check and now
            return
        outbox.send(put)
