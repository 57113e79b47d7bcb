"""How many positions of KV a sequence keeps per layer once sliding-window layers drop what
their window no longer sees, and what that costs in the scheduler's KV budget.

A layer with a sliding window `w` (Gemma 3's local layers, gpt-oss's alternate layers,
Mistral 7B v0.1) attends from position `p` to keys `p - w + 1 .. p` only
(`batch_attention`), so once a sequence is `L` long, its keys below `L - w + 1` are never
read again. `SlotKVCache` releases them: a windowed layer keeps positions
`held_start(L, w) ..`, where `held_start` lags `L - w` by `TRIM_SLACK` positions and moves in
steps of `TRIM_CHUNK` (`held_start(L, w) = max(0, floor((L - w - TRIM_SLACK) / TRIM_CHUNK)
* TRIM_CHUNK)`), so a windowed layer holds at most `w + TRIM_SLACK + TRIM_CHUNK - 1`
positions of a sequence, whatever its length.

- `TRIM_CHUNK`: the memory goes back to the OS a run of positions at a time
  (`kv_memory.release_positions`: one `madvise` per KV head and layer), not every token.
- `TRIM_SLACK`: a finished sequence's KV enters the prefix cache as its slot holds it, and a
  later request may reuse a prefix of length `h` only where every windowed layer still holds
  the keys position `h` attends to (`first_hit_length`); the slack keeps that true for a
  next turn whose prompt re-tokenizes the last tokens of the cached one differently, and for
  a regenerated reply of up to ~`TRIM_SLACK` tokens.

The KV budget (`BatchScheduler.budget_tokens`, `--kv-cache-tokens`) stays in "tokens of the
whole model": `budget_tokens x bytes per token of every layer`. A sequence of `L` tokens
costs `ceil(sum over layers of held(L, layer) / layers)` of it (`KVFootprint.tokens`), with
`held = L` for full layers and `min(L, w + TRIM_SLACK + TRIM_CHUNK - 1)` for windowed
ones: on a model with windowed layers, more tokens fit the same memory.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exo.shared.models.kv_cache_memory import SLIDING_WINDOW_TRIM_CHUNK, SLIDING_WINDOW_TRIM_SLACK
from exo.shared.types.models import ModelCard

# Positions a windowed layer's KV is released by at once (a multiple of a page for every
# head width from 64 bfloat16 values up); placement counts the same (`exo.shared.models.
# kv_cache_memory.kv_budget_tokens_of_length`).
TRIM_CHUNK = SLIDING_WINDOW_TRIM_CHUNK
# Positions a windowed layer keeps beyond its window (see the module docstring).
TRIM_SLACK = SLIDING_WINDOW_TRIM_SLACK


def held_start(
    reached: int, window: int | None, slack: int = TRIM_SLACK, chunk: int = TRIM_CHUNK
) -> int:
    """The first position a layer of `window` (None: full attention) still holds once its
    sequence has been `reached` positions long (0 for a full layer)."""
    if window is None:
        return 0
    return max(0, (reached - window - slack) // chunk * chunk)


def first_hit_length(
    reached: int,
    windows: Sequence[int | None],
    slack: int = TRIM_SLACK,
    chunk: int = TRIM_CHUNK,
) -> int:
    """The shortest prefix of a sequence trimmed at `reached` that a later request may reuse
    (0: any): reusing `h` positions, the request's next query (position `h`) reads keys
    from `h - w + 1`, so each windowed layer that released positions below `s` needs
    `h >= s + w - 1`."""
    shortest = 0
    for window in set(windows):
        start = held_start(reached, window, slack, chunk)
        if window is not None and start > 0:
            shortest = max(shortest, start + window - 1)
    return shortest


@dataclass(frozen=True, slots=True)
class KVFootprint:
    """The KV a sequence holds, per layer of `windows` (the sliding window of each layer
    the budget counts; None: full attention), in positions and in budget tokens."""

    windows: tuple[int | None, ...]
    slack: int = TRIM_SLACK
    chunk: int = TRIM_CHUNK

    @property
    def layers(self) -> int:
        return max(1, len(self.windows))

    def held(self, length: int, reached: int | None = None) -> int:
        """Positions held over all layers by a sequence of `length` whose windowed layers
        were trimmed at `reached` (None: `length`; a prefix entry copied into a slot keeps
        its entry's trim)."""
        trimmed = length if reached is None else max(length, reached)
        return sum(
            length - min(length, held_start(trimmed, window, self.slack, self.chunk))
            for window in self.windows
        )

    def tokens(self, length: int) -> int:
        """Budget tokens of a running sequence `length` long: its positions at most held
        between two trims, `min(length, w + slack + chunk - 1)` per windowed layer and
        `length` per full one, averaged over the layers (rounded up). Never decreasing in
        `length`, and `length` itself on a model without windows."""
        longest = self.slack + self.chunk - 1
        total = sum(
            length if window is None else min(length, window + longest) for window in self.windows
        )
        return -(-total // self.layers) if self.windows else length

    def entry_tokens(self, length: int, reached: int) -> int:
        """Budget tokens of a prefix-cache entry: the positions it holds (its windowed
        layers trimmed at `reached`), averaged over the layers (rounded up)."""
        if not self.windows:
            return length
        return -(-self.held(length, reached) // self.layers)

    def longest(self, budget_tokens: int) -> int:
        """The longest sequence whose `tokens` fit `budget_tokens` (`budget_tokens` itself
        without windowed layers)."""
        if budget_tokens <= 0:
            return 0
        full = sum(1 for window in self.windows if window is None)
        if full == len(self.windows):
            return budget_tokens
        low, high = budget_tokens, budget_tokens * self.layers  # tokens(low) <= budget
        while low < high:
            middle = (low + high + 1) // 2
            if self.tokens(middle) <= budget_tokens:
                low = middle
            else:
                high = middle - 1
        return low


def card_footprint(card: ModelCard, layers: int) -> KVFootprint | None:
    """The footprint of `card`'s whole model from its `sliding_window` (which layers slide
    does not change the count), None where the card states no sliding layers. For a
    pipeline's rank 0, which holds `layers` of them only and would otherwise count every
    layer whole; None too where the card's layer count is not the model's."""
    sliding = card.sliding_window
    if sliding is None or sliding.layers > card.n_layers or layers > card.n_layers:
        return None
    full = card.n_layers - sliding.layers
    return KVFootprint((sliding.window,) * sliding.layers + (None,) * full)
