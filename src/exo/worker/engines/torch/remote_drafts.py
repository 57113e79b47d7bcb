"""A draft model on another node of the cluster (issue 43, 1(b)): the target's rank 0 drafts
through a `RemoteDraftSource`, a `DraftSource` whose drafts come over a TCP link from a
`DraftServer` (`draft_server.py`, re-exported here), which runs a
`draft_model.DraftModelSource` in the draft runner on a spare node. The wire format and
its opening are `comm/draft_link.py`'s.

One round trip per target step that drafts, for all its speculating requests at once: rank
0 sends each request's new tokens (at a steady step the one token the target chose: the
accepted draft tokens are already the server's) and the most draft tokens the step has room
for; the server runs one batched `propose` (its own KV per request, rolled back to the
common prefix as on the target's node) and answers the draft tokens. So a step of R
requests drafting k tokens moves about 8 + 18 R bytes up and 6 + 2 R + 4 k R down (26 and
24 bytes for one request at k = 4): token ids only. The drafts are the draft model's
greedy tokens for every request, sampling ones too: a point mass q, which the target's
rejection rule handles without q rows (`RequestState.accept_drafts`: the output is still
distributed exactly as the target's, and for one seed it is plain decoding's very text).
Sending q for a sampling request would cost vocab-size floats per draft token (~600 KB per
4 tokens at 151k tokens: ~5 ms a step on gigabit Ethernet, against a few dozen bytes).
Why one round trip a step and no fewer: a step's drafts continue the text the step before
it verified (its accepted tokens and the target's own token), which exists only once that
step ends; all the step's requests share the one message, so the link costs one round trip
a step whatever the batch.
The draft's own time leaves the round trip where the server guessed the step's text: it
drafts ahead while the target verifies (`draft_server.py`'s module docstring; the client
needs to know nothing of it).

Loss: any error or a round trip past `ROUND_TRIP_SECONDS` (the server died, its node left,
the link stalled) gives no drafts for the step (`NO_DRAFT`: the requests decode plainly,
the text unchanged), one warning, and a reconnection in the background at most every
`RECONNECT_SECONDS`: the target's step never waits on a dead server longer than one round
trip's bound, and never on a connection being opened. A refused opening (another secret,
another instance, another vocabulary) likewise drafts nothing, logs its reason once, and is
retried every `REFUSED_RETRY_SECONDS` (the server may be replaced by a right one). A new
connection replaces the server's old one (a restarted rank 0): the server forgets every
request, and the client sends each one's whole text again.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from exo.shared.models.drafts import draft_runs_on
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.comm.draft_link import (
    JOIN_SECONDS,
    ROUND_TRIP_SECONDS,
    DraftAsk,
    DraftLinkError,
    DraftRefusedError,
    LinkCounters,
    decode_drafts,
    encode_propose,
    open_client,
    read_frame,
    send,
    vocabulary_fingerprint,
)
from exo.worker.engines.torch.comm.group_auth import GroupCredentials
from exo.worker.engines.torch.decoding.speculative_drafts import (
    NO_DRAFT,
    Draft,
    DraftRequest,
    DraftSource,
)
from exo.worker.engines.torch.draft_model import load_draft_model
from exo.worker.engines.torch.draft_server import DraftServer, load_draft_server
from exo.worker.engines.torch.quant.quantize import WeightDtype

# Least seconds between two connection attempts after a loss.
RECONNECT_SECONDS = 2.0
# Least seconds between two attempts after the server refused the opening.
REFUSED_RETRY_SECONDS = 30.0

__all__ = [
    "DraftServer",
    "RemoteDraft",
    "RemoteDraftSource",
    "draft_source_for",
    "load_draft_server",
    "vocabulary_fingerprint",
]


@dataclass(frozen=True, slots=True)
class RemoteDraft:
    """Where rank 0 of a target finds its draft model.

    Attributes:
        host / port: the draft server's address (its node's, the draft runner's port).
        model_id: the draft model's id (logs, metrics: the source's `name`).
        credentials: the group key and the TARGET's instance id, as on the server; None
            without a cluster secret.
        instance_id: the target's instance id the hello names where there are no
            credentials (with credentials, theirs is used).
    """

    host: str
    port: int
    model_id: str
    credentials: GroupCredentials | None
    instance_id: str = ""

    @property
    def target_instance(self) -> str:
        return self.credentials.instance_id if self.credentials is not None else self.instance_id


@dataclass(slots=True)
class _Sent:
    """What both ends hold for one request: the tokens sent, then the draft answered."""

    handle: int
    tokens: list[int]
    text_length: int  # tokens[:text_length] were sent; the rest is the draft


class RemoteDraftSource:
    """A `DraftSource` whose drafts come from a `DraftServer` (see the module docstring).

    Not thread-safe: `propose` and `forget` run on the target's stepping thread; a
    background thread only opens connections (`close` stops it).

    Args:
        remote: where the server is.
        fingerprint: `vocabulary_fingerprint` of the target's tokenizer.
        vocab_size: the length of the target's logits vectors.
        round_trip_seconds: the bound on one round trip (past it: the link is lost).
        reconnect_seconds / refused_retry_seconds: least seconds between connection
            attempts after a loss / a refusal.

    Attributes:
        counters: what the link carried (`LinkCounters`).
    """

    def __init__(
        self,
        remote: RemoteDraft,
        fingerprint: str,
        vocab_size: int,
        round_trip_seconds: float = ROUND_TRIP_SECONDS,
        reconnect_seconds: float = RECONNECT_SECONDS,
        refused_retry_seconds: float = REFUSED_RETRY_SECONDS,
    ) -> None:
        self.remote = remote
        self._fingerprint = bytes.fromhex(fingerprint)
        self.vocab_size = vocab_size
        self.round_trip_seconds = round_trip_seconds
        self.reconnect_seconds = reconnect_seconds
        self.refused_retry_seconds = refused_retry_seconds
        self.counters = LinkCounters()
        self._connection: socket.socket | None = None
        self._sent: dict[str, _Sent] = {}
        self._forgotten: list[int] = []
        self._next_handle = 0
        self._lock = threading.Lock()
        self._fresh: socket.socket | None = None  # opened by the connector, not yet used
        self._wanted = threading.Event()  # the connector should open a connection
        self._closed = threading.Event()
        self._reasons_logged: set[str] = set()
        self._connected_before = False
        self._loss_logged = False
        self._wanted.set()
        self._connector = threading.Thread(
            target=self._connect_loop, name=f"draft-link-{remote.host}:{remote.port}", daemon=True
        )
        self._connector.start()

    @property
    def name(self) -> str:
        return self.remote.model_id

    @property
    def connected(self) -> bool:
        """Whether a connection is open (or opened and not yet used)."""
        with self._lock:
            return self._connection is not None or self._fresh is not None

    def wait_connected(self, seconds: float) -> bool:
        """Wait up to `seconds` for a connection (tests, warm-up); whether there is one."""
        ends_at = time.monotonic() + seconds
        while not self.connected and time.monotonic() < ends_at:
            time.sleep(0.01)
        return self.connected

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """Each request's greedy draft from the server, at most its `max_tokens` long, or
        `NO_DRAFT` for all where there is no link (never raises for a link's failure)."""
        if not requests:
            return []
        self._adopt()
        connection = self._connection
        if connection is None:
            return [NO_DRAFT] * len(requests)
        asks: list[DraftAsk] = []
        texts: list[list[int]] = []
        for request in requests:
            text = list(request.tokens)
            sent = self._sent.get(request.request_id)
            if sent is None:
                sent = self._sent[request.request_id] = _Sent(self._next_handle, [], 0)
                self._next_handle = (self._next_handle + 1) & 0xFFFFFFFF
            kept = _common_prefix(sent, text)
            asks.append(DraftAsk(sent.handle, kept, tuple(text[kept:]), request.max_tokens))
            texts.append(text)
        message = encode_propose(self._forgotten, asks)
        started = time.monotonic()
        try:
            send(connection, message, self.round_trip_seconds)
            body = read_frame(connection, started + self.round_trip_seconds)
            drafts = decode_drafts(body, len(asks))
        except (DraftLinkError, OSError) as error:
            self._lost(error)
            return [NO_DRAFT] * len(requests)
        self._forgotten.clear()
        self._loss_logged = False
        counters = self.counters
        counters.seconds += time.monotonic() - started
        counters.round_trips += 1
        counters.bytes_sent += len(message)
        counters.bytes_received += len(body) + 4
        counters.tokens_sent += sum(len(ask.new_tokens) for ask in asks)
        result = []
        for request, text, tokens in zip(requests, texts, drafts, strict=True):
            sent = self._sent[request.request_id]
            sent.tokens = text + list(tokens)
            sent.text_length = len(text)
            counters.tokens_received += len(tokens)
            tokens = tokens[: request.max_tokens]
            result.append(Draft(tuple(tokens)) if tokens else NO_DRAFT)
        return result

    def forget(self, request_id: str) -> None:
        sent = self._sent.pop(request_id, None)
        if sent is not None and self._connection is not None:
            self._forgotten.append(sent.handle)  # goes with the next message

    def close(self) -> None:
        """Close the link and stop reconnecting (joins the connector, bounded)."""
        self._closed.set()
        self._wanted.set()
        with self._lock:
            fresh, self._fresh = self._fresh, None
        for connection in (self._connection, fresh):
            if connection is not None:
                connection.close()
        self._connection = None
        self._connector.join(JOIN_SECONDS)

    # -- the link's life ----------------------------------------------------------------

    def _adopt(self) -> None:
        """Start using a connection the connector opened: the server holds nothing."""
        with self._lock:
            fresh, self._fresh = self._fresh, None
        if fresh is None:
            return
        if self._connection is not None:
            self._connection.close()
        self._connection = fresh
        self._sent.clear()
        self._forgotten.clear()

    def _lost(self, error: BaseException) -> None:
        assert self._connection is not None
        self._connection.close()
        self._connection = None
        self._sent.clear()
        self._forgotten.clear()
        self.counters.losses += 1
        # Once per outage: a link lost again before any round trip went through is the
        # same outage (a server up but too slow, say).
        log = logger.debug if self._loss_logged else logger.warning
        self._loss_logged = True
        log(
            "draft server {} at {}:{} lost ({}): decoding goes on without drafts; "
            "reconnecting every {:.0f} s", self.name, self.remote.host, self.remote.port,
            error, self.reconnect_seconds,
        )  # fmt: skip
        self._wanted.set()

    def _connect_loop(self) -> None:
        """Open a connection whenever one is wanted, one attempt per `reconnect_seconds`
        at most (`refused_retry_seconds` after a refusal)."""
        remote = self.remote
        next_attempt = 0.0
        while not self._closed.is_set():
            self._wanted.wait()
            if self._closed.wait(max(0.0, next_attempt - time.monotonic())):
                return
            next_attempt = time.monotonic() + self.reconnect_seconds
            try:
                connection = open_client(
                    remote.host, remote.port, remote.credentials, remote.target_instance,
                    self._fingerprint, self.vocab_size, self.round_trip_seconds,
                )  # fmt: skip
            except DraftRefusedError as refused:
                next_attempt = time.monotonic() + self.refused_retry_seconds
                if refused.reason not in self._reasons_logged:
                    self._reasons_logged.add(refused.reason)
                    logger.error("draft server {} at {}:{} refused this target: {}; no drafts",
                                 self.name, remote.host, remote.port, refused.reason)  # fmt: skip
                continue
            except (DraftLinkError, OSError) as error:
                logger.debug("draft server {} not reachable: {}", self.name, error)
                continue
            with self._lock:
                if self._closed.is_set():
                    connection.close()
                    return
                self._fresh = connection
                self._wanted.clear()
            self.counters.connections += 1
            logger.info(
                "draft server {} at {}:{} {}", self.name, remote.host, remote.port,
                "reconnected: drafts resume" if self._connected_before else "connected",
            )  # fmt: skip
            self._connected_before = True


def _common_prefix(sent: _Sent, text: list[int]) -> int:
    """How many of the tokens both ends hold for a request `text` still begins with: the
    sent part compared at once (a rank 0's text only changes at its end), then the draft
    token by token."""
    held = sent.tokens
    length = min(sent.text_length, len(text))
    if held[:length] != text[:length]:  # a request id's text replaced: compare it all
        length = 0
    limit = min(len(held), len(text))
    while length < limit and held[length] == text[length]:
        length += 1
    return length


def draft_source_for(
    shard: ShardMetadata,
    draft_model: Path | None,
    remote_draft: RemoteDraft | None,
    tokenizer: Any,
    vocab_size: int,
    slots: int,
    kv_dtype: torch.dtype,
    device: str,
    weight_dtype: WeightDtype | None,
    draft_model_id: str | None = None,
) -> DraftSource | None:
    """Where the engine of `shard` drafts from (`TorchEngine.load`): a draft model on
    another node (`remote_draft`: a `RemoteDraftSource`, which opens its link in the
    background), else one loaded here (`draft_model`: `load_draft_model`), else None
    (n-gram drafts). Only rank 0 of a split whose parallelism verifies drafts drafts
    (`drafts.draft_runs_on`); other ranks get None, with a warning where one was named.

    Args:
        tokenizer / vocab_size: the target's tokenizer and logits length.
        slots / kv_dtype / device / weight_dtype: a local draft model's (the target's).
        draft_model_id: the local draft model's id (`load_draft_model`'s `model_id`).

    Raises:
        VocabularyMismatchError / ValueError: as `load_draft_model`.
    """
    named = remote_draft.model_id if remote_draft is not None else draft_model
    if named is None:
        return None
    if not (shard.device_rank == 0 and draft_runs_on(shard.sharding, shard.world_size)):
        logger.warning("draft model {} unused: this rank of a {} split does not draft", named,
                       shard.sharding)  # fmt: skip
        return None
    if remote_draft is not None:
        if draft_model is not None:
            logger.warning("draft model {} here left unused: the draft runs on {}:{}",
                           draft_model, remote_draft.host, remote_draft.port)  # fmt: skip
        return RemoteDraftSource(remote_draft, vocabulary_fingerprint(tokenizer), vocab_size)
    assert draft_model is not None
    return load_draft_model(
        draft_model, tokenizer, shard.model_card.model_id, vocab_size, slots, kv_dtype, device,
        weight_dtype, draft_model_id,
    )  # fmt: skip
