"""Who may connect to a rank: the handshake every connection to a split instance's ranks
opens with when the cluster has a secret (the rendezvous store, `comm/group_store.py`, and
the rank links, `comm/tcp_mesh.py`, and a remote draft model's link, `comm/draft_link.py`).

The key: `ClusterSecret.rank_group_key()` (HKDF-SHA256 of the cluster secret's root, RFC
5869), handed by the node to its runners. A mutual challenge-response over HMAC-SHA256
(RFC 2104), in the shape of ISO/IEC 9798-4's three-pass mutual authentication:

    client -> server   HELLO  magic, purpose, client rank, client nonce Nc (32 random bytes)
    server -> client   server nonce Ns (32 random bytes), server tag
                       = HMAC(key, "exo group server v1" | transcript)
    client -> server   client tag = HMAC(key, "exo group client v1" | transcript)
    server -> client   one byte: accepted

    transcript = instance id | purpose | client rank | server rank | Nc | Ns | context
    (each field length-prefixed; context: what the caller binds in, e.g. the links' group
    token)

Each side's fresh nonce makes a recorded transcript worthless for a later connection (the
other side's tag covers a nonce it has not seen before); the two labels keep one side's
tag from serving as the other's; the instance id and ranks keep a tag for one group or
pair from serving another. Tags are compared in constant time (`hmac.compare_digest`).
The whole handshake has a deadline (`HANDSHAKE_SECONDS`): a peer that sends nothing, or a
byte at a time, is dropped when it passes, and servers run each handshake on its own
thread, so a stranger stalls nobody.

What it does not do: encrypt. After the handshake the bytes travel in plain text, so a
machine on the path between two ranks can read the activations and could inject into an
open connection (docs/security.md says so).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum

import torch.distributed as dist

GROUP_KEY_BYTES = 32
NONCE_BYTES = 32
TAG_BYTES = 32  # HMAC-SHA256
# The bound on one whole handshake, seconds: members on a LAN finish it in milliseconds.
HANDSHAKE_SECONDS = 5.0
_MAGIC = b"exoA"
_HELLO = struct.Struct(f"!4sBI{NONCE_BYTES}s")  # magic, purpose, client rank, Nc
_CHALLENGE = struct.Struct(f"!{NONCE_BYTES}s{TAG_BYTES}s")  # Ns, server tag
_ACCEPTED = b"\x01"
_SERVER_LABEL = b"exo group server v1"
_CLIENT_LABEL = b"exo group client v1"


class Purpose(IntEnum):
    """What a connection is for; bound into the tags, so one purpose's handshake cannot be
    passed off as another's."""

    STORE = 1  # a rank's connection to rank 0's rendezvous store
    LINK = 2  # one rank link (`tcp_mesh.RankLinks`)
    DRAFT = 3  # a target's rank 0 to its draft model on another node (`comm/draft_link.py`)


class AuthenticationError(dist.DistNetworkError):
    """The other end did not prove it holds the group key (wrong secret, a replayed or
    garbled transcript, a rank it may not be), or did not finish within the deadline."""


class HandshakeInterrupted(AuthenticationError):
    """The handshake ended before either side proved anything: the other end closed the
    connection, reset it, or passed the deadline (a busy or restarting server, a network
    fault), as opposed to a wrong tag or an explicit refusal."""


@dataclass(frozen=True, slots=True)
class GroupCredentials:
    """What a rank proves membership of its instance's group with.

    Attributes:
        key: `GROUP_KEY_BYTES` bytes derived from the cluster secret
            (`ClusterSecret.rank_group_key`); never logged (`repr` hides it).
        instance_id: the instance whose group this is (bound into every tag).
    """

    key: bytes
    instance_id: str

    def __post_init__(self) -> None:
        if len(self.key) != GROUP_KEY_BYTES:
            raise ValueError(f"a group key has {GROUP_KEY_BYTES} bytes, not {len(self.key)}")

    def __repr__(self) -> str:
        return f"GroupCredentials(key=<hidden>, instance_id={self.instance_id!r})"

    def tag(self, label: bytes, *fields: bytes) -> bytes:
        """HMAC-SHA256 of `label` and `fields` (each length-prefixed), with the instance id
        first: `TAG_BYTES` bytes."""
        mac = hmac.new(self.key, label, hashlib.sha256)
        for field in (self.instance_id.encode(), *fields):
            mac.update(struct.pack("!I", len(field)))
            mac.update(field)
        return mac.digest()


def _transcript(
    purpose: Purpose,
    client_rank: int,
    server_rank: int,
    client_nonce: bytes,
    server_nonce: bytes,
    context: bytes,
) -> tuple[bytes, ...]:
    return (
        bytes([purpose]),
        struct.pack("!II", client_rank, server_rank),
        client_nonce,
        server_nonce,
        context,
    )


