"""Sliding-window layers keep only their window: their slots release what the window no
longer sees, the output is the untrimmed output, a prefix hit longer than the window
answers as cold, split ranks trim alike, and the KV budget fits more tokens."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import psutil
import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.kv_cache_memory import longest_length_in_kv_budget
from exo.shared.types.common import ModelId
from exo.shared.types.models import SlidingWindow
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch import engine_scheduler
from exo.worker.engines.torch.batching.kv_footprint import (
    TRIM_CHUNK,
    TRIM_SLACK,
    KVFootprint,
    first_hit_length,
    held_start,
)
from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV
from exo.worker.engines.torch.batching.prefix_cache import PrefixCache
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.sampling import TokenChooser
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_requests import PromptTooLongError
from exo.worker.engines.torch.parallel.cache_ops import (
    CacheOpLog,
    PrefixMirror,
    RecordingPrefixCache,
    RecordingSlotKVCache,
    replay_cache_ops,
)
from exo.worker.engines.torch.tests.test_batching import RecordingChooser, run_batch

CPU = torch.device("cpu")
MIB = 2**20
WINDOW = 16
# Held at most by a windowed layer of a running sequence.
MOST_HELD = WINDOW + TRIM_SLACK + TRIM_CHUNK - 1


@pytest.fixture(scope="module", autouse=True)
def float32_kv() -> Iterator[None]:
    """float32 KV: trimmed and untrimmed runs are compared token for token."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KV_CACHE_DTYPE_ENV, "float32")
        yield


def _filled(cache: SlotKVCache, slot: int, start: int, end: int) -> None:
    """Positions `start .. end - 1` of `slot` hold `position + 1` (every layer, K and V)."""
    values = torch.arange(start + 1, end + 1, dtype=cache.keys[0].dtype)[None, :, None]
    for tensors in (cache.keys, cache.values):
        for layer in tensors:
            layer[slot, :, start:end] = values
    cache.commit(slot, end)


def _check_slot(cache: SlotKVCache, slot: int) -> None:
    """Each layer of `slot` holds `position + 1` from where it holds positions, zeros
    before (released) and after."""
    length = cache.lengths[slot]
    for index, (keys, values) in enumerate(zip(cache.keys, cache.values, strict=True)):
        start = cache.held_from(slot, index)
        expected = torch.zeros(keys.shape[2])
        expected[start:length] = torch.arange(start + 1, length + 1, dtype=torch.float32)
        for layer in (keys, values):
            assert torch.equal(layer[slot, 0, :, 0], expected), (index, start, length)


def test_windowed_layers_hold_their_window_through_moves_growth_and_copies() -> None:
    windows = (WINDOW, None, WINDOW)
    cache = SlotKVCache(3, 1, 4, torch.float32, CPU, slots=3, windows=windows)
    first, second = cache.allocate(), cache.allocate()
    for end in range(50, 1_001, 50):  # grows past the initial capacity (256) too
        cache.reserve(end)
        _filled(cache, first, end - 50, end)
        _check_slot(cache, first)
        held = cache.held_positions(first)
        assert held[1] == end and held[0] == held[2] <= min(end, MOST_HELD)
    assert cache.held_from(first, 0) == held_start(1_000, WINDOW) > 0
    _filled(cache, second, 0, 100)
    kv = cache.read(first, 1_000)
    start = held_start(1_000, WINDOW)
    assert torch.count_nonzero(kv[0, :, :, :start]) == 0 and torch.all(kv[0, :, :, start:] > 0)
    assert torch.all(kv[1] > 0)
    # The first slot freed: the second moves into it, keeping none of the first's positions.
    assert cache.free(first) == second and cache.lengths[first] == 100
    _check_slot(cache, first)
    third = cache.allocate()
    cache.write(third, kv, 1_000, reached=1_000)  # a hit copied with the entry's trim
    _check_slot(cache, third)
    cache.reserve(1_100)
    _filled(cache, third, 1_000, 1_100)
    _check_slot(cache, third)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_a_windowed_layers_memory_stays_bounded_as_the_sequence_grows() -> None:
    # A windowed and a full layer, one KV head of 64 float32: 256 B a position each of K, V.
    cache = SlotKVCache(2, 1, 64, torch.float32, CPU, slots=1, windows=(512, None))
    cache.reserve(32_768)
    slot = cache.allocate()
    before = psutil.Process().memory_info().rss
    for end in range(1_024, 32_769, 1_024):
        _filled(cache, slot, end - 1_024, end)
    grown = psutil.Process().memory_info().rss - before
    # The full layer holds 16 MiB (32,768 x 512 B); untrimmed, the windowed one would too.
    assert 15 * MIB < grown < 22 * MIB, grown / MIB
    assert cache.held_positions(slot)[0] <= 512 + TRIM_SLACK + TRIM_CHUNK


