"""The KV operations rank 0 of a split instance makes, for the other ranks to replay.

Rank 0's scheduler decides every KV change: `allocate` / `free` / `reserve` / `read` /
`write` / `commit_verified` of its `SlotKVCache` and the prefix cache's stores and drops.
`RecordingSlotKVCache` and `RecordingPrefixCache` record each into one `CacheOpLog` as a
`CacheOp` (`kind, a, b, c`); the log travels in the next step's header
(`rank_steps.StepHeader.cache_ops`) and `replay_cache_ops` applies it on every other rank in
the same order, so every rank's slot `s` holds the same request's KV and every rank's prefix
entry `k` (its `PrefixMirror`) the same sequence's, each rank its own layers and heads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from exo.worker.engines.torch.batching.prefix_cache import PrefixCache, PrefixMatch
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache

# Cache operations (kind, a, b, c) in StepHeader.cache_ops (unused arguments 0).
CACHE_ALLOCATE = 1  # a: the slot rank 0 got (checked on replay)
CACHE_FREE = 2  # a: the freed slot (the last occupied slot moves into it)
CACHE_RESERVE = 3  # a: tokens per slot to make room for
CACHE_READ = 4  # a: slot, b: length: copy the slot's first b positions (for CACHE_STORE)
CACHE_STORE = 5  # a: prefix entry key (-1: none): the last CACHE_READ's copy becomes it
CACHE_LOAD = 6  # a: slot, b: entry key, c: length: the entry's first c positions into a
CACHE_DROP = 7  # a: entry key: the entry left rank 0's prefix cache
CACHE_COMMIT = 8  # a: slot, b: length: a verified draft's positions are held (speculation)

CacheOp = tuple[int, int, int, int]


class CacheOpLog:
    """Rank 0's KV operations (slots and prefix cache) since the last step, in order."""

    def __init__(self) -> None:
        self._ops: list[CacheOp] = []

    def record(self, kind: int, a: int = 0, b: int = 0, c: int = 0) -> None:
        self._ops.append((kind, a, b, c))

    def take(self) -> tuple[CacheOp, ...]:
        """The operations since the last call, in order (and forget them)."""
        ops, self._ops = tuple(self._ops), []
        return ops


class RecordingPrefixCache(PrefixCache):
    """Rank 0's prefix cache of a split instance: rank 0 alone decides hits, insertions and
    evictions (it holds the only token lists and the LRU order) and records each as a
    `CACHE_*` operation; every other rank keeps the same entries of its own part of the KV
    (`PrefixMirror`), keyed by rank 0's entry keys.

    Rank 0 decides rather than every rank mirroring the decisions from the same inputs:
    the ranks > 0 never see the requests' token lists (only each step's rows), and one
    decider cannot drift (a mirror that ran its own LRU would diverge at the first
    difference, e.g. a lookup rank 0 made for a request it then did not admit)."""

    def __init__(self, capacity_tokens: int, log: CacheOpLog) -> None:
        super().__init__(capacity_tokens, on_remove=lambda key: log.record(CACHE_DROP, key))
        self._log = log
        # The last match `lookup` handed out: the scheduler copies it into a slot next
        # (`RecordingSlotKVCache.write` names its entry to the other ranks).
        self.last_match: PrefixMatch | None = None

    def lookup(self, token_ids: list[int], limit: int) -> PrefixMatch | None:
        self.last_match = super().lookup(token_ids, limit)
        return self.last_match

    def insert(
        self,
        token_ids: list[int],
        kv: torch.Tensor,
        reached: int | None = None,
        first_hit: int = 0,
    ) -> int | None:
        key = super().insert(token_ids, kv, reached, first_hit)
        self._log.record(CACHE_STORE, -1 if key is None else key)
        return key


