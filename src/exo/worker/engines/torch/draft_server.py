"""The server end of a draft model on another node (issue 43, 1(b)): a `DraftServer` in the
draft runner on a spare node serves a `draft_model.DraftModelSource`'s greedy drafts to the
target's rank 0 (`remote_drafts.RemoteDraftSource`, which says what travels and why; the
wire format is `comm/draft_link.py`'s).

The server keeps, per request the client names (by a small number, its handle), the tokens
both ends hold: what the client sent and the drafts it answered. Each round trip brings
each speculating request's kept prefix and new tokens; the server rebuilds its text, runs
one batched `propose` for all of them (the draft's KV rolls back to the common prefix by
itself) and answers the tokens. A request catching up on a long prompt prefills a chunk
per round (as on the target's node), sized so that a round's drafting takes at most a
quarter of the client's round-trip bound at the measured cost (`prefill_chunk`: a large
draft on a slow CPU would otherwise time the link out). A request the draft's KV slots
have no room for gets no draft; a failing draft model answers no drafts and starts the
requests afresh. The newest
opened connection is the one served: a new one (a restarted rank 0) replaces the old one,
and the server forgets every request.

Drafting ahead (on unless `EXO_DRAFT_AHEAD=0`): the server is idle while the target
verifies, so after answering a message it goes on drafting, for each request whose drafts
the message showed all accepted, as if the target accepts every draft token again: it
guesses the target's bonus token (its own greedy token after the last draft) and drafts
after it, one position at a time (one batched `propose` for all those requests per
position), at most the asked draft length + 1 positions, and stops at once when the next
message arrives (the socket is polled between positions, no wait). When that message's new
tokens for a request are the guessed ones (all drafts accepted, the bonus as guessed: a
hit), the precomputed drafts are answered at once (only what is missing up to the asked
length is computed); otherwise (a miss) the guess is dropped and the KV rolls back to the
common prefix as for any text. Greedy drafts depend on the text alone, so the answer is the
one the server would have computed without drafting ahead, up to the last bits of float
arithmetic in forward passes of another batch composition (an argmax could only differ
where two logits tie to within them). It pays on the steps whose k drafts and bonus all
agree with the target: about acceptance^(k+1) of them; low acceptance costs only the check.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from loguru import logger

from exo.shared.models.kv_cache_memory import KVCacheDtype
from exo.worker.engines.torch.batching.kv_memory import kv_cache_torch_dtype
from exo.worker.engines.torch.comm.draft_link import (
    JOIN_SECONDS,
    ROUND_TRIP_SECONDS,
    DraftLinkError,
    Hello,
    LinkCounters,
    accept_client,
    decode_propose,
    encode_drafts,
    read_frame,
    send,
    vocabulary_fingerprint,
)
from exo.worker.engines.torch.comm.group_auth import AuthenticationError, GroupCredentials
from exo.worker.engines.torch.decoding.speculative_drafts import NO_DRAFT, DraftRequest
from exo.worker.engines.torch.draft_model import (
    DRAFT_PREFILL_CHUNK,
    DraftModelSource,
    load_draft_source,
)
from exo.worker.engines.torch.quant.quantize import WeightDtype

# Most draft tokens a server computes for one request in one round trip.
MAX_DRAFT_TOKENS = 64
# The share of the client's round-trip bound a round's drafting may take (the prefill chunk
# of a request catching up is sized to it), and the fewest positions a chunk keeps.
DRAFTING_SHARE = 0.25
MIN_PREFILL_CHUNK = 16
# Connections in their opening at once on a server; more are closed at once.
MAX_PENDING_OPENINGS = 8
_POLL_SECONDS = 0.2  # how often the accept loop looks at its stop flag
# `0` turns drafting ahead off (the module docstring).
DRAFT_AHEAD_ENV = "EXO_DRAFT_AHEAD"


def draft_ahead_default() -> bool:
    """Whether servers draft ahead unless told: yes, unless `EXO_DRAFT_AHEAD=0`."""
    return os.environ.get(DRAFT_AHEAD_ENV, "1").strip() != "0"


@dataclass(slots=True)
class AheadCounters:
    """What drafting ahead did (cumulative).

    Attributes:
        rounds: idle times drafted in (after an answer, for at least one request).
        positions: positions drafted ahead (one per request per forward pass).
        interrupted: rounds stopped by the next message before their last position.
        hits: messages whose tokens for a request were the guessed ones.
        misses: messages whose tokens for a request were other than guessed.
        abandoned: positions drafted ahead and never answered (a miss's all, a hit's
            beyond the asked length, a forgotten request's).
        seconds: spent drafting ahead (off the target's critical path).
    """

    rounds: int = 0
    positions: int = 0
    interrupted: int = 0
    hits: int = 0
    misses: int = 0
    abandoned: int = 0
    seconds: float = 0.0


@dataclass(slots=True)
class _Held:
    """What both ends hold for one request, and what the server drafted ahead for it.

    Attributes:
        tokens: the text the client sent, then the draft answered (the last `drafted`).
        drafted: the last draft's length.
        guessed: drafted ahead: the guessed bonus token, then the draft tokens after it.
        ahead: positions still to draft ahead after this round's answer (0: none).
    """

    tokens: list[int]
    drafted: int = 0
    guessed: list[int] = field(default_factory=list)
    ahead: int = 0


class DraftServer:
    """Serves a draft model's greedy drafts to one target's rank 0 (see the module
    docstring): an accept loop on a daemon thread, each connection's opening on a thread of
    its own (a stranger that stalls or sends garbage holds up nobody and is dropped), the
    newest opened connection served, replacing the one before.

    Args:
        source: the draft model (its requests are the link's handles).
        fingerprint: `vocabulary_fingerprint` of the draft's tokenizer.
        port: the port to listen on (0: any free one; `port` tells which after `start`).
        credentials: the group key and the target's instance id; None without a secret.
        instance_id: the target's instance id a client's hello must name.
        host: the address to listen on.
        draft_ahead: draft ahead while the target verifies (the module docstring); None:
            `draft_ahead_default()`.

    Attributes:
        counters: what the served links carried (`LinkCounters`; `losses`: connections
            ended by an error).
        ahead: what drafting ahead did (`AheadCounters`).
        answer_forward_passes: the draft's forward passes run while a message waited for
            its answer (the target's critical path; drafting ahead's are not counted).
        refusals: openings refused or failed (wrong secret, instance or vocabulary, garbage).
    """

    def __init__(
        self,
        source: DraftModelSource,
        fingerprint: str,
        port: int,
        credentials: GroupCredentials | None,
        instance_id: str,
        host: str = "0.0.0.0",
        draft_ahead: bool | None = None,
    ) -> None:
        self.source = source
        self.fingerprint = fingerprint
        self._fingerprint = bytes.fromhex(fingerprint)
        self.port = port
        self.credentials = credentials
        self.instance_id = instance_id
        self.host = host
        self.counters = LinkCounters()
        self.refusals = 0
        self._listener: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        # Each connection's thread (in its opening or served) and socket.
        self._links: dict[threading.Thread, socket.socket] = {}
        self._lock = threading.Lock()  # the source, the current connection, `_held`
        self._current: socket.socket | None = None
        self._held: dict[int, _Held] = {}  # by handle
        self.draft_ahead = draft_ahead_default() if draft_ahead is None else draft_ahead
        self.ahead = AheadCounters()
        self.answer_forward_passes = 0
        self._ahead_done = threading.Event()  # no drafting ahead pending or running
        self._ahead_done.set()
        self._stopping = threading.Event()
        self._seconds_per_position: float | None = None  # the last round's drafting
        # The process's torch threads when built: each serving thread's OpenMP regions take
        # the same count (`_serve`).
        self._threads = torch.get_num_threads()

    def start(self) -> None:
        """Bind and serve on a daemon thread.

        Raises:
            OSError: the port is taken (or the address is not this node's).
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(16)
        except OSError:
            listener.close()
            raise
        listener.settimeout(_POLL_SECONDS)
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._accept_thread = threading.Thread(
            target=self._accept_loop, name=f"draft-server-{self.port}", daemon=True
        )
        self._accept_thread.start()
        logger.info("draft server {} listening on {}:{}", self.source.name, self.host, self.port)

    def close(self) -> None:
        """Stop accepting, close every connection and join the threads (bounded)."""
        self._stopping.set()
        if self._accept_thread is not None:
            self._accept_thread.join(JOIN_SECONDS)
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            self._current = None
            links = dict(self._links)
        for connection in links.values():
            _shut(connection)
        ends_at = time.monotonic() + JOIN_SECONDS
        for thread in links:
            thread.join(max(0.0, ends_at - time.monotonic()))
        with self._lock:
            self._forget_all()

    def _accept_loop(self) -> None:
        assert self._listener is not None
        while not self._stopping.is_set():
            try:
                connection, _address = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                if self._stopping.is_set():
                    return
                time.sleep(_POLL_SECONDS)  # out of file descriptors, say: try again
                continue
            with self._lock:
                if len(self._links) >= MAX_PENDING_OPENINGS + 1:
                    connection.close()
                    self.refusals += 1
                    continue
                thread = threading.Thread(
                    target=self._serve, args=(connection,), name="draft-server-link",
                    daemon=True,
                )  # fmt: skip
                self._links[thread] = connection
            thread.start()

    def _refusal(self, hello: Hello) -> str | None:
        if hello.instance_id != self.instance_id:
            return (
                f"this draft server drafts for instance {self.instance_id}, not {hello.instance_id}"
            )
        if hello.fingerprint != self._fingerprint:
            return (
                f"the draft model {self.source.name} has another vocabulary than the target "
                "(a draft model needs the target's tokenizer)"
            )
        return None

    def _serve(self, connection: socket.socket) -> None:
        """One connection: its opening, then its round trips while it is the current one."""
        # OpenMP's thread count is per thread: a thread of its own would run the native
        # kernels' parallel regions with OpenMP's default (every CPU the library saw when
        # loaded), oversubscribing a runner confined to fewer (spin-waiting threads decode
        # several times slower: docs/engine.md, "Threads").
        torch.set_num_threads(self._threads)
        try:
            try:
                hello = accept_client(connection, self.credentials, self._refusal)
            except (AuthenticationError, DraftLinkError, OSError, struct.error) as error:
                self.refusals += 1
                logger.warning("draft server {}: a connection refused: {}", self.source.name,
                               error)  # fmt: skip
                return
            with self._lock:
                if self._stopping.is_set():
                    return
                previous, self._current = self._current, connection
                self._forget_all()
                self.source.vocab_size = hello.vocab_size
                self.counters.connections += 1
            if previous is not None:
                _shut(previous)
            logger.info("draft server {}: a target's rank 0 connected", self.source.name)
            while not self._stopping.is_set():
                try:
                    body = read_frame(connection, None)
                    answer = self._answer(connection, body)
                    if answer is None:
                        return  # replaced by a newer connection
                    send(connection, answer, ROUND_TRIP_SECONDS)
                    self._draft_ahead(connection)
                except DraftLinkError as error:
                    with self._lock:
                        replaced = self._current is not connection
                    if not replaced and not self._stopping.is_set():
                        self.counters.losses += 1
                        logger.info("draft server {}: the link ended: {}", self.source.name,
                                    error)  # fmt: skip
                    return
        finally:
            connection.close()
            with self._lock:
                if self._current is connection:
                    self._current = None
                self._links.pop(threading.current_thread(), None)
            self._ahead_done.set()

    def _answer(self, connection: socket.socket, body: bytes) -> bytes | None:
        """The DRAFTS frame answering a PROPOSE body; None where `connection` is no longer
        the current one. Requests drafted ahead for are answered from their guess where the
        message's tokens are the guessed ones (the module docstring).

        Raises:
            DraftLinkError: the body does not parse, or names a prefix longer than held.
        """
        forgotten, asks = decode_propose(body)
        with self._lock:
            if self._current is not connection:
                return None
            for handle in forgotten:
                self._forget(handle)
            requests: list[DraftRequest] = []
            drafting: list[int] = []  # index in `asks` of each request
            drafts: list[tuple[int, ...]] = [() for _ in asks]
            precomputed: list[list[int]] = [[] for _ in asks]
            free = self.source.free_slots
            if len({ask.handle for ask in asks}) < len(asks):
                raise DraftLinkError("a request named twice in one message")
            for index, ask in enumerate(asks):
                held = self._held.get(ask.handle) or _Held([])
                if ask.kept > len(held.tokens):
                    raise DraftLinkError(f"kept {ask.kept} of {len(held.tokens)} tokens held")
                text = held.tokens[: ask.kept] + list(ask.new_tokens)
                if not text:
                    raise DraftLinkError("a request without tokens")
                all_accepted = held.drafted > 0 and ask.kept == len(held.tokens)
                guessed = self._take_guess(held, ask.new_tokens, all_accepted)
                self._held[ask.handle] = held
                held.tokens, held.drafted, held.ahead = text, 0, 0
                request_id = str(ask.handle)
                asked = min(ask.max_tokens, MAX_DRAFT_TOKENS)
                if asked < 1 or (not self.source.holds(request_id) and free <= 0):
                    self.ahead.abandoned += len(guessed)
                    continue  # no room for it: no draft this step
                if self.draft_ahead and all_accepted:
                    held.ahead = asked + 1  # the bonus token's guess, then `asked` drafts
                if len(guessed) >= asked:  # a hit drafted far enough: no forward pass
                    drafts[index] = tuple(guessed[:asked])
                    self.ahead.abandoned += len(guessed) - asked
                    continue
                if not self.source.holds(request_id):
                    free -= 1
                precomputed[index] = guessed
                requests.append(DraftRequest(request_id, text + guessed, asked - len(guessed)))
                drafting.append(index)
            started = time.perf_counter()
            positions = self.source.positions_computed
            passes = self.source.forward_passes
            self.source.prefill_chunk = prefill_chunk(self._seconds_per_position)
            try:
                proposed = self.source.propose(requests)
            except Exception as error:  # the draft model failed: no drafts this time
                logger.opt(exception=error).warning("draft model {} failed", self.source.name)
                for request in requests:  # its state for them may be half-updated
                    self.source.forget(request.request_id)
                proposed = [NO_DRAFT] * len(requests)
            for index, proposal in zip(drafting, proposed, strict=True):
                drafts[index] = tuple(precomputed[index]) + proposal.tokens
            for ask, draft in zip(asks, drafts, strict=True):
                held = self._held[ask.handle]
                held.tokens.extend(draft)
                held.drafted = len(draft)
                if not draft:
                    held.ahead = 0
            seconds = time.perf_counter() - started
            self.answer_forward_passes += self.source.forward_passes - passes
            computed = self.source.positions_computed - positions
            if computed > 0:  # an over-estimate where decode passes dominate: on the safe side
                self._seconds_per_position = seconds / computed
            if any(held.ahead for held in self._held.values()):
                self._ahead_done.clear()  # before the answer goes: `wait_ahead` sees it
            counters = self.counters
            counters.seconds += seconds
            counters.round_trips += 1
            counters.bytes_received += len(body) + 4
            counters.tokens_received += sum(len(ask.new_tokens) for ask in asks)
            counters.tokens_sent += sum(len(draft) for draft in drafts)
            answer = encode_drafts(drafts)
            counters.bytes_sent += len(answer)
            return answer

    def _take_guess(
        self, held: _Held, new_tokens: tuple[int, ...], all_accepted: bool
    ) -> list[int]:
        """A request's drafts computed ahead that follow the message's text: the guess
        past the new tokens where they begin it (a hit), else none (a miss: the guess is
        dropped; the KV rolls back in the next `propose`). The guess is used up either way."""
        guessed, held.guessed = held.guessed, []
        if not guessed:
            return []
        count = len(new_tokens)
        if all_accepted and 0 < count <= len(guessed) and tuple(guessed[:count]) == new_tokens:
            self.ahead.hits += 1
            return guessed[count:]
        self.ahead.misses += 1
        self.ahead.abandoned += len(guessed)
        return []

    def _draft_ahead(self, connection: socket.socket) -> None:
        """While the target verifies: draft ahead for the requests the last message marked
        (`_Held.ahead`), one batched forward pass per position, until each has its
        positions or the next message arrives (polled between positions, no wait)."""
        if not self.draft_ahead:
            return
        started = time.perf_counter()
        positions = 0
        try:
            while not self._stopping.is_set():
                if select.select([connection], [], [], 0)[0]:  # the next message (or EOF)
                    with self._lock:
                        if any(held.ahead for held in self._held.values()):
                            self.ahead.interrupted += 1
                    return
                with self._lock:
                    if self._current is not connection:
                        return
                    handles = [handle for handle, held in self._held.items()
                               if held.ahead > 0 and self.source.holds(str(handle))]  # fmt: skip
                    if not handles:
                        return
                    if positions == 0:
                        self.ahead.rounds += 1
                    requests = [
                        DraftRequest(str(handle), self._held[handle].tokens
                                     + self._held[handle].guessed, 1)
                        for handle in handles
                    ]  # fmt: skip
                    try:
                        proposed = self.source.propose(requests)
                    except Exception as error:  # as in `_answer`: start these afresh
                        logger.opt(exception=error).warning("draft model {} failed drafting "
                                                            "ahead", self.source.name)  # fmt: skip
                        for handle in handles:
                            self.source.forget(str(handle))
                            held = self._held[handle]
                            self.ahead.abandoned += len(held.guessed)
                            held.guessed, held.ahead = [], 0
                        return
                    for handle, draft in zip(handles, proposed, strict=True):
                        held = self._held[handle]
                        held.guessed.extend(draft.tokens)
                        held.ahead = held.ahead - 1 if draft.tokens else 0
                        positions += len(draft.tokens)
                    self.ahead.positions += sum(len(draft.tokens) for draft in proposed)
        finally:
            seconds = time.perf_counter() - started
            self.ahead.seconds += seconds
            if positions:
                ahead = self.ahead
                logger.debug(
                    "draft server {}: drafted {} positions ahead in {:.1f} ms; so far {} hits, "
                    "{} misses, {} of {} positions abandoned, {} stopped by a message",
                    self.source.name, positions, 1e3 * seconds, ahead.hits, ahead.misses,
                    ahead.abandoned, ahead.positions, ahead.interrupted,
                )  # fmt: skip
            self._ahead_done.set()

    def wait_ahead(self, seconds: float) -> bool:
        """Wait up to `seconds` until no drafting ahead is pending or running (tests, bench:
        a message sent then finds the whole guess); whether it is so."""
        return self._ahead_done.wait(seconds)

    def _forget(self, handle: int) -> None:
        held = self._held.pop(handle, None)
        if held is not None:
            self.ahead.abandoned += len(held.guessed)
        self.source.forget(str(handle))

    def _forget_all(self) -> None:
        for handle in list(self._held):
            self._forget(handle)


def prefill_chunk(seconds_per_position: float | None) -> int:
    """The positions a round's draft prefill may take so that the round drafts within
    `DRAFTING_SHARE` of `ROUND_TRIP_SECONDS` at the measured cost per computed position
    (None: unmeasured yet, `DRAFT_PREFILL_CHUNK`): a large draft model on a slow CPU
    catching up on a long prompt must not make the client's round trip time out, which
    would drop the link and its catch-up with it. Between `MIN_PREFILL_CHUNK` and
    `DRAFT_PREFILL_CHUNK`."""
    if seconds_per_position is None or seconds_per_position <= 0:
        return DRAFT_PREFILL_CHUNK
    fitting = int(DRAFTING_SHARE * ROUND_TRIP_SECONDS / seconds_per_position)
    return max(MIN_PREFILL_CHUNK, min(DRAFT_PREFILL_CHUNK, fitting))


def _shut(connection: socket.socket) -> None:
    """Wake a thread blocked reading `connection` (it then closes it)."""
    with contextlib.suppress(OSError):
        connection.shutdown(socket.SHUT_RDWR)


def load_draft_server(
    model_dir: Path,
    port: int,
    credentials: GroupCredentials | None,
    instance_id: str,
    slots: int,
    kv_dtype: KVCacheDtype | torch.dtype | None,
    weight_dtype: WeightDtype | None = None,
    device: str = "cpu",
) -> DraftServer:
    """Load a draft model for a draft server (not started: `DraftServer.start`).

    Args:
        model_dir: the draft model's directory.
        port: where the server will listen (0: any free port).
        credentials / instance_id: as `DraftServer`'s (the target's instance).
        slots: most requests drafted for at once (the target's batch).
        kv_dtype: how the draft's keys and values are stored (a `--kv-cache-dtype` name,
            a torch dtype, or None: the node's default, `kv_cache_torch_dtype`).
        weight_dtype: how its weights are held (None: the engine's default).

    Raises:
        ValueError: the directory is not a loadable model.
    """
    if not isinstance(kv_dtype, torch.dtype):
        kv_dtype = kv_cache_torch_dtype(kv_dtype, torch.device(device), torch.float32)
    source, tokenizer = load_draft_source(model_dir, None, slots, kv_dtype, device, weight_dtype)
    return DraftServer(source, vocabulary_fingerprint(tokenizer), port, credentials, instance_id)
