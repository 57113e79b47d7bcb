"""A target drafting through a remote draft model's link (issue 43, 1(b)), and the link's
faults: greedy and seeded sampling through the link decode exactly as plainly; a killed,
stalled or restarted server (also in another process), a wrong secret, a stranger, another
vocabulary or instance and a taken port leave the target decoding, without drafts where there
are none. The server, its fixtures and models are `test_remote_drafts.py`'s.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from exo.testing.ports import free_port
from exo.worker.engines.torch.comm.draft_link import (
    DraftLinkError,
    DraftRefusedError,
    open_client,
)
from exo.worker.engines.torch.comm.group_auth import GroupCredentials
from exo.worker.engines.torch.decoding.speculative_drafts import (
    NO_DRAFT,
    Draft,
    DraftRequest,
)
from exo.worker.engines.torch.draft_model import (
    DRAFT_PREFILL_CHUNK,
    DraftModelSource,
)
from exo.worker.engines.torch.draft_server import prefill_chunk
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.remote_drafts import (
    DraftServer,
    RemoteDraft,
    RemoteDraftSource,
    load_draft_server,
)
from exo.worker.engines.torch.tests import test_remote_drafts as remote_drafts
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    load,
    plain_references,
    request,
    run,
    speculation,
)
from exo.worker.engines.torch.tests.test_remote_drafts import (
    CONNECT_WAIT,
    INSTANCE,
    client,
    connected,
    draft_source,
)

# The fixtures shared with test_remote_drafts.py (each module-scoped one built again here).
model_dirs = remote_drafts.model_dirs
module_float32_kv = remote_drafts.module_float32_kv
server = remote_drafts.server
sources = remote_drafts.sources


# --- a target drafting through the link ---------------------------------------------------


@pytest.fixture(scope="module")
def remote_engine(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> Iterator[tuple[TorchEngine, DraftServer]]:
    """A target drafting through a server of its own (a draft source of its own: request
    ids are per source)."""
    served, fingerprint = draft_source(model_dirs)
    server = DraftServer(served, fingerprint, 0, None, INSTANCE, host="127.0.0.1")
    server.start()
    remote = RemoteDraft("127.0.0.1", server.port, "draft", None, instance_id=INSTANCE)
    engine = load(model_dirs["target"], remote_draft=remote)
    yield engine, server
    engine.shutdown()
    server.close()


def finish(engine: TorchEngine) -> None:
    """Step until the requests in flight finish (at most 200 steps)."""
    for _ in range(200):
        if not engine.has_work:
            engine.store_finished()
            return
        engine.step()
    raise AssertionError("the requests did not finish within 200 steps")


def link_of(engine: TorchEngine) -> RemoteDraftSource:
    source = speculation(engine).source
    assert isinstance(source, RemoteDraftSource) and source is engine.draft_source
    return source


def test_greedy_through_a_remote_draft_is_plain_decoding(
    remote_engine: tuple[TorchEngine, DraftServer],
) -> None:
    engine, server = remote_engine
    connected(link_of(engine))
    params = [
        request(PROMPTS[0], temperature=0.0, max_tokens=20, speculative=True),
        request(PROMPTS[1], temperature=0.0, max_tokens=8, speculative=False),
        request(PROMPTS[2], temperature=0.0, max_tokens=14, speculative=True),
    ]
    reference = plain_references(engine, params)
    before = dataclasses.replace(speculation(engine).counters)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 0, 0])  # prefilled together: drafts from step 1
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    counters = speculation(engine).counters
    drafted = counters.drafted_tokens - before.drafted_tokens
    accepted = counters.accepted_tokens - before.accepted_tokens
    assert counters.verify_rounds - before.verify_rounds >= 5
    assert 0 < accepted < drafted
    # The finished requests are forgotten with the next message.
    link = link_of(engine)
    assert link.propose([DraftRequest("z", [5, 6], 1)])[0].tokens
    assert server.source.cache.occupied == 1
    link.forget("z")


def test_seeded_sampling_through_a_remote_draft_is_plain_decodings_draw(
    remote_engine: tuple[TorchEngine, DraftServer],
) -> None:
    """A remote draft is a point mass (greedy tokens): the rejection rule draws each row's
    token with plain decoding's key and keeps the draft token iff they agree,
    so one seed gives plain decoding's very output, twice alike. The draft's tokens are
    drawn ~3 % of the time here, so seeds are tried in turn (each checked) until one had a
    draft token accepted.
    """
    engine, _server = remote_engine
    connected(link_of(engine))
    before = dataclasses.replace(speculation(engine).counters)
    for seed in range(5, 21):
        params = request(PROMPTS[2], temperature=0.9, top_k=40, seed=seed, max_tokens=20,
                         speculative=True, frequency_penalty=0.4)  # fmt: skip
        (reference,) = plain_references(engine, [params]).values()
        outputs = []
        for attempt in range(2):
            engine.clear_prefix_cache()
            state = engine.build_request(params, None, f"s{seed}-{attempt}")
            run(engine, [state], [0])
            outputs.append(state.prompt_ids + state.generated_ids)
        assert outputs == [reference, reference], seed
        if speculation(engine).counters.accepted_tokens > before.accepted_tokens:
            break
    counters = speculation(engine).counters
    assert counters.verify_rounds > before.verify_rounds
    assert counters.accepted_tokens > before.accepted_tokens


def test_a_killed_server_leaves_decoding_plain_and_a_restarted_one_drafts_again(
    remote_engine: tuple[TorchEngine, DraftServer],
) -> None:
    engine, server = remote_engine
    link = connected(link_of(engine))
    link.reconnect_seconds = 0.1
    params = request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True)
    (reference,) = plain_references(engine, [params]).values()
    state = engine.build_request(params, None, "k0")
    engine.scheduler.add(state)
    for _ in range(3):
        engine.step()
    assert link.counters.round_trips > 0
    port, losses = server.port, link.counters.losses
    server.close()  # the draft node goes away mid-request
    started = time.monotonic()
    finish(engine)
    assert time.monotonic() - started < 30  # no step waits on the dead server for long
    assert state.prompt_ids + state.generated_ids == reference
    assert link.counters.losses == losses + 1
    restarted = DraftServer(
        server.source, server.fingerprint, port, None, INSTANCE, host="127.0.0.1"
    )
    restarted.start()
    try:
        assert link.wait_connected(CONNECT_WAIT)
        before = dataclasses.replace(speculation(engine).counters)
        state = engine.build_request(params, None, "k1")
        run(engine, [state], [0])
        assert state.prompt_ids + state.generated_ids == reference
        assert speculation(engine).counters.accepted_tokens > before.accepted_tokens
        assert restarted.counters.round_trips > 0
    finally:
        restarted.close()


# --- loss, stalls, strangers, refusals ------------------------------------------------------


class Stalling:
    """A draft source that takes `seconds` per proposal (a stalled draft node)."""

    name = "stalling"
    vocab_size = 10
    free_slots = 4
    positions_computed = 0
    forward_passes = 0
    prefill_chunk: int | None = None

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def holds(self, request_id: str) -> bool:
        return False

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        time.sleep(self.seconds)
        return [Draft((1, 2)) for _ in requests]

    def forget(self, request_id: str) -> None:
        pass


def test_a_stalled_server_costs_one_round_trip_bound_then_no_drafts() -> None:
    source: Any = Stalling(1.5)
    stalled = DraftServer(source, "00" * 32, 0, None, INSTANCE, host="127.0.0.1")
    stalled.start()
    remote = connected(client(stalled.port, "00" * 32, 10, round_trip_seconds=0.3,
                              reconnect_seconds=60.0))  # fmt: skip
    try:
        started = time.monotonic()
        assert remote.propose([DraftRequest("r", [1, 2, 3], 2)]) == [NO_DRAFT]
        assert time.monotonic() - started < 1.2
        assert remote.counters.losses == 1 and not remote.connected
        started = time.monotonic()  # lost: no waiting at all until it reconnects
        assert remote.propose([DraftRequest("r", [1, 2, 3], 2)]) == [NO_DRAFT]
        assert time.monotonic() - started < 0.1
    finally:
        remote.close()
        stalled.close()


def test_the_right_secret_drafts_a_wrong_one_gets_nothing_and_strangers_stop_nobody(
    sources: tuple[DraftModelSource, DraftModelSource, str],
) -> None:
    served, local, fingerprint = sources
    key = GroupCredentials(b"k" * 32, INSTANCE)
    secured = DraftServer(served, fingerprint, 0, key, INSTANCE, host="127.0.0.1")
    secured.start()
    strangers = [socket.create_connection(("127.0.0.1", secured.port)) for _ in range(2)]
    strangers[0].sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" * 4)  # the other sends nothing
    errors: list[str] = []
    sink = logger.add(lambda message: errors.append(str(message)), level="ERROR")
    wrong_key = GroupCredentials(b"w" * 32, INSTANCE)
    # Retried every 0.1 s here: its refusal is still logged once.
    wrong = client(secured.port, fingerprint, local.vocab_size, wrong_key,
                   refused_retry_seconds=0.1, reconnect_seconds=0.1)  # fmt: skip
    right = client(secured.port, fingerprint, local.vocab_size, key)
    try:
        assert connected(right).propose([DraftRequest("r", [5, 17, 29], 2)]) == [
            local.propose([DraftRequest("r", [5, 17, 29], 2)])[0]
        ]
        assert not wrong.wait_connected(1.0)
        assert wrong.propose([DraftRequest("r", [5, 17, 29], 2)]) == [NO_DRAFT]
        assert secured.refusals >= 4  # the wrong key's tries and the HTTP stranger
        assert right.propose([DraftRequest("r", [5, 17, 29, 4], 2)])[0].tokens
        assert len([error for error in errors if "refused this target" in error]) == 1
    finally:
        logger.remove(sink)
        for stranger in strangers:
            stranger.close()
        wrong.close()
        right.close()
        secured.close()
        local.forget("r")


def test_another_vocabulary_or_instance_is_refused_and_a_new_connection_replaces_the_old(
    server: DraftServer, sources: tuple[DraftModelSource, DraftModelSource, str]
) -> None:
    served, local, fingerprint = sources
    other_vocabulary = client(server.port, "ab" * 32, local.vocab_size)
    stray = RemoteDraftSource(
        RemoteDraft("127.0.0.1", server.port, "draft", None, instance_id="another-instance"),
        fingerprint,
        local.vocab_size,
    )
    first = connected(client(server.port, fingerprint, local.vocab_size, reconnect_seconds=60.0))
    try:
        assert not other_vocabulary.wait_connected(1.0) and not stray.wait_connected(0.1)
        assert other_vocabulary.propose([DraftRequest("r", [5, 6], 2)]) == [NO_DRAFT]
        assert first.propose([DraftRequest("r", [5, 17, 29], 2)])[0].tokens
        assert served.cache.occupied == 1
        second = connected(client(server.port, fingerprint, local.vocab_size))
        try:
            deadline = time.monotonic() + CONNECT_WAIT
            while served.cache.occupied and time.monotonic() < deadline:
                time.sleep(0.01)  # the server installs the new connection on its thread
            assert served.cache.occupied == 0  # it forgot the old connection's requests
            assert first.propose([DraftRequest("r", [5, 17, 29, 4], 2)]) == [NO_DRAFT]
            assert second.propose([DraftRequest("q", [5, 17, 29], 2)])[0].tokens
        finally:
            second.close()
    finally:
        for source in (other_vocabulary, stray, first):
            source.close()
    assert server.refusals >= 2


# --- a server in another process, killed -------------------------------------------------


def serve_in_process(directory: Path, port: int, ready: Any) -> None:
    """A spawned draft runner: a draft server on `port` until killed."""
    server = load_draft_server(directory, port, None, INSTANCE, 4, torch.float32, "float32")
    server.start()
    ready.set()
    while True:
        time.sleep(1)


def spawn_server(directory: Path, port: int) -> Any:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=serve_in_process, args=(directory, port, ready), daemon=True)
    process.start()
    if not ready.wait(60):
        process.kill()
        pytest.fail("the draft server process did not start within 60 s")
    return process


@pytest.mark.slow  # two spawned server processes: about 25 s on a busy 2-core machine
def test_a_draft_process_killed_mid_request_then_restarted(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    """The draft runner's process is SIGKILLed mid-request: the target finishes with plain
    decoding's text; a new process on the port is reconnected to and drafts again."""
    port = free_port()
    process = spawn_server(model_dirs["draft"], port)
    remote = RemoteDraft("127.0.0.1", port, "draft", None, instance_id=INSTANCE)
    engine = load(model_dirs["target"], remote_draft=remote)
    link = connected(link_of(engine))
    link.reconnect_seconds = 0.1
    try:
        params = request(PROMPTS[0], temperature=0.0, max_tokens=20, speculative=True)
        (reference,) = plain_references(engine, [params]).values()
        state = engine.build_request(params, None, "k0")
        engine.scheduler.add(state)
        for _ in range(3):
            engine.step()
        assert link.counters.round_trips > 0
        os.kill(process.pid, signal.SIGKILL)
        process.join(10)
        finish(engine)
        assert state.prompt_ids + state.generated_ids == reference
        assert link.counters.losses == 1
        process = spawn_server(model_dirs["draft"], port)
        assert link.wait_connected(CONNECT_WAIT)
        before = dataclasses.replace(speculation(engine).counters)
        state = engine.build_request(params, None, "k1")
        run(engine, [state], [0])
        assert state.prompt_ids + state.generated_ids == reference
        assert speculation(engine).counters.accepted_tokens > before.accepted_tokens
    finally:
        engine.shutdown()
        process.kill()
        process.join(10)