class RecordingSlotKVCache(SlotKVCache):
    """Rank 0's `SlotKVCache`: records every slot operation for the other ranks to replay
    (into `log`, shared with its `RecordingPrefixCache`, set as `prefix`): a `read` (the
    KV of a finished request, for the prefix cache) and a `write` (a prefix hit copied
    into a slot) included."""

    def __init__(self, *args: Any, log: CacheOpLog, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.log = log
        self.prefix: RecordingPrefixCache | None = None

    def allocate(self) -> int:
        slot = super().allocate()
        self.log.record(CACHE_ALLOCATE, slot)
        return slot

    def free(self, slot: int) -> int | None:
        self.log.record(CACHE_FREE, slot)
        return super().free(slot)

    def reserve(self, tokens: int) -> None:
        if tokens > self.capacity:
            self.log.record(CACHE_RESERVE, tokens)
        super().reserve(tokens)

    def read(self, slot: int, length: int) -> torch.Tensor:
        self.log.record(CACHE_READ, slot, length)
        return super().read(slot, length)

    def commit_verified(self, slot: int, length: int) -> None:
        """A verified draft's positions are held: the other ranks' steps committed only
        the fed position (`commit_lengths`), and a slot moved by `free` or copied by
        `reserve` keeps only its held positions."""
        self.log.record(CACHE_COMMIT, slot, length)
        super().commit_verified(slot, length)

    def write(self, slot: int, kv: torch.Tensor, length: int, reached: int | None = None) -> None:
        """Copy a prefix hit into `slot`: only the prefix cache's last match may be written
        (the other ranks copy the same entry of theirs, with the trim their own slot had:
        every rank's slots reach the same lengths).

        Raises:
            RuntimeError: `kv` is not the prefix cache's last match.
        """
        match = None if self.prefix is None else self.prefix.last_match
        if match is None or match.kv is not kv:
            raise RuntimeError("a split instance writes a KV slot only from a prefix hit")
        self.log.record(CACHE_LOAD, slot, match.key, length)
        super().write(slot, kv, length, reached)


@dataclass(slots=True)
class PrefixMirror:
    """A rank > 0's prefix entries: its own part of the KV of each entry of rank 0's
    `RecordingPrefixCache`, under rank 0's key (`[layers, 2, kv_heads, length, head_dim]`
    of this rank's layers and heads, as `SlotKVCache.read` gives), with the length its
    slot's windowed layers were trimmed at (`SlotKVCache.reached`)."""

    entries: dict[int, tuple[torch.Tensor, int]] = field(default_factory=dict)
    # The last CACHE_READ's copy and trim, until CACHE_STORE names it.
    pending: tuple[torch.Tensor, int] | None = None

    @property
    def tokens(self) -> int:
        """Positions of the entries (every layer counted whole)."""
        return sum(int(kv.shape[3]) for kv, _ in self.entries.values())


def replay_cache_ops(
    cache: SlotKVCache, ops: tuple[CacheOp, ...], mirror: PrefixMirror | None = None
) -> None:
    """Apply rank 0's KV operations to this rank's slots and prefix entries, in order.
    Entries rank 0 dropped leave after the whole list: rank 0 may evict a hit's entry to
    make room for the request it is admitting, then copy it (its tensor still held), in
    the same step's operations.

    Raises:
        RuntimeError: an allocation got another slot than rank 0's, or an entry is unknown
            (the ranks diverged).
    """
    mirror = mirror if mirror is not None else PrefixMirror()
    dropped: list[int] = []
    for kind, a, b, c in ops:
        if kind == CACHE_ALLOCATE:
            slot = cache.allocate()
            if slot != a:
                raise RuntimeError(f"KV slot {slot} allocated where rank 0 got {a}")
        elif kind == CACHE_FREE:
            cache.free(a)
        elif kind == CACHE_RESERVE:
            cache.reserve(a)
        elif kind == CACHE_READ:
            mirror.pending = (cache.read(a, b), cache.reached[a])
        elif kind == CACHE_COMMIT:
            cache.commit(a, b)
        elif kind == CACHE_STORE:
            if mirror.pending is None:
                raise RuntimeError("prefix entry stored with no KV read before it")
            if a >= 0:
                mirror.entries[a] = mirror.pending
            mirror.pending = None
        elif kind == CACHE_LOAD:
            entry = mirror.entries.get(b)
            if entry is None:
                raise RuntimeError(f"rank 0 copied prefix entry {b}, which this rank lacks")
            cache.write(a, entry[0], c, entry[1])
        elif kind == CACHE_DROP:
            if a not in mirror.entries:
                raise RuntimeError(f"rank 0 dropped prefix entry {a}, which this rank lacks")
            dropped.append(a)
        else:
            raise RuntimeError(f"unknown KV cache operation {kind}")
    for key in dropped:
        del mirror.entries[key]
