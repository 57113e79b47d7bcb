"""Per-request slots of KV cache for batched steps: every request holds one slot (a row of
the per-layer key/value buffers), written position by position and freed when it ends;
sliding-window layers keep only the positions their window still sees."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exo.worker.engines.torch.batching.kv_footprint import TRIM_CHUNK, TRIM_SLACK, held_start
from exo.worker.engines.torch.batching.kv_memory import release_positions, zeroed_kv_buffer

# Initial per-slot capacity in tokens; buffers double when a request outgrows them.
INITIAL_SLOT_CAPACITY = 256


class SlotKVCache:
    """Keys and values of the running requests, one slot per request.

    Per decoder layer, `keys[layer]` / `values[layer]` are `[slots, kv_heads, capacity,
    head_dim]`; slot `s` holds `lengths[s]` positions. Occupied slots are always
    `0 .. occupied - 1` (a freed slot is filled by moving the last one into it), so the
    decoding requests' keys are one view `keys[layer][:occupied, :, :max_len]`.
    The buffers come from `kv_memory.zeroed_kv_buffer`: zero-filled (decode attention reads
    past a short request's length — masked out, but a masked NaN from uninitialised memory
    would still poison the weighted sum) and backed by the OS only where positions are
    written. A freed slot's positions are released (`kv_memory.release_positions`), so the
    resident KV memory follows the positions the running requests hold (the scheduler's
    budget), not `slots x capacity`.

    Sliding-window layers (`windows`): as a slot grows (`commit`), a windowed layer's
    positions below `kv_footprint.held_start(reached, window)` are released, a
    `TRIM_CHUNK` run at a time, `reached` being the longest the slot has been; its copies
    (`read`, `write`, `free`'s move, `reserve`'s growth) copy only the positions held. Every
    position stays at its own index (released ones read as zeros and no attention reads
    them: windowed attention starts at `position - window + 1`), so the attention code and
    the native decode kernels read the slots as before. A ring buffer of `window` positions
    per windowed layer would hold slightly less, but every reader (SDPA decode over a view
    of all slots, the prefill paths, the native kernels) would have to map positions to
    ring indices, and a prefix copy would need unrolling; releasing pages keeps them
    unchanged and costs one `madvise` per head and layer every `TRIM_CHUNK` tokens.

    Args:
        layers: decoder layers of this shard.
        kv_heads: key/value heads per layer (this rank's).
        head_dim: width of one head.
        dtype: dtype of the keys and values (`kv_memory.kv_cache_torch_dtype`: bfloat16 on
            CPU by default; the step's attention writes its float32 keys rounded to it and
            reads them widened back).
        device: where they live.
        slots: most requests held at once.
        latent_values: 0 for keys and values of their own; else the width of the values
            inside each key (MLA's `kv_lora_rank`).
        windows: per layer, its sliding window in tokens or None (None: no windows).
        trim_slack / trim_chunk: `kv_footprint.held_start`'s (tests make them small).
    """

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int,
        latent_values: int = 0,
        windows: Sequence[int | None] | None = None,
        trim_slack: int = TRIM_SLACK,
        trim_chunk: int = TRIM_CHUNK,
    ) -> None:
        if windows is not None and len(windows) != layers:
            raise ValueError(f"{len(windows)} windows for {layers} layers")
        self.slots = slots
        self.windows: tuple[int | None, ...] = tuple(windows or (None,) * layers)
        self.trim_slack = trim_slack
        self.trim_chunk = trim_chunk
        # window -> the layers of that window
        self._windowed: dict[int, list[int]] = {}
        for layer, window in enumerate(self.windows):
            if window is not None:
                self._windowed.setdefault(window, []).append(layer)
        self.capacity = INITIAL_SLOT_CAPACITY
        self.latent_values = latent_values
        shape = (slots, kv_heads, self.capacity, head_dim)
        self.keys = [zeroed_kv_buffer(shape, dtype, device) for _ in range(layers)]
        self.values: list[torch.Tensor] = []
        if latent_values:
            self._latent_value_views()
        else:
            self.values = [zeroed_kv_buffer(shape, dtype, device) for _ in range(layers)]
        self.lengths = [0] * slots
        # Per slot: the longest it has been (its windowed layers are trimmed to it), and
        # the length its windowed layers were last released at.
        self.reached = [0] * slots
        self._released_at = [0] * slots
        self.occupied = 0

    def _latent_value_views(self) -> None:
        self.values = [keys[..., : self.latent_values] for keys in self.keys]

    def _buffers(self) -> tuple[list[torch.Tensor], ...]:
        """The buffers that own memory: keys, and values unless they are views of keys."""
        return (self.keys,) if self.latent_values else (self.keys, self.values)

    def allocate(self) -> int:
        """A free slot (length 0).

        Raises:
            RuntimeError: every slot is taken.
        """
        if self.occupied >= self.slots:
            raise RuntimeError("no free KV slot")
        slot = self.occupied
        self.occupied += 1
        self.lengths[slot] = 0
        self.reached[slot] = self._released_at[slot] = 0
        return slot

    def held_from(self, slot: int, layer: int) -> int:
        """The first position `layer` holds of `slot` (0 but for a trimmed windowed layer)."""
        return held_start(self.reached[slot], self.windows[layer], self.trim_slack, self.trim_chunk)

    def held_positions(self, slot: int) -> list[int]:
        """Positions of `slot` each layer holds."""
        length = self.lengths[slot]
        layers = range(len(self.keys))
        return [length - min(length, self.held_from(slot, layer)) for layer in layers]

    def commit(self, slot: int, length: int) -> None:
        """`slot` now holds positions `0 .. length - 1` (a step wrote them); its windowed
        layers release the positions their window no longer sees."""
        self.lengths[slot] = length
        if length <= self.reached[slot]:
            return
        self.reached[slot] = length
        before, after = self._released_at[slot], length
        self._released_at[slot] = after
        for window, layers in self._windowed.items():
            start = held_start(before, window, self.trim_slack, self.trim_chunk)
            end = held_start(after, window, self.trim_slack, self.trim_chunk)
            if end > start:
                for tensors in self._buffers():
                    for layer in layers:
                        release_positions(tensors[layer], slot, start, end)

    def hold_unverified(self, slot: int, length: int) -> None:
        """A speculative step wrote `slot`'s positions up to `length - 1`, past its
        committed ones (a draft's rows, `commit_lengths`): until `commit_verified` says how
        many are kept, a move (`free`) or a growth (`reserve`) copies them too. A pipeline
        verifies a draft after later steps of other requests were launched, which may free
        or grow slots meanwhile. They move no windowed layer's trim (`reached`)."""
        self.lengths[slot] = max(self.lengths[slot], length)

    def commit_verified(self, slot: int, length: int) -> None:
        """`commit` after a speculative step's verification: `slot` holds the fed token's
        and the accepted draft tokens' positions, `0 .. length - 1` (a split instance's
        rank 0 records it for the other ranks, whose steps commit only the fed one)."""
        self.commit(slot, length)

    def free(self, slot: int) -> int | None:
        """Release `slot`; the last occupied slot moves into it.

        Returns:
            The slot that moved into `slot` (its owner must update its slot number), or
            None when `slot` was the last one.
        """
        last = self.occupied - 1
        self.occupied -= 1
        if slot == last:
            self._release(slot, 0)
            self.lengths[slot] = 0
            return None
        length = self.lengths[last]
        for tensors in self._buffers():
            for index, layer in enumerate(tensors):
                start = min(length, self.held_from(last, index))
                release_positions(layer, slot, 0, start)  # the freed request's, if any
                layer[slot, :, start:length].copy_(layer[last, :, start:length])
        self._release(slot, length)
        self._release(last, 0)
        self.lengths[slot], self.lengths[last] = length, 0
        self.reached[slot], self.reached[last] = self.reached[last], 0
        self._released_at[slot], self._released_at[last] = self._released_at[last], 0
        return last

    def _release(self, slot: int, start: int) -> None:
        """Give back the memory of `slot`'s positions `start ..` (they read as zeros)."""
        for tensors in self._buffers():
            for layer in tensors:
                release_positions(layer, slot, start)

    def reserve(self, tokens: int) -> None:
        """Make room for `tokens` positions per slot (doubling the capacity; only the
        filled positions are copied)."""
        if tokens <= self.capacity:
            return
        capacity = max(tokens, 2 * self.capacity)
        for tensors in self._buffers():
            for index, old in enumerate(tensors):
                new = zeroed_kv_buffer(
                    (old.shape[0], old.shape[1], capacity, old.shape[3]), old.dtype, old.device
                )
                for slot in range(self.occupied):
                    length = self.lengths[slot]
                    start = min(length, self.held_from(slot, index))
                    new[slot, :, start:length].copy_(old[slot, :, start:length])
                tensors[index] = new
        if self.latent_values:
            self._latent_value_views()
        self.capacity = capacity

    def read(self, slot: int, length: int) -> torch.Tensor:
        """A copy of the slot's first `length` positions as `[layers, 2, kv_heads, length,
        head_dim]` (for the prefix cache; `[layers, 1, ...]`, the keys only, with
        `latent_values`); a windowed layer's positions the slot no longer holds are zeros
        and take no memory (`write` with the slot's `reached` copies it back)."""
        first = self.keys[0]
        buffers = self._buffers()
        # Its own mapping (`zeroed_kv_buffer`): evicting the entry unmaps it, where heap
        # blocks of many sizes coming and going would stay with the allocator (fragmented).
        copy = zeroed_kv_buffer(
            (len(self.keys), len(buffers), first.shape[1], length, first.shape[3]),
            first.dtype, first.device,
        )  # fmt: skip
        for kind, tensors in enumerate(buffers):
            for layer, buffer in enumerate(tensors):
                start = min(length, self.held_from(slot, layer))
                copy[layer, kind, :, start:].copy_(buffer[slot, :, start:length])
        return copy

    def write(self, slot: int, kv: torch.Tensor, length: int, reached: int | None = None) -> None:
        """Fill a newly allocated slot's first `length` positions from `read`'s layout, of a
        sequence whose windowed layers were trimmed at `reached` (None: `length`): only the
        positions those hold are copied, and the slot keeps that trim (the caller checks
        that `length` needs no position below it: `kv_footprint.first_hit_length`)."""
        self.reserve(length)
        self.reached[slot] = self._released_at[slot] = max(length, reached or 0)
        for kind, tensors in enumerate(self._buffers()):
            for layer, buffer in enumerate(tensors):
                start = min(length, self.held_from(slot, layer))
                buffer[slot, :, start:length].copy_(kv[layer, kind, :, start:length])
        self.lengths[slot] = length
