"""KV prefix cache: the keys and values of finished requests, reused by later requests that
start with the same tokens (the next turn of a conversation, a shared system prompt, a tool
loop), evicted least recently used first.

Each entry is one finished sequence (prompt and generated tokens that have KV) with a copy
of its KV `[layers, 2, kv_heads, length, head_dim]`. Entries are found by hashes of their
token blocks (`BLOCK_TOKENS` tokens each), chained so that a block's hash stands for every
token before it too (the scheme of vLLM's automatic prefix caching): a lookup hashes the
prompt block by block and stops at the first block no entry has, so it costs one dictionary
probe per block of the prompt's shared part, whatever the number of entries, and then
compares at most one block of tokens per entry that shares all those blocks. The match is
checked token by token, so a hash collision can never hand out another sequence's KV. An
entry that is a prefix of a newly stored one is dropped (the new one covers it) unless the
new one cannot serve some of its hits (below).

Sliding-window layers: an entry's KV is its slot's as the slot held it, its windowed layers
trimmed to their windows (`kv_footprint`), so a hit of `h` tokens is refused where a
windowed layer no longer holds the keys position `h` attends to (`PrefixEntry.first_hit`):
entries that kept their windowed layers whole would hold every position of every layer,
the memory trimming saves (on Gemma 3, 15 of 18 layers), for the sake of hits ending more
than `kv_footprint.TRIM_SLACK` tokens before a cached sequence's end; the next turn of a
conversation, which extends the cached sequence, still hits. Entries cost their held
positions in the budget (`cost`).

Layout: per-request slots (`slot_kv_cache`) and copies, not paged blocks shared in place: a
hit copies the shared positions into the request's slot (one memory copy per layer, where
recomputing them is a prefill of those positions through every layer), and the native
decode kernels read one contiguous row per request.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# Tokens per hashed block. Smaller blocks find a shared prefix more exactly without the
# final comparison (which covers the last partial block anyway) but cost more probes.
BLOCK_TOKENS = 16


def block_hashes(token_ids: list[int], limit: int | None = None) -> list[int]:
    """Chained hashes of the full `BLOCK_TOKENS` blocks of `token_ids[:limit]`: hash `i`
    depends on blocks `0 .. i`, so equal hashes mean (barring a collision, which callers
    check) equal prefixes of `(i + 1) * BLOCK_TOKENS` tokens."""
    end = len(token_ids) if limit is None else min(limit, len(token_ids))
    hashes: list[int] = []
    previous = 0
    for start in range(0, end - BLOCK_TOKENS + 1, BLOCK_TOKENS):
        previous = hash((previous, *token_ids[start : start + BLOCK_TOKENS]))
        hashes.append(previous)
    return hashes


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """One cached sequence: `tokens` `[length]` int64, `kv` `[layers, 2, kv_heads, length,
    head_dim]`, the chained hashes of its full blocks, the length its windowed layers were
    trimmed at (`reached`), the shortest hit it can serve (`first_hit`, 0: any) and its
    budget tokens (`cost`)."""

    tokens: torch.Tensor
    kv: torch.Tensor
    hashes: tuple[int, ...] = field(default=())
    reached: int = 0
    first_hit: int = 0
    cost: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a prompt: its `length` in tokens, the KV of the entry
    holding it (positions `0 .. length - 1` are the shared ones) and the entry's `key`
    (`PrefixCache.insert`'s)."""

    length: int
    kv: torch.Tensor
    key: int = -1
    reached: int = 0  # the entry's trim (`SlotKVCache.write`)


def _common_length(entry: PrefixEntry, query: torch.Tensor, start: int) -> int:
    """Length of the common prefix of `entry.tokens` and `query`, given that the first
    `start` tokens are known equal and that they differ within the next `BLOCK_TOKENS`
    (no entry shares the query's next block: `PrefixCache._candidates`)."""
    common = min(entry.length, int(query.shape[0]), start + BLOCK_TOKENS)
    if common <= start:
        return common
    differs = entry.tokens[start:common] != query[start:common]
    return start + int(differs.to(torch.int8).argmax().item()) if differs.any() else common


