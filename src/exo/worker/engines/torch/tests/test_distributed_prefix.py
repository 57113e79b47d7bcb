"""The prefix cache on split instances: rank 0's decisions (stores, evictions, a hit's copy
into a slot) replayed on another rank, checked without processes; and `conversation`, the
turns that `test_distributed_features` runs on 2-rank pipeline and tensor groups (in the
groups it starts anyway) to check that a second turn sharing a long prefix gets a hit with
the single process's cached count and the cold answer's greedy tokens."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.parallel.cache_ops import (
    CacheOpLog,
    PrefixMirror,
    RecordingPrefixCache,
    RecordingSlotKVCache,
    replay_cache_ops,
)

MODES = ("pipeline", "tensor")
FIRST_PROMPT = "Describe the colours of the rainbow, one by one, and say where each is from. " * 5
FOLLOW_UP = "Now say it again in one short sentence."

# Per turn: (tokens, cached tokens); per mode: first turn, warm second turn, cold second turn.
Turn = tuple[list[int], int]


def _first() -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"),
        messages=(ChatMessage(role="user", content=FIRST_PROMPT),),
        temperature=0.0,
        max_tokens=8,
    )


def _run(engine: TorchEngine, params: TextGenerationTaskParams) -> tuple[Turn, str]:
    pieces = list(engine.generate(params))
    usage = pieces[-1].usage
    assert usage is not None
    tokens = [token for piece in pieces for token in piece.token_ids]
    return (tokens, usage.cached_tokens), "".join(piece.text for piece in pieces)


def conversation(engine: TorchEngine) -> list[Turn]:
    """The first turn, the second turn (warm: its prefix cached), then the second turn again
    after the cache is cleared (cold); the cache is cleared first (the warm-up's prompt
    shares the chat template's opening)."""
    engine.clear_prefix_cache()
    first = _first()
    first_turn, answer = _run(engine, first)
    messages = (
        *first.messages,
        ChatMessage(role="assistant", content=answer),
        ChatMessage(role="user", content=FOLLOW_UP),
    )
    second = first.model_copy(update={"messages": messages, "max_tokens": 10})
    warm, _ = _run(engine, second)
    engine.clear_prefix_cache()
    cold, _ = _run(engine, second)
    return [first_turn, warm, cold]


def _filled_slots(cache: SlotKVCache, seed: int) -> None:
    """Random KV in every occupied slot's positions (as a forward pass would write)."""
    generator = torch.Generator().manual_seed(seed)
    for tensors in (cache.keys, cache.values):
        for layer in tensors:
            layer.copy_(torch.randn(layer.shape, generator=generator))


def test_another_rank_replays_rank_zeros_prefix_decisions() -> None:
    """Rank 0 stores three sequences in a cache that holds two (one evicted), then admits a
    request whose hit's entry it evicts to make room and still copies (the drop and the
    copy in one step's operations): the other rank's mirror and slots follow."""
    log = CacheOpLog()
    geometry = (2, 1, 4, torch.float32, torch.device("cpu"), 2)
    rank_zero = RecordingSlotKVCache(*geometry, log=log)
    prefix = RecordingPrefixCache(40, log)
    rank_zero.prefix = prefix
    other = SlotKVCache(*geometry)
    mirror = PrefixMirror()

    def replay() -> None:
        replay_cache_ops(other, log.take(), mirror)

    sequences = [list(range(100 * index, 100 * index + 20)) for index in range(3)]
    for index, tokens in enumerate(sequences):
        slot = rank_zero.allocate()
        replay()
        _filled_slots(rank_zero, index)
        _filled_slots(other, index)
        rank_zero.lengths[slot] = other.lengths[slot] = len(tokens)
        prefix.insert(tokens, rank_zero.read(slot, len(tokens)))
        rank_zero.free(slot)
        replay()
        assert sorted(mirror.entries) == sorted(prefix._entries)  # sequence 0 evicted
        assert mirror.tokens == prefix.tokens
    assert len(mirror.entries) == 2
    # A hit on sequence 1, whose entry is then evicted to make room, and copied anyway.
    match = prefix.lookup(sequences[1] + [7, 7], limit=21)
    assert match is not None and match.length == 20
    prefix.evict(0)
    slot = rank_zero.allocate()
    rank_zero.write(slot, match.kv, match.length)
    replay()
    assert mirror.entries == {}
    for mine, theirs in ((rank_zero.keys, other.keys), (rank_zero.values, other.values)):
        for layer_zero, layer_other in zip(mine, theirs, strict=True):
            assert torch.equal(layer_zero[slot, :, :20], layer_other[slot, :, :20])
    with pytest.raises(RuntimeError, match="prefix hit"):
        rank_zero.write(slot, torch.zeros_like(match.kv), 20)


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
