"""KV prefix cache: the keys and values of finished requests, reused by later requests that
start with the same tokens (the next turn of a conversation, a shared system prompt, a tool
loop), evicted least recently used first.

Each entry is one finished sequence (prompt and generated tokens that have KV) with a copy
of its KV `[layers, 2, kv_heads, length, head_dim]`. A lookup compares the new prompt with
every entry's tokens (one vectorised comparison per entry; entries are few: a budget of
tens of thousands of tokens holds tens of conversations) and returns the longest common
prefix. An entry that is a prefix of a newly stored one is dropped (the new one covers it).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PrefixEntry:
    """One cached sequence: `tokens` `[length]` int64 and `kv` `[layers, 2, kv_heads,
    length, head_dim]`."""

    tokens: torch.Tensor
    kv: torch.Tensor

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The longest cached prefix of a prompt: its `length` in tokens and the KV of the
    entry holding it (positions `0 .. length - 1` are the shared ones)."""

    length: int
    kv: torch.Tensor


class PrefixCache:
    """Finished sequences' KV, least recently used evicted first.

    Args:
        capacity_tokens: most tokens held over all entries (0 disables the cache).
    """

    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[int, PrefixEntry] = OrderedDict()
        self._next_key = 0
        self.tokens = 0  # held over all entries

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: list[int], limit: int) -> PrefixMatch | None:
        """The longest cached prefix of `token_ids`, at most `limit` tokens (a request keeps
        at least its last prompt token to compute, for the logits of its first token).
        A hit makes its entry the most recently used."""
        if not self._entries or limit < 1:
            return None
        query = torch.tensor(token_ids[:limit], dtype=torch.long)
        best_key, best_length = -1, 0
        for key, entry in self._entries.items():
            common = min(entry.length, query.shape[0])
            if common <= best_length:
                continue
            differs = entry.tokens[:common] != query[:common]
            length = int(differs.to(torch.int8).argmax().item()) if differs.any() else common
            if length > best_length:
                best_key, best_length = key, length
        if best_length == 0:
            return None
        self._entries.move_to_end(best_key)
        return PrefixMatch(best_length, self._entries[best_key].kv)

    def insert(self, token_ids: list[int], kv: torch.Tensor) -> None:
        """Store a finished sequence (`kv` as `PrefixEntry.kv`, owned by the cache from
        now on); entries it extends are dropped, then the least recently used are evicted
        down to `capacity_tokens`. A sequence longer than the capacity is not stored."""
        length = len(token_ids)
        if length == 0 or length > self.capacity_tokens:
            return
        tokens = torch.tensor(token_ids, dtype=torch.long)
        for key, entry in list(self._entries.items()):
            if entry.length <= length and torch.equal(entry.tokens, tokens[: entry.length]):
                self._remove(key)
        self._entries[self._next_key] = PrefixEntry(tokens, kv)
        self._next_key += 1
        self.tokens += length
        self.evict(self.capacity_tokens)

    def evict(self, keep_tokens: int) -> int:
        """Evict least recently used entries until at most `keep_tokens` tokens are held.

        Returns:
            Tokens freed.
        """
        freed = 0
        while self.tokens > keep_tokens and self._entries:
            key = next(iter(self._entries))
            freed += self._entries[key].length
            self._remove(key)
        return freed

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.tokens -= entry.length