def test_the_budget_counts_windowed_layers_at_their_window() -> None:
    # Gemma 3's pattern: five windowed layers, then a full one.
    footprint = KVFootprint((WINDOW,) * 5 + (None,))
    assert footprint.tokens(10) == 10  # shorter than the window: every layer whole
    assert footprint.tokens(6_000) == -(-(6_000 + 5 * MOST_HELD) // 6)
    longest = footprint.longest(1_000)
    assert footprint.tokens(longest) <= 1_000 < footprint.tokens(longest + 1)
    assert longest == 6_000 - 5 * MOST_HELD  # ~6x the tokens of a model without windows
    assert KVFootprint((None, None)).longest(1_000) == 1_000
    # An entry trimmed at 1,000 serves hits from the first one whose keys it holds.
    shortest = first_hit_length(1_000, (WINDOW, None))
    assert shortest == held_start(1_000, WINDOW) + WINDOW - 1
    assert first_hit_length(100, (WINDOW, None)) == 0  # nothing released yet
    cache = PrefixCache(10_000, cost=footprint.entry_tokens)
    tokens = list(range(1_000))
    cache.insert(tokens, torch.zeros(6, 2, 1, 1_000, 1), reached=1_000, first_hit=shortest)
    assert cache.tokens == footprint.entry_tokens(1_000, 1_000) < 1_000
    assert cache.lookup([*tokens[:600], -1], limit=601) is None  # needs released keys
    match = cache.lookup([*tokens, 5], limit=1_000)
    assert match is not None and match.length == 1_000 and match.reached == 1_000


def test_another_rank_trims_and_copies_as_rank_zero_does() -> None:
    log = CacheOpLog()
    geometry = (2, 1, 4, torch.float32, CPU, 2, 0, (WINDOW, None))
    rank_zero = RecordingSlotKVCache(*geometry, log=log)
    prefix = RecordingPrefixCache(10_000, log)
    rank_zero.prefix = prefix
    other = SlotKVCache(*geometry)
    mirror = PrefixMirror()
    slot = rank_zero.allocate()
    replay_cache_ops(other, log.take(), mirror)
    for cache in (rank_zero, other):
        cache.reserve(600)
        _filled(cache, slot, 0, 600)  # every rank commits the same step lengths
    tokens = list(range(600))
    reached = rank_zero.reached[slot]
    key = prefix.insert(
        tokens, rank_zero.read(slot, 600), reached, first_hit_length(reached, (WINDOW,))
    )
    rank_zero.free(slot)
    replay_cache_ops(other, log.take(), mirror)
    assert key is not None and mirror.entries[key][1] == reached == 600
    match = prefix.lookup([*tokens, 1], limit=600)
    assert match is not None
    slot = rank_zero.allocate()
    rank_zero.write(slot, match.kv, match.length, match.reached)
    replay_cache_ops(other, log.take(), mirror)
    for cache in (rank_zero, other):
        _check_slot(cache, slot)
    for mine, theirs in zip(rank_zero.keys, other.keys, strict=True):
        assert torch.equal(mine, theirs)


# --- engines on tiny random models --------------------------------------------------------


def _engine(directory: Path, **options: Any) -> TorchEngine:
    card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, weight_dtype="float32", **options)
    engine.eos_token_ids = frozenset({-1})  # random weights: run every step
    return engine