def test_the_runners_loading_path_drafts_through_the_link_instead_of_loading_a_draft(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    """`load_serving_engine(remote_draft=...)`: rank 0 drafts through a `RemoteDraftSource`
    (named by the draft's id) and loads no draft model, even where one is also named;
    `shutdown` closes the link. Its link opens in the background: no server is needed to
    load."""
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine_factory import load_serving_engine

    card = card_from_local_directory(model_dirs["target"])
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    remote = RemoteDraft("127.0.0.1", free_port(), "the-draft", None, instance_id=INSTANCE)
    engine = load_serving_engine(
        model_dirs["target"], shard, draft_model=str(model_dirs["draft"]), remote_draft=remote
    )
    assert isinstance(engine, TorchEngine)
    link = engine.draft_source
    assert isinstance(link, RemoteDraftSource) and link.name == "the-draft"
    assert link.propose([DraftRequest("r", [1, 2, 3], 2)]) == [NO_DRAFT]  # nobody there
    engine.shutdown()
    assert not link._connector.is_alive()


def test_a_taken_port_is_an_error_at_start(
    server: DraftServer, sources: tuple[DraftModelSource, DraftModelSource, str]
) -> None:
    served, _local, fingerprint = sources
    second = DraftServer(served, fingerprint, server.port, None, INSTANCE, host="127.0.0.1")
    with pytest.raises(OSError):
        second.start()
    second.close()  # nothing started: closing is still safe


def test_a_slow_draft_prefills_in_chunks_that_fit_the_round_trips_bound() -> None:
    """A round's draft prefill is sized to a quarter of the client's 2 s bound at the
    measured cost per position, within [16, 512] positions."""
    assert prefill_chunk(None) == DRAFT_PREFILL_CHUNK == 512
    assert prefill_chunk(1e-4) == 512  # a fast draft: the whole chunk
    assert prefill_chunk(0.005) == 100  # 0.5 s at 5 ms a position
    assert prefill_chunk(1.0) == 16  # never below: a catch-up still advances


def test_a_handshake_closed_unread_is_a_lost_link_retried_soon_not_a_refusal() -> None:
    # A draft server over its cap of pending openings (strangers holding silent connections)
    # closes the next ones unread: that proves nothing about the secret. It was taken for a
    # refusal: an ERROR "refused this target" and a 30 s back-off, drafts gone past the flood.
    key = GroupCredentials(b"k" * 32, INSTANCE)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    closed: list[int] = []

    def close_unread() -> None:
        while len(closed) < 3:
            connection, _address = listener.accept()
            connection.close()
            closed.append(1)

    closer = threading.Thread(target=close_unread, daemon=True)
    closer.start()
    try:
        with pytest.raises(DraftLinkError) as raised:
            open_client("127.0.0.1", port, key, INSTANCE, b"\0" * 32, 64)
        assert not isinstance(raised.value, DraftRefusedError)
        errors: list[str] = []
        sink = logger.add(lambda message: errors.append(str(message)), level="ERROR")
        busy = client(port, "00" * 32, 64, key, reconnect_seconds=0.1, refused_retry_seconds=60)
        try:
            deadline = time.monotonic() + 10
            while len(closed) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            # Tried again at the reconnect pace (a refusal waits 60 s here), logged no error.
            assert len(closed) == 3
            assert errors == []
        finally:
            logger.remove(sink)
            busy.close()
    finally:
        listener.close()
        closer.join(5)