class PrefixCache:
    """Finished sequences' KV, least recently used evicted first.

    Args:
        capacity_tokens: most tokens held over all entries (0 disables the cache).
        on_remove: called with an entry's key when it leaves the cache (evicted, or covered
            by a longer entry): a split instance's rank 0 tells the other ranks
            (`parallel/cache_ops.py`).
        cost: an entry's budget tokens from its (length, reached) (None: its length;
            `KVFootprint.entry_tokens`).
    """

    def __init__(
        self,
        capacity_tokens: int,
        on_remove: Callable[[int], None] | None = None,
        cost: Callable[[int, int], int] | None = None,
    ) -> None:
        self.capacity_tokens = capacity_tokens
        self._on_remove = on_remove
        self.cost = cost
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        # Chained block hash -> keys of the entries whose tokens start with those blocks.
        self._by_block: dict[int, set[int]] = {}
        # Keys of entries shorter than one block (no hash finds them).
        self._short: set[int] = set()
        self._next_key = 0
        self.tokens = 0  # budget tokens held over all entries (`cost`)

    def __len__(self) -> int:
        return len(self._entries)

    def _candidates(self, hashes: list[int]) -> tuple[int, set[int]]:
        """How many leading blocks of `hashes` some entry shares (`blocks`), and the keys of
        the entries sharing that many (every entry when none shares a block)."""
        blocks, keys = 0, set(self._entries)
        for index, block_hash in enumerate(hashes):
            sharing = self._by_block.get(block_hash)
            if not sharing:
                break
            blocks, keys = index + 1, sharing
        return blocks, keys

    def lookup(self, token_ids: list[int], limit: int) -> PrefixMatch | None:
        """The longest cached prefix of `token_ids`, at most `limit` tokens (a request keeps
        at least its last prompt token to compute, for the logits of its first token), from
        an entry that can serve it (`PrefixEntry.first_hit`). A hit makes its entry the most
        recently used."""
        if not self._entries or limit < 1:
            return None
        query = torch.tensor(token_ids[:limit], dtype=torch.long)
        blocks, keys = self._candidates(block_hashes(token_ids, limit))
        shared = blocks * BLOCK_TOKENS
        best_key, best_length = -1, 0
        for key in sorted(keys):  # deterministic among equal matches
            entry = self._entries[key]
            if shared and not torch.equal(entry.tokens[:shared], query[:shared]):
                continue  # a hash collision: not the same blocks after all
            length = _common_length(entry, query, shared)
            if length < entry.first_hit:
                continue  # its windowed layers dropped keys this prefix would need
            if length > best_length:
                best_key, best_length = key, length
        if best_length == 0:
            return None
        self._entries.move_to_end(best_key)
        best = self._entries[best_key]
        return PrefixMatch(best_length, best.kv, best_key, best.reached)

    def insert(
        self,
        token_ids: list[int],
        kv: torch.Tensor,
        reached: int | None = None,
        first_hit: int = 0,
    ) -> int | None:
        """Store a finished sequence (`kv` as `PrefixEntry.kv`, owned by the cache from
        now on; its windowed layers trimmed at `reached`, None: its length, serving hits
        of `first_hit` tokens and more); entries it extends are dropped where it serves
        every hit they could, then the least recently used are evicted down to
        `capacity_tokens`. A sequence costing more than the capacity is not stored.

        Returns:
            The new entry's key (keys count up from 0, never reused), or None when the
            sequence was not stored.
        """
        length = len(token_ids)
        reached = length if reached is None else max(length, reached)
        cost = length if self.cost is None else self.cost(length, reached)
        if length == 0 or cost > self.capacity_tokens:
            return None
        tokens = torch.tensor(token_ids, dtype=torch.long)
        hashes = block_hashes(token_ids)
        # An entry this one extends shares every full block of its own: it is among the
        # entries under one of this sequence's block hashes, or a short one.
        maybe_covered = set(self._short)
        for block_hash in hashes:
            maybe_covered |= self._by_block.get(block_hash, set())
        for key in sorted(maybe_covered):
            entry = self._entries[key]
            if (
                entry.length <= length
                and first_hit <= entry.first_hit
                and torch.equal(entry.tokens, tokens[: entry.length])
            ):
                self._remove(key)
        key = self._next_key
        self._next_key += 1
        self._entries[key] = PrefixEntry(tokens, kv, tuple(hashes), reached, first_hit, cost)
        for block_hash in hashes:
            self._by_block.setdefault(block_hash, set()).add(key)
        if not hashes:
            self._short.add(key)
        self.tokens += cost
        self.evict(self.capacity_tokens)
        return key

    def evict(self, keep_tokens: int) -> int:
        """Evict least recently used entries until at most `keep_tokens` tokens are held.

        Returns:
            Tokens freed.
        """
        freed = 0
        while self.tokens > keep_tokens and self._entries:
            key = next(iter(self._entries))
            freed += self._entries[key].cost
            self._remove(key)
        return freed

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        for block_hash in entry.hashes:
            sharing = self._by_block[block_hash]
            sharing.discard(key)
            if not sharing:
                del self._by_block[block_hash]
        self._short.discard(key)
        self.tokens -= entry.cost
        if self._on_remove is not None:
            self._on_remove(key)