class _Deadline:
    """Reads and writes on a socket that all end by one monotonic deadline."""

    def __init__(self, connection: socket.socket, seconds: float) -> None:
        self.connection = connection
        self.ends_at = time.monotonic() + seconds

    def _arm(self) -> None:
        remaining = self.ends_at - time.monotonic()
        if remaining <= 0:
            raise HandshakeInterrupted("the handshake did not finish in time")
        self.connection.settimeout(remaining)

    def read(self, size: int) -> bytes:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            self._arm()
            try:
                count = self.connection.recv_into(view[got:], size - got)
            except TimeoutError as error:
                raise HandshakeInterrupted("the handshake did not finish in time") from error
            except OSError as error:
                raise HandshakeInterrupted(f"the handshake broke off: {error}") from error
            if count == 0:
                raise HandshakeInterrupted("the other end closed the connection in the handshake")
            got += count
        return bytes(buffer)

    def write(self, data: bytes) -> None:
        self._arm()
        try:
            self.connection.sendall(data)
        except OSError as error:
            raise HandshakeInterrupted(f"the handshake broke off: {error}") from error


def authenticate_client(
    connection: socket.socket,
    credentials: GroupCredentials,
    purpose: Purpose,
    rank: int,
    server_rank: int,
    context: bytes = b"",
    deadline_s: float | None = None,
) -> None:
    """Prove to the server end of `connection` that this rank (`rank`) holds the group key,
    and check that the server (expected to be `server_rank`) holds it too.

    `deadline_s`: the bound on the whole handshake (None: `HANDSHAKE_SECONDS`). Leaves the
    socket's timeout set to the handshake's last remaining time; callers set their own.

    Raises:
        AuthenticationError: the server's tag is wrong (it lacks the key, or is another
            rank or group), it refused this rank, or the handshake passed `deadline_s`.
    """
    channel = _Deadline(connection, HANDSHAKE_SECONDS if deadline_s is None else deadline_s)
    client_nonce = secrets.token_bytes(NONCE_BYTES)
    channel.write(_HELLO.pack(_MAGIC, purpose, rank, client_nonce))
    server_nonce, server_tag = _CHALLENGE.unpack(channel.read(_CHALLENGE.size))
    transcript = _transcript(purpose, rank, server_rank, client_nonce, server_nonce, context)
    expected = credentials.tag(_SERVER_LABEL, *transcript)
    if not hmac.compare_digest(server_tag, expected):
        raise AuthenticationError(
            f"rank {server_rank} did not prove it holds the group key (another cluster "
            "secret, another instance, or not an exo rank)"
        )
    channel.write(credentials.tag(_CLIENT_LABEL, *transcript))
    if channel.read(len(_ACCEPTED)) != _ACCEPTED:
        raise AuthenticationError(f"rank {server_rank} refused rank {rank}")


def authenticate_server(
    connection: socket.socket,
    credentials: GroupCredentials,
    purpose: Purpose,
    server_rank: int,
    accepts: Callable[[int], bool],
    context: bytes = b"",
    deadline_s: float | None = None,
) -> int:
    """Check that the client end of `connection` holds the group key and is a rank
    `accepts` allows, proving this rank (`server_rank`) holds it too; return the client's
    rank.

    The server's tag goes out before the client's proof comes in: it covers the client's
    nonce and the server's label, so it serves no stranger as a proof of its own.
    `deadline_s`: the bound on the whole handshake (None: `HANDSHAKE_SECONDS`).

    Raises:
        AuthenticationError: a wrong magic or purpose, a rank not accepted, a wrong client
            tag (no key, or a replayed transcript: this connection's server nonce is new),
            or the handshake passed `deadline_s`. The caller closes the connection.
    """
    channel = _Deadline(connection, HANDSHAKE_SECONDS if deadline_s is None else deadline_s)
    magic, their_purpose, client_rank, client_nonce = _HELLO.unpack(channel.read(_HELLO.size))
    if magic != _MAGIC or their_purpose != purpose:
        raise AuthenticationError("not an exo rank's handshake")
    if not accepts(client_rank):
        raise AuthenticationError(f"rank {client_rank} may not connect here")
    server_nonce = secrets.token_bytes(NONCE_BYTES)
    transcript = _transcript(purpose, client_rank, server_rank, client_nonce, server_nonce, context)
    channel.write(_CHALLENGE.pack(server_nonce, credentials.tag(_SERVER_LABEL, *transcript)))
    client_tag = channel.read(TAG_BYTES)
    if not hmac.compare_digest(client_tag, credentials.tag(_CLIENT_LABEL, *transcript)):
        raise AuthenticationError(f"a connection claiming rank {client_rank} lacks the group key")
    channel.write(_ACCEPTED)
    return int(client_rank)
