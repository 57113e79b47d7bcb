"""The rendezvous store of a split instance whose cluster has a secret: a key-value store
served by rank 0, which every other rank reaches over one connection that opens with the
group handshake (`comm/group_auth.py`). It replaces torch's `TCPStore`, which listens on
every interface and lets anyone who reaches it read and write every key (the rank links'
addresses and token among them).

Rank 0 listens on every interface, since the other ranks may reach it on different
networks (`open_group_store`). Each accepted connection runs on its own
thread: its handshake within `HANDSHAKE_SECONDS`, then requests until it closes; at most
`MAX_PENDING_HANDSHAKES` connections may be in their handshake at once (more are closed
unread), so strangers cost a bounded number of threads and stall no rank.

The store implements what the rank links and torch.distributed's nccl rendezvous (and
gloo's, where `EXO_RANK_LINKS=0` forms a gloo group) call (`set`, `get`, `add`, `wait`,
`check`, `compare_set`, `delete_key`, `num_keys`), with c10d's semantics: `get` and `wait`
block until the keys exist, up to the store's timeout.

Wire format after the handshake (all integers big-endian): a request is an operation
byte, a field count (u32) and the fields, each a u32 length and its bytes; an answer is a
status byte (`_OK`, `_TIMEOUT`) and fields the same way.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from enum import IntEnum

import torch.distributed as dist
from loguru import logger

from exo.worker.engines.torch.comm.group_auth import (
    AuthenticationError,
    GroupCredentials,
    Purpose,
    authenticate_client,
    authenticate_server,
)

# Connections in their handshake at once; past it new connections are closed unread.
MAX_PENDING_HANDSHAKES = 32
# Largest field a request may carry (bytes): rendezvous values are addresses and tokens.
MAX_FIELD_BYTES = 1 << 20
_COUNT = struct.Struct("!I")
_OK = 0
_TIMEOUT = 1
_ERROR = 2


class _Operation(IntEnum):
    SET = 1
    GET = 2
    ADD = 3
    WAIT = 4
    CHECK = 5
    COMPARE_SET = 6
    DELETE_KEY = 7
    NUM_KEYS = 8


class StoreTimeout(dist.DistStoreError):
    """A key did not appear within the store's timeout."""


class _Table:
    """The keys and values, shared by rank 0's own store and the server's connections."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def set(self, key: str, value: bytes) -> None:
        with self._changed:
            self._values[key] = value
            self._changed.notify_all()

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self._changed:
            return self._changed.wait_for(
                lambda: all(key in self._values for key in keys), timeout=timeout_s
            )

    def get(self, key: str, timeout_s: float) -> bytes | None:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._values, timeout=timeout_s):
                return None
            return self._values[key]

    def add(self, key: str, amount: int) -> int:
        with self._changed:
            value = int(self._values.get(key, b"0")) + amount
            self._values[key] = str(value).encode()
            self._changed.notify_all()
            return value

    def check(self, keys: Sequence[str]) -> bool:
        with self._changed:
            return all(key in self._values for key in keys)

    def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:
        """c10d's rule: set `desired` when the value is `expected` (an absent key counts as
        `b""`); answer the value the key holds afterwards."""
        with self._changed:
            current = self._values.get(key)
            if (current is None and expected == b"") or current == expected:
                self._values[key] = desired
                self._changed.notify_all()
                return desired
            return expected if current is None else current

    def delete_key(self, key: str) -> bool:
        with self._changed:
            return self._values.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._changed:
            return len(self._values)


def _bytes(value: str | bytes | bytearray | Sequence[int]) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


# -- framing --------------------------------------------------------------------------------


def _receive_exactly(connection: socket.socket, size: int) -> bytes:
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        count = connection.recv_into(view[got:], size - got)
        if count == 0:
            raise ConnectionError("the store connection closed")
        got += count
    return bytes(buffer)


def _send_frame(connection: socket.socket, head: int, fields: Sequence[bytes]) -> None:
    parts = [bytes([head]), _COUNT.pack(len(fields))]
    for field in fields:
        parts.append(_COUNT.pack(len(field)))
        parts.append(field)
    connection.sendall(b"".join(parts))


def _receive_frame(connection: socket.socket) -> tuple[int, list[bytes]]:
    head = _receive_exactly(connection, 1)[0]
    (count,) = _COUNT.unpack(_receive_exactly(connection, _COUNT.size))
    if count > 64:
        raise ValueError(f"{count} fields in one store message")
    fields: list[bytes] = []
    for _ in range(count):
        (size,) = _COUNT.unpack(_receive_exactly(connection, _COUNT.size))
        if size > MAX_FIELD_BYTES:
            raise ValueError(f"a store field of {size} bytes")
        fields.append(_receive_exactly(connection, size))
    return head, fields


# -- rank 0's server ------------------------------------------------------------------------


EVERY_INTERFACE = ""
"""`listen_on`'s host for every interface of this machine (IPv4 and IPv6 where it can)."""