class _Untrimmed(SlotKVCache):
    """A slot cache that keeps every layer whole (the reference)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args[:7], **{key: kwargs[key] for key in kwargs if key != "windows"})


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    return {
        family: save_tiny_model(
            tmp_path_factory.mktemp(f"swa-{family}"),
            family,
            real_model_dir,
            n_layers=4,
            sliding_window=WINDOW,
            max_position_embeddings=4_096,
        )
        for family in ("gemma3", "gpt_oss")
    }


def _long_request(words: int, tail: str = "", **fields: Any) -> TextGenerationTaskParams:
    text = " ".join(f"w{index % 97}" for index in range(words)) + tail
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=text),),
        temperature=0.0, **fields,
    )  # fmt: skip


def _greedy(
    engine: TorchEngine, params: TextGenerationTaskParams, request_id: str
) -> tuple[RecordingChooser, list[int], int]:
    """The request's logits, tokens and cached count, and the most positions a windowed
    layer of its slot held at any step."""
    state = engine.build_request(params, request_id=request_id)
    recorder = RecordingChooser(state.chooser)
    state.chooser = cast(TokenChooser, recorder)
    cache = engine.scheduler._cache
    windowed = [index for index, window in enumerate(cache.windows) if window is not None]
    most = [0]

    def watch(_step: int) -> None:
        for slot in range(cache.occupied):
            held = cache.held_positions(slot)
            most[0] = max([most[0], *(held[index] for index in windowed)])

    pieces = run_batch(engine, [state], [0], on_step=watch)[request_id]
    usage = pieces[-1].usage
    assert usage is not None
    return recorder, [most[0]], usage.cached_tokens


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
def test_trimmed_windows_give_the_untrimmed_tokens_and_a_long_hit_answers_as_cold(
    model_dirs: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = _long_request(130, max_tokens=16)
    untrimmed_engine = _engine(model_dirs[family])
    with monkeypatch.context() as patch:
        patch.setattr(engine_scheduler, "SlotKVCache", _Untrimmed)
        reference, _, _ = _greedy(untrimmed_engine, first, "reference")
    engine = _engine(model_dirs[family])
    trimmed, most, cached = _greedy(engine, first, "trimmed")
    prompt = len(engine.render_prompt(first).token_ids)
    assert prompt > 20 * WINDOW and cached == 0  # ~400 tokens
    assert trimmed.tokens == reference.tokens
    worst = max(
        float((a - b).abs().max()) for a, b in zip(trimmed.logits, reference.logits, strict=True)
    )
    assert worst < 1e-4
    assert 0 < most[0] <= MOST_HELD  # every step, every windowed layer
    if family != "gemma3":  # the prefix cache's part is the same for every family
        return
    # The next turn: its prefix (the first turn, > 20 windows) comes from the cache.
    answer = engine.tokenizer.decode(trimmed.tokens)
    messages = (
        *first.messages,
        ChatMessage(role="assistant", content=answer),
        ChatMessage(role="user", content="and then"),
    )
    second = first.model_copy(update={"messages": messages, "max_tokens": 8})
    warm, _, warm_cached = _greedy(engine, second, "warm")
    assert warm_cached >= prompt - 1 > 20 * WINDOW
    engine.clear_prefix_cache()
    cold, _, cold_cached = _greedy(engine, second, "cold")
    assert cold_cached == 0 and warm.tokens == cold.tokens
    # A prompt sharing only the first turn's start: the entry no longer holds the windowed
    # keys it would need there, so no hit, and the same answer as cold.
    other = _long_request(60, tail=" different", max_tokens=6)
    refused, _, refused_cached = _greedy(engine, other, "refused")
    engine.clear_prefix_cache()
    other_cold, _, _ = _greedy(engine, other, "other-cold")
    assert refused_cached == 0 and refused.tokens == other_cold.tokens


def test_the_budget_fits_a_prompt_longer_than_its_tokens(model_dirs: dict[str, Path]) -> None:
    engine = _engine(model_dirs["gemma3"], kv_cache_tokens=300)
    params = _long_request(110, max_tokens=4)
    prompt = len(engine.render_prompt(params).token_ids)
    assert prompt > 300 and engine.token_limit > prompt
    # The card says which layers slide (`config.json`'s `layer_types`), and placement and
    # the API count them as the engine does.
    card = card_from_local_directory(model_dirs["gemma3"])
    assert card.sliding_window == SlidingWindow(window=WINDOW, layers=2)
    assert engine.token_limit == longest_length_in_kv_budget(card, 300)
    _recorder, _most, _cached = _greedy(engine, params, "long")
    usage = engine.kv_cache_usage()
    assert usage is not None and 0 < usage[1] <= usage[2] == 300  # the entry fits the budget
    with pytest.raises(PromptTooLongError):  # the same prompt on a model without windows
        untrimmed = _engine(model_dirs["gemma3"], kv_cache_tokens=300)
        untrimmed.scheduler.footprint = KVFootprint((None,) * 4)
        untrimmed.build_request(params)


# --- split instances ------------------------------------------------------------------------

SplitTurns = list[tuple[list[int], int]]


def _conversation(engine: TorchEngine) -> SplitTurns:
    """A first turn several windows long, the next turn (a hit past the window), and the
    next turn again cold: (tokens, cached tokens) of each."""
    engine.clear_prefix_cache()
    first = _long_request(130, max_tokens=8)
    turns: SplitTurns = []
    texts: list[str] = []
    for params in (first, None, None):
        if params is None:
            messages = (
                *first.messages,
                ChatMessage(role="assistant", content=texts[0]),
                ChatMessage(role="user", content="and then"),
            )
            params = first.model_copy(update={"messages": messages})
            if len(turns) == 2:
                engine.clear_prefix_cache()
        pieces = list(engine.generate(params))
        usage = pieces[-1].usage
        assert usage is not None
        turns.append(
            ([token for piece in pieces for token in piece.token_ids], usage.cached_tokens)
        )
        texts.append("".join(piece.text for piece in pieces))
    return turns


def _split_rank(
    rank: int, world_size: int, port: int, results: Any, model_dir: str, mode: str
) -> None:
    import os
    import traceback

    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine
    from exo.worker.engines.torch.tests.test_distributed import make_shard

    os.environ[KV_CACHE_DTYPE_ENV] = "float32"
    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        shard = make_shard(Path(model_dir), mode, rank, world_size)
        engine = load_engine(Path(model_dir), shard, weight_dtype="float32")
        engine.eos_token_ids = frozenset({-1})
        if rank == 0:
            results.put(("turns", rank, _conversation(engine)))
            engine.shutdown()
        else:
            engine.serve_forever()
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_split_ranks_trim_alike_and_a_long_hit_answers_as_the_single_process(
    model_dirs: dict[str, Path], mode: str
) -> None:
    from exo.testing.rank_processes import run_rank_processes
    from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S

    single = _conversation(_engine(model_dirs["gemma3"]))
    (_, first_cached), (warm_tokens, warm_cached), (cold_tokens, cold_cached) = single
    assert first_cached == cold_cached == 0 and warm_cached > 20 * WINDOW
    assert warm_tokens == cold_tokens
    reports = run_rank_processes(
        _split_rank, (str(model_dirs["gemma3"]), mode), 2, GROUP_DEADLINE_S
    )
    [turns] = [value for kind, _rank, value in reports if kind == "turns"]
    assert turns == single
