"""A draft model on another node (issue 43, 1(b)): the link's drafts are the local draft
source's greedy drafts token for token and keep the server's KV in step through rejections;
the server drafts ahead while the target verifies, answers hits without a forward pass and
stops drafting ahead when a message arrives. A target drafting through the link and the
link's faults are in `test_remote_draft_faults.py`, which shares this module's fixtures.

The server runs on a thread of this process on a loopback port (the link is TCP either way);
the bench (`bench/bench_speculative.py --draft-pair`) runs it in another process. Models as
`test_speculative_draft_model.py`'s: a tiny random Llama target and a noisy copy as draft.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.comm.draft_link import (
    DraftAsk,
    DraftLinkError,
    decode_drafts,
    decode_propose,
    encode_drafts,
    encode_propose,
    open_client,
    read_frame,
    send,
    vocabulary_fingerprint,
)
from exo.worker.engines.torch.comm.group_auth import GroupCredentials
from exo.worker.engines.torch.decoding.speculative_drafts import (
    Draft,
    DraftRequest,
)
from exo.worker.engines.torch.draft_model import (
    DraftModelSource,
    load_draft_source,
)
from exo.worker.engines.torch.remote_drafts import (
    DraftServer,
    RemoteDraft,
    RemoteDraftSource,
)
from exo.worker.engines.torch.tests.speculative_builders import DRAFT_NOISE, noisy_copy

INSTANCE = "target-instance"
# Seconds to wait for a background (re)connection in a test: generous, it takes ms.
CONNECT_WAIT = 10.0


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("remote-draft")
    target = save_tiny_model(
        root / "target", "llama", real_model_dir, n_layers=3, tie_word_embeddings=False
    )
    return {"target": target, "draft": noisy_copy(target, root / "draft", DRAFT_NOISE)}


@pytest.fixture(scope="module")
def module_float32_kv() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_KV_CACHE_DTYPE", "float32")
        yield


def draft_source(model_dirs: dict[str, Path], slots: int = 4) -> tuple[DraftModelSource, str]:
    source, tokenizer = load_draft_source(
        model_dirs["draft"], None, slots, torch.float32, weight_dtype="float32"
    )
    return source, vocabulary_fingerprint(tokenizer)


@pytest.fixture(scope="module")
def sources(model_dirs: dict[str, Path]) -> tuple[DraftModelSource, DraftModelSource, str]:
    """The server's draft source and a local one over the same checkpoint, and its
    vocabulary fingerprint."""
    served, fingerprint = draft_source(model_dirs)
    local, _ = draft_source(model_dirs)
    return served, local, fingerprint


@pytest.fixture
def server(sources: tuple[DraftModelSource, DraftModelSource, str]) -> Iterator[DraftServer]:
    served, _local, fingerprint = sources
    started = DraftServer(served, fingerprint, 0, None, INSTANCE, host="127.0.0.1")
    started.start()
    yield started
    started.close()


def client(
    port: int,
    fingerprint: str,
    vocab_size: int,
    credentials: GroupCredentials | None = None,
    **options: float,
) -> RemoteDraftSource:
    remote = RemoteDraft("127.0.0.1", port, "draft", credentials, instance_id=INSTANCE)
    return RemoteDraftSource(remote, fingerprint, vocab_size, **options)


def connected(source: RemoteDraftSource) -> RemoteDraftSource:
    assert source.wait_connected(CONNECT_WAIT)
    return source


# --- the wire format ----------------------------------------------------------------------


def test_messages_round_trip_and_garbage_is_refused() -> None:
    asks = [DraftAsk(7, 3, (11, 12), 4), DraftAsk(0xFFFFFFFF, 0, (), 1)]
    frame = encode_propose([5, 6], asks)
    assert len(frame) == 4 + 4 + 2 * 4 + 2 * 14 + 2 * 4
    assert decode_propose(frame[4:]) == ((5, 6), asks)
    drafts = encode_drafts([(1, 2, 3), ()])
    assert decode_drafts(drafts[4:], 2) == [(1, 2, 3), ()]
    for garbage in (frame[4:-1], frame[4:] + b"\0", b"\xff\xff"):
        with pytest.raises(DraftLinkError):
            decode_propose(garbage)
    with pytest.raises(DraftLinkError, match="2 drafts for 3"):
        decode_drafts(drafts[4:], 3)


def test_the_fingerprint_tells_vocabularies_apart(real_tokenizer: object) -> None:
    class Swapped:
        def get_vocab(self) -> dict[str, int]:
            vocabulary = dict(real_tokenizer.get_vocab())  # type: ignore[attr-defined]
            first, second = sorted(vocabulary, key=vocabulary.__getitem__)[100:102]
            vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
            return vocabulary

    fingerprint = vocabulary_fingerprint(real_tokenizer)
    assert len(fingerprint) == 64 and fingerprint == vocabulary_fingerprint(real_tokenizer)
    assert vocabulary_fingerprint(Swapped()) != fingerprint


# --- drafts over the link -----------------------------------------------------------------


def steps_of_two_requests(
    source: RemoteDraftSource | DraftModelSource, vocab: int
) -> list[list[Draft]]:
    """Six rounds of two requests as a target would feed them: each round keeps the first
    draft token, replaces the next one with another token (a rejection and its
    correction), and sometimes grows by more; one request leaves and another joins."""
    texts = {"a": [5, 17, 29, 41, 3, 8], "b": [9, 2, 77, 15]}
    proposals = []
    for round_index in range(6):
        requests = [DraftRequest(name, list(text), 3) for name, text in texts.items()]
        drafts = source.propose(requests)
        proposals.append(drafts)
        for text, draft in zip(texts.values(), drafts, strict=True):
            text.extend(draft.tokens[:1])
            text.append((draft.tokens[1] + 1) % vocab if len(draft.tokens) > 1 else 1)
        if round_index == 2:
            source.forget("b")
            texts.pop("b")
            texts["c"] = [4, 4, 18, 90, 33]
    return proposals


def test_remote_greedy_drafts_are_the_local_sources_token_for_token(
    server: DraftServer, sources: tuple[DraftModelSource, DraftModelSource, str]
) -> None:
    _served, local, fingerprint = sources
    remote = connected(client(server.port, fingerprint, local.vocab_size))
    try:
        got = steps_of_two_requests(remote, local.vocab_size)
        expected = steps_of_two_requests(local, local.vocab_size)
    finally:
        remote.close()
    assert got == expected
    assert all(len(draft.tokens) == 3 and draft.probabilities is None
               for drafts in got for draft in drafts)  # fmt: skip
    counters = remote.counters
    assert counters.round_trips == 6 and counters.tokens_received == 36
    # The first round carries each whole text, later rounds only what changed: per request
    # the correction (the kept draft token is the server's already), the new one's prompt.
    assert counters.tokens_sent == (6 + 4) + 2 * 2 + (1 + 5) + 2 * 2
    for name in ("a", "c"):
        local.forget(name)


def test_one_steady_round_trip_moves_26_bytes_up_and_24_down(
    server: DraftServer, sources: tuple[DraftModelSource, DraftModelSource, str]
) -> None:
    """One request drafting 4 tokens, all accepted plus the target's bonus token: one new
    token up and four down: 26 bytes up, 24 down (`comm/draft_link.py`'s arithmetic)."""
    _served, local, fingerprint = sources
    remote = connected(client(server.port, fingerprint, local.vocab_size))
    try:
        text = [5, 17, 29, 41, 3, 8, 60, 61]
        (draft,) = remote.propose([DraftRequest("r", text, 4)])
        assert len(draft.tokens) == 4
        before = dataclasses.replace(remote.counters)
        text += [*draft.tokens, 99]
        (draft,) = remote.propose([DraftRequest("r", text, 4)])
        assert len(draft.tokens) == 4
        counters = remote.counters
        assert counters.bytes_sent - before.bytes_sent == 26
        assert counters.bytes_received - before.bytes_received == 24
        assert counters.tokens_sent - before.tokens_sent == 1
        remote.forget("r")
    finally:
        remote.close()


def test_after_rejections_the_servers_kv_is_the_local_sources(
    server: DraftServer, sources: tuple[DraftModelSource, DraftModelSource, str]
) -> None:
    """A request whose drafts are rejected (the server rolls its KV back to the common
    prefix): the tokens and KV the server holds are those of a local source fed alike."""
    served, local, fingerprint = sources
    remote = connected(client(server.port, fingerprint, local.vocab_size))
    try:
        text = [5, 17, 29, 41, 3, 8]
        for _ in range(4):
            (got,) = remote.propose([DraftRequest("k", list(text), 3)])
            (expected,) = local.propose([DraftRequest("k", list(text), 3)])
            assert got == expected
            text += [got.tokens[0], (got.tokens[1] + 7) % local.vocab_size]  # a rejection
        (handle,) = [name for name in map(str, range(64)) if served.holds(name)]
        held = served.held_tokens(handle)
        assert held == local.held_tokens("k") and len(held) > 6
        # The server sized its prefill chunk from its measured rounds.
        assert served.prefill_chunk is not None and 16 <= served.prefill_chunk <= 512
        torch.testing.assert_close(
            served.cache.read(served._sequences[handle].slot, len(held)),
            local.cache.read(local._sequences["k"].slot, len(held)),
            atol=0.0,
            rtol=0.0,
        )
        local.forget("k")
    finally:
        remote.close()


# --- drafting ahead while the target verifies ----------------------------------------------


@pytest.fixture
def ahead_servers(
    model_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[DraftServer, DraftServer, str]]:
    """Two servers over the same checkpoint, one drafting ahead (told so) and one not
    (`EXO_DRAFT_AHEAD=0`), and the vocabulary fingerprint."""
    started = []
    for ahead in (True, None):
        if ahead is None:
            monkeypatch.setenv("EXO_DRAFT_AHEAD", "0")
        source, fingerprint = draft_source(model_dirs)
        started.append(DraftServer(source, fingerprint, 0, None, INSTANCE, "127.0.0.1", ahead))
        started[-1].start()
    assert started[0].draft_ahead and not started[1].draft_ahead
    yield started[0], started[1], fingerprint
    for server in started:
        server.close()


def record_margins(source: DraftModelSource) -> list[float]:
    """Record the gap between the two largest logits of each greedy choice of `source`
    (how far a forward pass's float error is from flipping it)."""
    margins: list[float] = []
    choose = source._choose

    def recording(request: DraftRequest, sequence: Any, logits: torch.Tensor) -> Any:
        top = torch.topk(logits.float(), 2).values
        margins.append(float(top[0] - top[1]))
        return choose(request, sequence, logits)

    source._choose = recording  # type: ignore[method-assign]
    return margins


def greedy_next(oracle: DraftModelSource, name: str, text: list[int]) -> int:
    """The draft model's own greedy token after `text` (its guess of the bonus token)."""
    (draft,) = oracle.propose([DraftRequest(name, list(text), 1)])
    return draft.tokens[0]


def test_drafting_ahead_answers_what_drafting_without_it_does(
    ahead_servers: tuple[DraftServer, DraftServer, str],
    sources: tuple[DraftModelSource, DraftModelSource, str],
) -> None:
    """The same messages to a server drafting ahead and one not: the same drafts, through
    hits (all accepted, the bonus as guessed), misses of both kinds (another bonus, a
    rejected draft) and a request joining; after each round the drafting-ahead server's KV
    up to the other's text is the other's (a miss rolled back right). Float32 tiny models:
    forward passes of other batch compositions differ in the last bits at most, below any
    argmax margin of these texts (both asserted: margins over 1e-4, equal tokens)."""
    ahead, plain, fingerprint = ahead_servers
    _served, oracle, _ = sources
    vocab = oracle.vocab_size
    margins = [record_margins(server.source) for server in (ahead, plain)]
    clients = [connected(client(server.port, fingerprint, vocab)) for server in (ahead, plain)]
    # What the "target" does with each round's drafts, per request: keep all and append
    # the draft's own next token (a hit next round, where drafted ahead), keep all with
    # another bonus token, or reject the second draft token.
    outcomes = {
        "a": ["accept", "accept", "accept", "bonus", "accept", "accept", "reject", "accept"],
        "b": ["accept", "reject", "accept", "accept", "accept", "bonus", "accept", "accept"],
    }
    texts = {"a": [5, 17, 29, 41, 3, 8], "b": [9, 2, 77, 15]}
    try:
        for round_index in range(len(outcomes["a"])):
            if round_index == 3:
                texts["c"] = [4, 4, 18, 90, 33]
                outcomes["c"] = ["accept"] * 5
            requests = [DraftRequest(name, list(text), 3) for name, text in texts.items()]
            answers = []
            for link, server in zip(clients, (ahead, plain), strict=True):
                answers.append(link.propose(requests))
                assert server.wait_ahead(CONNECT_WAIT)
            assert answers[0] == answers[1], round_index
            for name, draft in zip(texts, answers[0], strict=True):
                assert len(draft.tokens) == 3
                text = texts[name]
                match outcomes[name][round_index - (3 if name == "c" else 0)]:
                    case "accept":
                        text += [*draft.tokens, greedy_next(oracle, name, [*text, *draft.tokens])]
                    case "bonus":
                        guess = greedy_next(oracle, name, [*text, *draft.tokens])
                        text += [*draft.tokens, (guess + 1) % vocab]
                    case _:
                        text += [draft.tokens[0], (draft.tokens[1] + 1) % vocab]
            for handle in [name for name in ("0", "1", "2") if plain.source.holds(name)]:
                plain_held = plain.source.held_tokens(handle)
                length = len(plain_held)
                assert ahead.source.held_tokens(handle)[:length] == plain_held
                torch.testing.assert_close(
                    ahead.source.cache.read(ahead.source._sequences[handle].slot, length),
                    plain.source.cache.read(plain.source._sequences[handle].slot, length),
                    atol=1e-5, rtol=1e-5,  # positions computed ahead: decode rows, not a segment
                )  # fmt: skip
    finally:
        for link in clients:
            link.close()
        for name in texts:
            oracle.forget(name)
    # Every greedy choice won by far more than the KV's differences (~1e-7 seen).
    assert min(min(recorded) for recorded in margins) > 1e-4
    counters = ahead.ahead
    assert counters.hits >= 6 and counters.misses >= 3 and counters.abandoned > 0
    assert counters.rounds > 0 and counters.positions >= counters.rounds
    assert plain.ahead == type(plain.ahead)() and plain.answer_forward_passes > 0
    # Hits save the forward passes the drafts ahead took over.
    assert ahead.answer_forward_passes < plain.answer_forward_passes


def ask(connection: socket.socket, kept: int, new_tokens: Sequence[int], k: int) -> tuple[int, ...]:
    """One PROPOSE of handle 0 over a raw link, and its draft."""
    send(connection, encode_propose([], [DraftAsk(0, kept, tuple(new_tokens), k)]), 2.0)
    (draft,) = decode_drafts(read_frame(connection, time.monotonic() + CONNECT_WAIT), 1)
    return draft


def open_raw(server: DraftServer, fingerprint: str, vocab: int) -> socket.socket:
    return open_client("127.0.0.1", server.port, None, INSTANCE, bytes.fromhex(fingerprint),
                       vocab)  # fmt: skip


def test_a_hit_is_answered_without_a_forward_pass(
    ahead_servers: tuple[DraftServer, DraftServer, str],
    sources: tuple[DraftModelSource, DraftModelSource, str],
) -> None:
    """All 4 drafts accepted and the bonus as guessed: the answer is the drafts computed
    ahead, no forward pass between the message's arrival and the answer."""
    ahead, _plain, fingerprint = ahead_servers
    _served, oracle, _ = sources
    connection = open_raw(ahead, fingerprint, oracle.vocab_size)
    try:
        text = [5, 17, 29, 41, 3, 8, 60, 61]
        draft = ask(connection, 0, text, 4)
        bonus = greedy_next(oracle, "h", text + list(draft))
        held = len(text) + len(draft)
        text += [*draft, bonus]
        draft = ask(connection, held, [bonus], 4)  # all accepted: drafts ahead after it
        assert ahead.wait_ahead(CONNECT_WAIT)
        assert ahead.ahead.positions == 5  # the bonus's guess and 4 drafts: k + 1
        bonus = greedy_next(oracle, "h", text + list(draft))
        held += 1 + len(draft)
        text += [*draft, bonus]
        passes = ahead.answer_forward_passes
        got = ask(connection, held, [bonus], 4)
        assert ahead.answer_forward_passes == passes
        assert ahead.ahead.hits == 1 and ahead.ahead.misses == 0
        (expected,) = oracle.propose([DraftRequest("h", text, 4)])
        assert got == expected.tokens
    finally:
        connection.close()
        oracle.forget("h")


def test_a_message_arriving_mid_ahead_stops_it(
    ahead_servers: tuple[DraftServer, DraftServer, str],
    sources: tuple[DraftModelSource, DraftModelSource, str],
) -> None:
    """Drafting ahead 9 positions, held at its second by a gate until the next message
    is in the server's socket: it stops there (2 positions, one interruption), and the
    answer uses the guess it has and computes the rest (a bounded wait: the gate's, then
    one position's)."""
    ahead, _plain, fingerprint = ahead_servers
    _served, oracle, _ = sources
    source = ahead.source
    gate, entered = threading.Event(), threading.Event()
    propose = source.propose
    calls = []

    def gated(requests: Sequence[DraftRequest]) -> list[Draft]:
        if all(request.max_tokens == 1 for request in requests):  # drafting ahead
            calls.append(len(requests))
            if len(calls) == 2:
                entered.set()
                assert gate.wait(CONNECT_WAIT)
        return propose(requests)

    source.propose = gated  # type: ignore[method-assign]
    connection = open_raw(ahead, fingerprint, oracle.vocab_size)
    try:
        text = [5, 17, 29, 41, 3, 8]
        draft = ask(connection, 0, text, 8)
        bonus = greedy_next(oracle, "m", text + list(draft))
        held = len(text) + len(draft)
        text += [*draft, bonus]
        draft = ask(connection, held, [bonus], 8)
        assert entered.wait(CONNECT_WAIT)
        bonus = greedy_next(oracle, "m", text + list(draft))
        held += 1 + len(draft)
        text += [*draft, bonus]
        passes = ahead.answer_forward_passes
        send(connection, encode_propose([], [DraftAsk(0, held, (bonus,), 8)]), 2.0)
        gate.set()
        (got,) = decode_drafts(read_frame(connection, time.monotonic() + CONNECT_WAIT), 1)
        # (It drafts ahead again after this answer: only what that leaves alone is read.)
        counters = ahead.ahead
        assert counters.interrupted == 1 and counters.hits == 1
        # The guess held the bonus and 1 draft: the other 7 drafts took 7 forward passes.
        assert ahead.answer_forward_passes - passes == 7
        (expected,) = oracle.propose([DraftRequest("m", text, 8)])
        assert got == expected.tokens
    finally:
        gate.set()
        connection.close()
        oracle.forget("m")