def listen_on(host: str, port: int, backlog: int) -> socket.socket:
    """A listening TCP socket on `host:port` (port 0: any free one). `EVERY_INTERFACE`
    listens on every address, IPv6 and IPv4 on one dual-stack socket where the system
    allows it, else IPv4's wildcard.

    Raises:
        OSError: the address cannot be bound (in use, or not this machine's)."""
    if host == EVERY_INTERFACE:
        if socket.has_dualstack_ipv6():
            return socket.create_server(
                ("::", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=backlog
            )
        return socket.create_server(("0.0.0.0", port), backlog=backlog)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=backlog)


class GroupStoreServer:
    """Rank 0's listening side: accepts the other ranks' authenticated connections and
    answers their requests from `table`.

    Args:
        host: the address to listen on; `EVERY_INTERFACE` for all of this machine's
            (`listen_on`).
        port: the TCP port (the group's `master_port`).
        credentials: the group key and instance id every client must prove.
        world_size: ranks in the group; clients may claim ranks 1 .. world_size - 1.

    Raises:
        OSError: the address cannot be bound (in use, or not this machine's).
    """

    def __init__(
        self, host: str, port: int, credentials: GroupCredentials, world_size: int
    ) -> None:
        self.table = _Table()
        self._credentials = credentials
        self._world_size = world_size
        self._listener = listen_on(host, port, backlog=64)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._pending = threading.BoundedSemaphore(MAX_PENDING_HANDSHAKES)
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        self.refused = 0  # connections that failed the handshake (for tests and logs)
        self._thread = threading.Thread(target=self._accept, name="exo-group-store", daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop listening and close every connection (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            connections = list(self._connections)
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        for connection in connections:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._thread.join(timeout=5)

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._pending.acquire(blocking=False):
                connection.close()  # too many handshakes at once: strangers, drop
                continue
            with self._lock:
                if self._closed:
                    connection.close()
                    self._pending.release()
                    return
                self._connections.add(connection)
            threading.Thread(
                target=self._serve, args=(connection,), name="exo-group-store-peer", daemon=True
            ).start()

    def _serve(self, connection: socket.socket) -> None:
        try:
            try:
                authenticate_server(
                    connection,
                    self._credentials,
                    Purpose.STORE,
                    0,
                    lambda rank: 0 < rank < self._world_size,
                )
            except AuthenticationError as error:
                self.refused += 1
                logger.debug(f"rendezvous store refused a connection: {error}")
                return
            finally:
                self._pending.release()
            connection.settimeout(None)
            while True:
                try:
                    operation, fields = _receive_frame(connection)
                except (OSError, ValueError):
                    return
                status, answer = self._answer(operation, fields)
                try:
                    _send_frame(connection, status, answer)
                except OSError:
                    return
        finally:
            with self._lock:
                self._connections.discard(connection)
            connection.close()

    def _answer(self, operation: int, fields: list[bytes]) -> tuple[int, list[bytes]]:
        table = self.table
        try:
            match operation:
                case _Operation.SET:
                    table.set(fields[0].decode(), fields[1])
                    return _OK, []
                case _Operation.GET:
                    value = table.get(fields[0].decode(), float(fields[1]))
                    return (_TIMEOUT, []) if value is None else (_OK, [value])
                case _Operation.ADD:
                    return _OK, [str(table.add(fields[0].decode(), int(fields[1]))).encode()]
                case _Operation.WAIT:
                    keys = [field.decode() for field in fields[1:]]
                    return (_OK, []) if table.wait(keys, float(fields[0])) else (_TIMEOUT, [])
                case _Operation.CHECK:
                    found = table.check([field.decode() for field in fields])
                    return _OK, [b"1" if found else b"0"]
                case _Operation.COMPARE_SET:
                    return _OK, [table.compare_set(fields[0].decode(), fields[1], fields[2])]
                case _Operation.DELETE_KEY:
                    return _OK, [b"1" if table.delete_key(fields[0].decode()) else b"0"]
                case _Operation.NUM_KEYS:
                    return _OK, [str(table.num_keys()).encode()]
                case _:
                    return _ERROR, [f"unknown operation {operation}".encode()]
        except (IndexError, ValueError, UnicodeDecodeError) as error:
            return _ERROR, [f"malformed request: {error}".encode()]


# -- the store every rank uses ------------------------------------------------------------


class GroupStore(dist.Store):
    """A `torch.distributed.Store` over rank 0's `GroupStoreServer`: rank 0 reads its table
    directly, the others through one authenticated connection each (`connect`).

    One request at a time per store (a lock): a blocking `get` holds up this rank's other
    threads' requests, as on a `TCPStore` client.
    """

    def __init__(
        self,
        timeout_s: float,
        server: GroupStoreServer | None = None,
        connection: socket.socket | None = None,
    ) -> None:
        super().__init__()
        assert (server is None) != (connection is None)
        self._timeout_s = timeout_s
        self._server = server
        self._connection = connection
        self._lock = threading.Lock()

    @classmethod
    def serve(
        cls,
        host: str,
        port: int,
        credentials: GroupCredentials,
        world_size: int,
        timeout_s: float,
    ) -> GroupStore:
        """Rank 0's store: start the server on `host:port` (see `GroupStoreServer`)."""
        return cls(timeout_s, server=GroupStoreServer(host, port, credentials, world_size))

    @classmethod
    def connect(
        cls,
        host: str,
        port: int,
        credentials: GroupCredentials,
        rank: int,
        timeout_s: float,
    ) -> GroupStore:
        """Another rank's store: connect to rank 0's server at `host:port` (retrying while
        it is not listening yet) and pass the handshake, within `timeout_s`.

        Raises:
            AuthenticationError: whoever listens there did not prove the group key.
            StoreTimeout: nobody accepted the connection within `timeout_s`.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                connection = socket.create_connection(
                    (host, port), timeout=max(0.1, deadline - time.monotonic())
                )
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    raise StoreTimeout(
                        f"rank {rank}: the rendezvous store at {host}:{port} did not accept "
                        f"a connection within {timeout_s} s: {error}"
                    ) from error
                time.sleep(0.05)
        try:
            authenticate_client(connection, credentials, Purpose.STORE, rank, 0)
        except BaseException:
            connection.close()
            raise
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection.settimeout(None)
        return cls(timeout_s, connection=connection)

    @property
    def server(self) -> GroupStoreServer | None:
        """Rank 0's server (None on the other ranks)."""
        return self._server

    def close(self) -> None:
        """Close the connection (other ranks) or stop the server (rank 0)."""
        if self._server is not None:
            self._server.close()
        if self._connection is not None:
            with contextlib.suppress(OSError):
                self._connection.shutdown(socket.SHUT_RDWR)
            self._connection.close()

    def _wait_s(self, timeout: timedelta | None = None) -> float:
        return self._timeout_s if timeout is None else timeout.total_seconds()

    def _request(
        self, operation: _Operation, fields: Sequence[bytes], wait_s: float
    ) -> list[bytes]:
        connection = self._connection
        assert connection is not None
        with self._lock:
            try:
                connection.settimeout(wait_s + 10.0)
                _send_frame(connection, operation, fields)
                status, answer = _receive_frame(connection)
            except (OSError, ValueError) as error:
                raise dist.DistNetworkError(
                    f"the rendezvous store connection failed: {error}"
                ) from error
        if status == _TIMEOUT:
            raise StoreTimeout(f"rendezvous store: keys not set within {wait_s} s")
        if status != _OK:
            raise dist.DistStoreError(answer[0].decode() if answer else "store error")
        return answer

    # -- c10d's Store interface ---------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        if self._server is not None:
            self._server.table.set(key, _bytes(value))
            return
        self._request(_Operation.SET, [key.encode(), _bytes(value)], self._timeout_s)

    def get(self, key: str) -> bytes:
        if self._server is not None:
            value = self._server.table.get(key, self._timeout_s)
            if value is None:
                raise StoreTimeout(f"rendezvous store: {key!r} not set within {self._timeout_s} s")
            return value
        wait_s = self._timeout_s
        return self._request(_Operation.GET, [key.encode(), str(wait_s).encode()], wait_s)[0]

    def add(self, key: str, amount: int) -> int:
        if self._server is not None:
            return self._server.table.add(key, amount)
        answer = self._request(
            _Operation.ADD, [key.encode(), str(amount).encode()], self._timeout_s
        )
        return int(answer[0])

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        wait_s = self._wait_s(timeout)
        if self._server is not None:
            if not self._server.table.wait(keys, wait_s):
                raise StoreTimeout(f"rendezvous store: {keys} not set within {wait_s} s")
            return
        self._request(
            _Operation.WAIT, [str(wait_s).encode(), *(key.encode() for key in keys)], wait_s
        )

    def check(self, keys: list[str]) -> bool:
        if self._server is not None:
            return self._server.table.check(keys)
        answer = self._request(_Operation.CHECK, [key.encode() for key in keys], self._timeout_s)
        return answer[0] == b"1"

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        if self._server is not None:
            return self._server.table.compare_set(key, _bytes(expected), _bytes(desired))
        fields = [key.encode(), _bytes(expected), _bytes(desired)]
        return self._request(_Operation.COMPARE_SET, fields, self._timeout_s)[0]

    def delete_key(self, key: str) -> bool:
        if self._server is not None:
            return self._server.table.delete_key(key)
        return self._request(_Operation.DELETE_KEY, [key.encode()], self._timeout_s)[0] == b"1"

    def num_keys(self) -> int:
        if self._server is not None:
            return self._server.table.num_keys()
        return int(self._request(_Operation.NUM_KEYS, [], self._timeout_s)[0])


def open_group_store(
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    credentials: GroupCredentials,
    timeout_s: float,
) -> GroupStore:
    """This rank's store: rank 0 serves it on port `master_port` of every interface, the
    others connect to `master_addr:master_port` (see `GroupStore.serve` / `connect`).

    Every interface, not `master_addr` alone: each rank reaches rank 0 at the address its
    own node measured (`Rendezvous.addresses`), and two nodes may reach rank 0's on
    different networks (two NICs; on one machine, loopback and the LAN address): a store
    on one of them refused the others (a 3-node group with a secret never formed). The
    handshake guards every connection whatever interface it came in on.
    """
    if rank == 0:
        return GroupStore.serve(EVERY_INTERFACE, master_port, credentials, world_size, timeout_s)
    return GroupStore.connect(master_addr, master_port, credentials, rank, timeout_s)
