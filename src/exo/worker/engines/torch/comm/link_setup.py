"""Forming the rank links' mesh (`comm/tcp_mesh.py`'s `RankLinks.connect`): one TCP
connection between every two ranks of an instance, each checked before it is used.

Every rank listens on every interface (ranks may reach each other on different networks),
publishes `host:port` in the group's rendezvous store (host: the local address it uses to
reach the rendezvous host), then connects to every lower rank and accepts every higher one;
the listener closes once the mesh is built. A rank links to rank 0 at the address it reached
rank 0's store at, to another rank at the address the measured topology says it reaches that
rank's node at (`ConnectToGroup.link_addresses`), or else at the address that rank
published.
With a cluster secret each connection opens with the group handshake (`comm/group_auth.py`:
both ends prove the key derived from the secret, bound to the instance, the two ranks and a
token rank 0 puts in the store); without one, with a hello naming the connecting rank and
that token (which keeps out strays and stale ranks, not anyone who can read the store).

Errors: a rank that does not connect in time, or a lower rank that does not prove the
group key, raise `LinkError` (a `torch.distributed.DistNetworkError`, so callers treat it
as gloo's failures); strangers, stale ranks and silent connections to this rank's
listener are closed and counted, never waited on past `HANDSHAKE_SECONDS`.
"""

from __future__ import annotations

import hmac
import queue
import secrets
import socket
import struct
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from exo.worker.engines.torch.comm import group_auth
from exo.worker.engines.torch.comm.group_auth import (
    AuthenticationError,
    GroupCredentials,
    Purpose,
    authenticate_client,
    authenticate_server,
)
from exo.worker.engines.torch.comm.group_store import EVERY_INTERFACE, listen_on

_HELLO = struct.Struct("!II16s")  # magic, rank, group token
_MAGIC = 0x65786F4C  # "exoL"
# Connections in their hello or handshake at once while the mesh forms; more are closed.
MAX_PENDING_HANDSHAKES = 32


class LinkError(dist.DistNetworkError):
    """Another rank closed its link, reset it, or did not answer within the timeout."""


def connect_peers(
    store: Any,
    rank: int,
    world_size: int,
    host: str,
    deadline: float,
    credentials: GroupCredentials | None = None,
    rank_zero_host: str | None = None,
    link_hosts: Mapping[int, str] | None = None,
) -> dict[int, socket.socket]:
    """This rank's checked connection to every other rank, by rank, formed through the
    group's rendezvous `store` before `deadline` (monotonic seconds); the arguments are
    `RankLinks.connect`'s, which documents them. The listener is closed on return.

    Raises:
        LinkError: a rank did not connect by `deadline`, a lower rank did not prove the
            group key, or a socket failed while the mesh formed.
    """
    every = rank_zero_host is not None
    listener = listen_on(EVERY_INTERFACE if every else host, 0, backlog=world_size)
    hosts = dict(link_hosts or {})
    if rank_zero_host is not None:
        hosts[0] = rank_zero_host
    try:
        address, port = listener.getsockname()[:2]
        if every:
            address = host  # published: where the ranks without a measured link go
        if rank == 0:
            store.set("exo_links/token", secrets.token_bytes(16).hex())
        store.set(f"exo_links/{rank}", f"{port} {address}")
        token = bytes.fromhex(store.get("exo_links/token").decode())
        acceptor = _Acceptor(listener, rank, world_size, token, credentials)
        peers: dict[int, socket.socket] = {}
        try:
            for other in range(rank):
                peers[other] = _connect_to(
                    store, rank, other, token, credentials, deadline, hosts.get(other)
                )
            peers.update(acceptor.collect(deadline))
        except BaseException:
            for connection in peers.values():
                connection.close()
            raise
        finally:
            acceptor.stop()
    except OSError as error:
        raise LinkError(f"rank {rank}: setting up the links failed: {error}") from error
    finally:
        listener.close()
    return peers


