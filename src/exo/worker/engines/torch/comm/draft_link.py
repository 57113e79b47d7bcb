"""The wire format of the link between a target's rank 0 and a draft model on another node
(`remote_drafts.RemoteDraftSource`, the client; `remote_drafts.DraftServer`, the server).

Opening (once per connection, bounded by `group_auth.HANDSHAKE_SECONDS` in all):

    with a cluster secret: the group handshake (`group_auth`, `Purpose.DRAFT`, client
                           rank 0 to server rank 0), the target's instance id in its tags
    client -> server  HELLO   magic "exoD", version, the target's logits length (u32), the
                              sha256 fingerprint of its vocabulary (32 bytes), the target's
                              instance id (u16 length + UTF-8)
    server -> client  ANSWER  accepted (u8), reason (u16 length + UTF-8; empty if accepted)

A server refuses a hello of another instance (a stray rank 0: the hello keeps it out where
there is no secret, as `tcp_mesh`'s hello does) or another vocabulary (its drafts would be
other text), saying why.

Then one round trip per target step that drafts, each message a frame (u32 body length,
then the body; all integers big-endian):

    PROPOSE  u16 forgotten count F, u16 request count R,
             F x u32 handle (requests that left the batch since the last message),
             R x (u32 handle, u32 kept, u32 new count N, u16 max draft tokens, N x u32 token)
    DRAFTS   u16 count R, R x (u16 draft length D, D x u32 token), in the PROPOSE's order

A handle is the client's small number for a request (its string id never travels). Each
end keeps, per handle, the same token list: what the client sent plus the draft it got
back. `kept` is the length of the prefix of that list the request's text still begins with
(a rejected draft token or the target's own token cuts it there), so only the tokens after
it travel: at a steady decode step, the one token the target chose (its correction or bonus
token) per request. The first message of a request (or the first after a reconnection)
carries its whole text.

So a decode step of R requests drafting k tokens each moves 8 + 14 R + 4 n + 4 F bytes up
(n: new tokens, R at a steady step; F: requests forgotten) and 6 + 2 R + 4 k R bytes
down: 26 bytes up and 24 down for one request with k = 4, whatever the vocabulary's size. Only
token ids travel, never draft distributions (a `[k, vocab]` float32 block, ~600 KB per 4
tokens at 151k tokens): the drafts of a remote draft model are its greedy tokens, a point
mass q, for which the target's acceptance rule needs no q (`RequestState.accept_drafts`).
"""

from __future__ import annotations

import hashlib
import socket
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from exo.worker.engines.torch.comm.group_auth import (
    HANDSHAKE_SECONDS,
    AuthenticationError,
    GroupCredentials,
    HandshakeInterrupted,
    Purpose,
    authenticate_client,
    authenticate_server,
)

MAGIC = b"exoD"
VERSION = 1
FINGERPRINT_BYTES = 32  # sha256
# A round trip past this many seconds: the link is lost (the target decodes without drafts).
ROUND_TRIP_SECONDS = 2.0
# The largest frame either end accepts (a prompt of ~16M tokens): a bigger length prefix is
# garbage, not a message.
MAX_FRAME_BYTES = 64 * 1024 * 1024
MAX_INSTANCE_ID_BYTES = 1024
MAX_REASON_BYTES = 4096
_HELLO = struct.Struct(f"!4sBI{FINGERPRINT_BYTES}sH")  # magic, version, vocab, print, id len
_ANSWER = struct.Struct("!BH")  # accepted, reason length
_FRAME = struct.Struct("!I")  # body length
_COUNTS = struct.Struct("!HH")  # forgotten, requests
_ASK = struct.Struct("!IIIH")  # handle, kept, new count, max tokens
_COUNT = struct.Struct("!H")
_HANDLE = struct.Struct("!I")
MAX_U16 = 0xFFFF
# The bound on joining a link's threads at close, seconds.
JOIN_SECONDS = 3.0


@dataclass(slots=True)
class LinkCounters:
    """What a link carried (cumulative; frames' bytes with their length prefixes), and
    `seconds`: a client's in round trips (send to answer), a server's in drafting (its
    draft model's forward passes): their difference per round trip is the link's cost."""

    round_trips: int = 0
    tokens_sent: int = 0
    tokens_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    connections: int = 0
    losses: int = 0
    seconds: float = 0.0


def vocabulary_fingerprint(tokenizer: Any) -> str:
    """The sha256 (hex) of a tokenizer's sorted (token, id) pairs, each token's UTF-8 bytes
    length-prefixed: equal for two tokenizers iff they map the same tokens to the same ids
    (`draft_model.check_same_vocabulary`'s test, without sending the vocabulary)."""
    digest = hashlib.sha256()
    for token, token_id in sorted(tokenizer.get_vocab().items()):
        encoded = token.encode("utf-8", errors="surrogatepass")
        digest.update(struct.pack("!I", len(encoded)))
        digest.update(encoded)
        digest.update(struct.pack("!I", token_id))
    return digest.hexdigest()


