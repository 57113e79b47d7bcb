"""The prefix cache's block-hash index finds what a full scan finds: the longest common
prefix, within the limit, of every stored sequence, across inserts, covering and eviction."""

from __future__ import annotations

import random

import torch

from exo.worker.engines.torch.batching.prefix_cache import (
    BLOCK_TOKENS,
    PrefixCache,
    block_hashes,
)


def kv_for(token_ids: list[int]) -> torch.Tensor:
    """A KV copy that names its sequence: `[1, 2, 1, length, 1]` holding the tokens."""
    values = torch.tensor(token_ids, dtype=torch.float32)
    return torch.stack([values, values]).reshape(1, 2, 1, len(token_ids), 1)


def common(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        length += 1
    return length


def test_hashes_are_chained_over_full_blocks() -> None:
    tokens = list(range(3 * BLOCK_TOKENS + 5))
    hashes = block_hashes(tokens)
    assert len(hashes) == 3
    assert block_hashes(tokens, limit=2 * BLOCK_TOKENS + 1) == hashes[:2]
    changed = [99, *tokens[1:]]  # the first token differs: every later block hash too
    assert all(a != b for a, b in zip(block_hashes(changed), hashes, strict=True))


def test_a_hit_returns_the_shared_positions_of_the_longest_entry() -> None:
    cache = PrefixCache(10_000)
    system = list(range(100, 100 + 3 * BLOCK_TOKENS + 7))  # a shared system prompt
    first = [*system, 1, 2, 3]
    second = [*system, 4, 5, 6, 7, 8]
    cache.insert(first, kv_for(first))
    cache.insert(second, kv_for(second))
    match = cache.lookup([*system, 4, 5, 9], limit=100)
    assert match is not None and match.length == len(system) + 2
    assert match.kv[0, 0, 0, : match.length, 0].tolist() == second[: match.length]
    # The limit caps the match (a request keeps its last prompt token to compute).
    limited = cache.lookup(second, limit=len(second) - 1)
    assert limited is not None and limited.length == len(second) - 1
    assert cache.lookup([7, 7, 7], limit=3) is None


def test_an_entry_the_new_one_extends_is_dropped_and_eviction_is_lru() -> None:
    cache = PrefixCache(4 * BLOCK_TOKENS)
    turn = list(range(BLOCK_TOKENS + 3))
    cache.insert(turn, kv_for(turn))
    longer = [*turn, 50, 51]
    cache.insert(longer, kv_for(longer))
    assert len(cache) == 1 and cache.tokens == len(longer)
    other = list(range(200, 200 + 3 * BLOCK_TOKENS))
    cache.insert(other, kv_for(other))  # over capacity: the least recently used goes
    assert len(cache) == 1 and cache.lookup(turn, limit=len(turn)) is None
    assert cache.tokens == len(other)
    assert cache.evict(0) == len(other) and len(cache) == 0 and cache.tokens == 0


def test_the_index_finds_what_a_full_scan_finds() -> None:
    """Seeded random conversations over a small vocabulary (many near-collisions of
    prefixes): every lookup equals the brute-force longest common prefix."""
    rng = random.Random(1234)
    cache = PrefixCache(3_000)
    stored: list[list[int]] = []
    roots = [[rng.randrange(4) for _ in range(rng.randrange(0, 40))] for _ in range(5)]
    for _ in range(300):
        root = rng.choice(roots)
        sequence = root + [rng.randrange(4) for _ in range(rng.randrange(1, 60))]
        if rng.random() < 0.5:
            limit = rng.randrange(1, len(sequence) + 1)
            live = [s for s in stored if cache_holds(cache, s)]
            expected = max((min(common(s, sequence), limit) for s in live), default=0)
            match = cache.lookup(sequence, limit)
            assert (0 if match is None else match.length) == expected
            if match is not None:
                assert match.kv[0, 0, 0, : match.length, 0].tolist() == sequence[: match.length]
        else:
            cache.insert(sequence, kv_for(sequence))
            stored.append(sequence)
        assert cache.tokens <= 3_000


def cache_holds(cache: PrefixCache, sequence: list[int]) -> bool:
    """Whether an entry of `cache` starts with `sequence` (it or a longer one covering it)."""
    return any(
        entry.length >= len(sequence) and entry.tokens[: len(sequence)].tolist() == sequence
        for entry in cache._entries.values()
    )