def _connect_to(
    store: Any,
    rank: int,
    other: int,
    token: bytes,
    credentials: GroupCredentials | None,
    deadline: float,
    address: str | None = None,
) -> socket.socket:
    """Open this rank's link to the lower rank `other` (at `address`, else the address it
    published in the store; its port from the store) and identify: the group handshake
    with `credentials`, else the token hello."""
    other_port, other_address = store.get(f"exo_links/{other}").decode().split(" ")
    if address is not None:
        other_address = address
    connection = socket.create_connection(
        (other_address, int(other_port)), timeout=max(0.1, deadline - time.monotonic())
    )
    try:
        if credentials is None:
            connection.sendall(_HELLO.pack(_MAGIC, rank, token))
        else:
            authenticate_client(
                connection, credentials, Purpose.LINK, rank, other, context=token,
                deadline_s=max(0.1, min(group_auth.HANDSHAKE_SECONDS, deadline - time.monotonic())),
            )  # fmt: skip
    except AuthenticationError as error:
        connection.close()
        raise LinkError(f"rank {rank}: the link to rank {other} failed: {error}") from error
    except BaseException:
        connection.close()
        raise
    return connection


class _Acceptor:
    """Accepts the higher ranks' links on a thread, checking each connection on a thread of
    its own (at most `MAX_PENDING_HANDSHAKES` at once; more are closed unread), and hands
    the checked ones to `collect`."""

    def __init__(
        self,
        listener: socket.socket,
        rank: int,
        world_size: int,
        token: bytes,
        credentials: GroupCredentials | None,
    ) -> None:
        self._listener = listener
        self._rank = rank
        self._world_size = world_size
        self._token = token
        self._credentials = credentials
        self._checked: queue.Queue[tuple[int, socket.socket]] = queue.Queue()
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._stopped = threading.Event()
        self.refused = 0
        self._thread: threading.Thread | None = None
        if rank < world_size - 1:
            self._thread = threading.Thread(
                target=self._accept, name=f"exo-link-accept-{rank}", daemon=True
            )
            self._thread.start()

    def _accept(self) -> None:
        self._listener.settimeout(0.2)  # to notice `stop`
        while not self._stopped.is_set():
            try:
                connection, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                connection.close()
                continue
            threading.Thread(target=self._check, args=(connection,), daemon=True).start()

    def _accepts(self, other: int) -> bool:
        return self._rank < other < self._world_size

    def _check(self, connection: socket.socket) -> None:
        try:
            other = self._identify(connection)
        except (OSError, LinkError, AuthenticationError):
            self.refused += 1
            connection.close()  # a stranger, a stale rank of an earlier group, or silence
            return
        finally:
            self._pending.release()
        if self._stopped.is_set():
            connection.close()
            return
        self._checked.put((other, connection))

    def _identify(self, connection: socket.socket) -> int:
        if self._credentials is not None:
            return authenticate_server(
                connection, self._credentials, Purpose.LINK, self._rank, self._accepts,
                context=self._token,
            )  # fmt: skip
        connection.settimeout(group_auth.HANDSHAKE_SECONDS)
        hello = bytearray(_HELLO.size)
        receive_exactly(connection, memoryview(hello))
        magic, other, their_token = _HELLO.unpack(hello)
        if magic != _MAGIC or not hmac.compare_digest(their_token, self._token):
            raise LinkError("not a rank of this group")
        if not self._accepts(other):
            raise LinkError(f"rank {other} may not connect to rank {self._rank}")
        return int(other)

    def collect(self, deadline: float) -> dict[int, socket.socket]:
        """Every higher rank's checked connection, waiting until `deadline` (monotonic).

        Raises:
            LinkError: not every higher rank connected by then.
        """
        peers: dict[int, socket.socket] = {}
        try:
            while len(peers) < self._world_size - 1 - self._rank:
                try:
                    other, connection = self._checked.get(
                        timeout=max(0.0, deadline - time.monotonic())
                    )
                except queue.Empty:
                    raise LinkError(
                        f"rank {self._rank}: not every rank connected its link"
                    ) from None
                if other in peers:
                    connection.close()  # a second connection claiming one rank
                    continue
                peers[other] = connection
        except BaseException:
            for connection in peers.values():
                connection.close()
            raise
        return peers

    def stop(self) -> None:
        """Stop accepting; connections checked from now on are closed."""
        self._stopped.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        while True:
            try:
                _other, connection = self._checked.get_nowait()
            except queue.Empty:
                return
            connection.close()


def receive_exactly(connection: socket.socket, view: memoryview) -> None:
    """Fill `view` from `connection`; EOF raises `LinkError`, a timeout `TimeoutError`."""
    got = 0
    total = len(view)
    while got < total:
        count = connection.recv_into(view[got:], total - got)
        if count == 0:
            raise LinkError("the other rank closed its link")
        got += count