class DraftLinkError(ConnectionError):
    """The link broke, timed out, or carried something that is not this protocol."""


class DraftRefusedError(DraftLinkError):
    """The server refused the hello (another instance, another vocabulary) or the
    handshake (another secret); `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class DraftAsk:
    """One request's part of a PROPOSE message.

    Attributes:
        handle: the client's number for the request.
        kept: how many tokens of the list both ends hold for the handle stay.
        new_tokens: the request's tokens after those.
        max_tokens: the most draft tokens the step has room for.
    """

    handle: int
    kept: int
    new_tokens: tuple[int, ...]
    max_tokens: int


def _tokens(values: Sequence[int]) -> bytes:
    return struct.pack(f"!{len(values)}I", *values)


def encode_propose(forgotten: Sequence[int], asks: Sequence[DraftAsk]) -> bytes:
    """A whole PROPOSE frame (length prefix included).

    Raises:
        ValueError: more than 65,535 requests or forgotten handles in one message.
    """
    if len(forgotten) > MAX_U16 or len(asks) > MAX_U16:
        raise ValueError("at most 65,535 requests per message")
    parts = [_COUNTS.pack(len(forgotten), len(asks)), _tokens(forgotten)]
    for ask in asks:
        max_tokens = min(ask.max_tokens, MAX_U16)
        parts.append(_ASK.pack(ask.handle, ask.kept, len(ask.new_tokens), max_tokens))
        parts.append(_tokens(ask.new_tokens))
    body = b"".join(parts)
    return _FRAME.pack(len(body)) + body


class _Reader:
    """Reads fields off a message body; running past its end is a protocol error."""

    def __init__(self, body: bytes) -> None:
        self.body = body
        self.offset = 0

    def take(self, layout: struct.Struct) -> tuple[int, ...]:
        end = self.offset + layout.size
        if end > len(self.body):
            raise DraftLinkError("a message shorter than its fields")
        values = layout.unpack_from(self.body, self.offset)
        self.offset = end
        return values

    def tokens(self, count: int) -> tuple[int, ...]:
        end = self.offset + 4 * count
        if end > len(self.body):
            raise DraftLinkError("a message shorter than its tokens")
        values = struct.unpack_from(f"!{count}I", self.body, self.offset)
        self.offset = end
        return values

    def done(self) -> None:
        if self.offset != len(self.body):
            raise DraftLinkError("a message longer than its fields")


def decode_propose(body: bytes) -> tuple[tuple[int, ...], list[DraftAsk]]:
    """A PROPOSE body's forgotten handles and asks.

    Raises:
        DraftLinkError: the body does not parse exactly.
    """
    reader = _Reader(body)
    forgotten_count, ask_count = reader.take(_COUNTS)
    forgotten = reader.tokens(forgotten_count)
    asks = []
    for _ in range(ask_count):
        handle, kept, new_count, max_tokens = reader.take(_ASK)
        asks.append(DraftAsk(handle, kept, reader.tokens(new_count), max_tokens))
    reader.done()
    return forgotten, asks


def encode_drafts(drafts: Sequence[Sequence[int]]) -> bytes:
    """A whole DRAFTS frame (length prefix included)."""
    parts = [_COUNT.pack(len(drafts))]
    for draft in drafts:
        parts.append(_COUNT.pack(len(draft)))
        parts.append(_tokens(draft))
    body = b"".join(parts)
    return _FRAME.pack(len(body)) + body


def decode_drafts(body: bytes, expected: int) -> list[tuple[int, ...]]:
    """A DRAFTS body's drafts.

    Raises:
        DraftLinkError: the body does not parse exactly, or holds other than `expected`.
    """
    reader = _Reader(body)
    (count,) = reader.take(_COUNT)
    if count != expected:
        raise DraftLinkError(f"{count} drafts for {expected} requests")
    drafts = []
    for _ in range(count):
        (length,) = reader.take(_COUNT)
        drafts.append(reader.tokens(length))
    reader.done()
    return drafts


def _receive(connection: socket.socket, size: int, ends_at: float | None) -> bytes:
    """`size` bytes from `connection`, all by the monotonic time `ends_at` (None: no bound).

    Raises:
        DraftLinkError: the other end closed, the link broke, or `ends_at` passed.
    """
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        if ends_at is not None:
            remaining = ends_at - time.monotonic()
            if remaining <= 0:
                raise DraftLinkError("no answer in time")
            connection.settimeout(remaining)
        else:
            connection.settimeout(None)
        try:
            count = connection.recv_into(view[got:], size - got)
        except TimeoutError as error:
            raise DraftLinkError("no answer in time") from error
        except OSError as error:
            raise DraftLinkError(f"the link broke: {error}") from error
        if count == 0:
            raise DraftLinkError("the other end closed the link")
        got += count
    return bytes(buffer)


def read_frame(
    connection: socket.socket, ends_at: float | None, body_seconds: float = ROUND_TRIP_SECONDS
) -> bytes:
    """One frame's body. The wait for its first byte ends by `ends_at` (None: no bound, a
    server waiting for the next step); the rest must follow within `body_seconds`.

    Raises:
        DraftLinkError: as `_receive`, or a length past `MAX_FRAME_BYTES`.
    """
    header = _receive(connection, 1, ends_at)
    rest_by = time.monotonic() + body_seconds
    if ends_at is not None:
        rest_by = min(rest_by, ends_at)
    header += _receive(connection, _FRAME.size - 1, rest_by)
    (length,) = _FRAME.unpack(header)
    if length > MAX_FRAME_BYTES:
        raise DraftLinkError(f"a frame of {length} bytes: not this protocol")
    return _receive(connection, length, rest_by)


def send(connection: socket.socket, data: bytes, seconds: float) -> None:
    """Send `data` within `seconds`.

    Raises:
        DraftLinkError: the link broke or the send did not finish in time.
    """
    connection.settimeout(seconds)
    try:
        connection.sendall(data)
    except OSError as error:  # TimeoutError included
        raise DraftLinkError(f"the link broke: {error}") from error


def open_client(
    host: str,
    port: int,
    credentials: GroupCredentials | None,
    instance_id: str,
    fingerprint: bytes,
    vocab_size: int,
    connect_seconds: float = ROUND_TRIP_SECONDS,
) -> socket.socket:
    """Connect to a draft server and open the link (the module docstring's opening).

    Returns:
        The connected socket (TCP_NODELAY set).

    Raises:
        DraftRefusedError: the server refused the hello, or the handshake failed (a wrong
            secret: the reason says so). A handshake the server closed or let stall
            proves nothing: a `DraftLinkError`, retried like a lost link.
        DraftLinkError / OSError: no server there, or the link broke or stalled.
    """
    connection = socket.create_connection((host, port), timeout=connect_seconds)
    try:
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ends_at = time.monotonic() + HANDSHAKE_SECONDS
        if credentials is not None:
            try:
                authenticate_client(connection, credentials, Purpose.DRAFT, 0, 0)
            except HandshakeInterrupted as error:
                # Nothing proven either way (a busy server closing connections over its
                # cap, a restart): the link's ordinary retry, not a refusal's back-off.
                raise DraftLinkError(f"the draft server's handshake broke off: {error}") from error
            except AuthenticationError as error:
                raise DraftRefusedError(f"the draft server's handshake failed: {error}") from error
        identity = instance_id.encode()[:MAX_INSTANCE_ID_BYTES]
        hello = _HELLO.pack(MAGIC, VERSION, vocab_size, fingerprint, len(identity)) + identity
        send(connection, hello, HANDSHAKE_SECONDS)
        accepted, reason_length = _ANSWER.unpack(_receive(connection, _ANSWER.size, ends_at))
        reason = _receive(connection, reason_length, ends_at).decode(errors="replace")
        if not accepted:
            raise DraftRefusedError(reason)
        return connection
    except BaseException:
        connection.close()
        raise


@dataclass(frozen=True, slots=True)
class Hello:
    """What a client opened the link with."""

    vocab_size: int
    fingerprint: bytes
    instance_id: str


def accept_client(
    connection: socket.socket,
    credentials: GroupCredentials | None,
    refusal: Callable[[Hello], str | None],
) -> Hello:
    """Open the server's end of a link: the handshake where there is a secret, then the
    hello, which `refusal` judges (None: accepted, else the reason sent back).

    Raises:
        AuthenticationError: the handshake failed.
        DraftRefusedError: `refusal` refused the hello (the client was told why).
        DraftLinkError: not this protocol, or the opening passed `HANDSHAKE_SECONDS`.
    """
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ends_at = time.monotonic() + HANDSHAKE_SECONDS
    if credentials is not None:
        authenticate_server(connection, credentials, Purpose.DRAFT, 0, lambda rank: rank == 0)
    magic, version, vocab_size, fingerprint, id_length = _HELLO.unpack(
        _receive(connection, _HELLO.size, ends_at)
    )
    if magic != MAGIC:
        raise DraftLinkError("not a draft link's hello")
    if id_length > MAX_INSTANCE_ID_BYTES:
        raise DraftLinkError("an instance id past its bound")
    identity = _receive(connection, id_length, ends_at).decode(errors="replace")
    hello = Hello(vocab_size, fingerprint, identity)
    reason = (
        f"draft link version {version}, this server speaks {VERSION}"
        if version != VERSION
        else refusal(hello)
    )
    encoded = b"" if reason is None else reason.encode()[:MAX_REASON_BYTES]
    answer = _ANSWER.pack(reason is None, len(encoded)) + encoded
    send(connection, answer, max(ends_at - time.monotonic(), 0.01))
    if reason is not None:
        raise DraftRefusedError(reason)
    return hello
