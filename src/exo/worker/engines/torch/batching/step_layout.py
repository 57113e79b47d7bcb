"""How one step's rows are laid out for the forward pass, from the requests the scheduler
picked (`scheduler.py` decides which; this module only places them), and how a draft's
logits rows are read back (`draft_rows`).

The step is one flattened sequence: first the decode rows, one per decoding request in
the order given (slot order), then each prefilling request's prompt chunk. A decoding
request with a speculative draft of k tokens has k + 1 decode rows, the fed token and the
draft tokens at the next positions, laid out from the last position down (every one is a
decode row to the attention: `BatchPlan.repeated_slots`), with its logits rows in position
order. A chunk that ends its prompt adds its last row to the logits rows. A chunk over
images carries the image blocks and the rows whose embeddings the projected features
replace (`prompt_images.segment_images`); a step where some request has multimodal rotary
positions carries `[3, T]` of them (`BatchPlan.rotary_positions`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exo.worker.engines.torch.batching.batch_attention import BatchPlan, PrefillSegment
from exo.worker.engines.torch.batching.prompt_images import segment_images
from exo.worker.engines.torch.batching.request_state import RequestState
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.sampling import SampledToken
from exo.worker.engines.torch.decoding.speculative_drafts import NO_DRAFT, Draft


@dataclass(eq=False, slots=True)
class RunningRequest:
    """A request holding a KV slot: `tokens[:computed]` have KV in `slot` (or are written
    by a step in flight); while `computed < len(tokens)` it is prefilling, then `tokens[-1]`
    is fed each step."""

    state: RequestState
    slot: int
    tokens: list[int]
    computed: int
    admitted: int  # admission order (pre-emption takes the latest)
    # A launched step will sample this request's next token (it waits out later steps).
    awaiting: bool = False

    @property
    def prefilling(self) -> bool:
        """Prompt tokens left to compute, or more than one token (one generated token left
        is a decode step). A prompt's last token left alone (after a prefix-cache hit) is a
        prompt chunk of one row, computed as a cold prefill computes that row, so a seeded
        request gives the same tokens cold and cached (`test_seeded_paths.py`)."""
        left = len(self.tokens) - self.computed
        return left > 1 or (left == 1 and self.computed < len(self.state.prompt_ids))


@dataclass(frozen=True, slots=True)
class StepLayout:
    """One step ready for the forward pass: `plan` says where each row goes; `input_ids`
    and `position_ids` are `[1, T]` int64, `logit_rows` `[R]` int64 (the rows whose logits
    are sampled). `sampled[i]` takes the next `len(drafts[i].tokens) + 1` logits rows."""

    plan: BatchPlan
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logit_rows: torch.Tensor
    sampled: list[RunningRequest]
    drafts: list[Draft]


def lay_out_step(
    decoding: list[RunningRequest],
    prefill: list[tuple[RunningRequest, int]],
    drafts: dict[int, Draft],
    cache: SlotKVCache,
    windows: Sequence[int | None],
    layer_of: dict[int, int],
    device: torch.device,
) -> StepLayout:
    """Lay out a step's rows (see the module docstring) and reserve the cache's positions
    up to the furthest one it writes (`SlotKVCache.reserve`).

    Args:
        decoding: the decoding requests, in slot order.
        prefill: the prefilling requests and their chunks' lengths in tokens.
        drafts: the decoding requests' drafts, by `id` of the request (none: no draft).
        cache, windows, layer_of: the scheduler's, for the `BatchPlan`.
        device: where the input tensors go.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    logit_rows: list[int] = []
    sampled: list[RunningRequest] = []
    decode_slots: list[int] = []
    launched_drafts: list[Draft] = []
    for running in decoding:
        drafted = drafts.get(id(running), NO_DRAFT)
        draft = drafted.tokens
        # The fed token and the draft at the next positions, last position first (see
        # the module docstring); logits rows in position order.
        first = len(input_ids)
        fed = [running.tokens[-1], *draft]
        for offset in range(len(draft), -1, -1):
            input_ids.append(fed[offset])
            positions.append(running.computed + offset)
            decode_slots.append(running.slot)
        logit_rows.extend(first + len(draft) - offset for offset in range(len(draft) + 1))
        sampled.append(running)
        launched_drafts.append(drafted)
    decode_positions = list(positions)
    segments: list[PrefillSegment] = []
    row_embeddings: list[tuple[int, torch.Tensor]] = []
    for running, length in prefill:
        start = running.computed
        blocks, rows = segment_images(start, length, running.state.images)
        row_embeddings += [(len(input_ids) + row, embeddings) for row, embeddings in rows]
        segments.append(PrefillSegment(running.slot, start, len(input_ids), length, blocks))
        input_ids.extend(running.tokens[start : start + length])
        positions.extend(range(start, start + length))
        if start + length == len(running.tokens):
            logit_rows.append(len(input_ids) - 1)
            sampled.append(running)
            launched_drafts.append(NO_DRAFT)
    rotary_positions = None
    stepping = [*decoding, *(running for running, _ in prefill)]
    if any(running.state.positions is not None for running in stepping):
        rotary_positions = multimodal_rows(decoding, prefill)
    ends = [
        running.computed + 1 + len(drafts.get(id(running), NO_DRAFT).tokens) for running in decoding
    ]
    ends += [running.computed + length for running, length in prefill]
    cache.reserve(max(ends))
    plan = BatchPlan(
        cache=cache,
        windows=windows,
        decode_slots=decode_slots,
        decode_positions=decode_positions,
        prefill=segments,
        layer_of=layer_of,
        row_embeddings=row_embeddings,
        rotary_positions=rotary_positions,
    )
    return StepLayout(
        plan,
        torch.tensor([input_ids], dtype=torch.long, device=device),
        torch.tensor([positions], dtype=torch.long, device=device),
        torch.tensor(logit_rows, dtype=torch.long, device=device),
        sampled,
        launched_drafts,
    )


def multimodal_rows(
    decoding: list[RunningRequest], prefill: list[tuple[RunningRequest, int]]
) -> torch.Tensor:
    """`[3, T]` int64: the step's rows' multimodal rotary positions (`BatchPlan.
    rotary_positions`), decode rows then prompt chunks as the step lays them out; a
    request without multimodal positions repeats its token index in all three."""

    def rows(running: RunningRequest, start: int, length: int) -> torch.Tensor:
        positions = running.state.positions
        if positions is None:
            return torch.arange(start, start + length).expand(3, -1)
        return positions.rows(start, length)

    pieces = [rows(running, running.computed, 1) for running in decoding]
    pieces += [rows(running, running.computed, length) for running, length in prefill]
    return torch.cat(pieces, dim=1)


def draft_rows(
    logits: torch.Tensor | Sequence[torch.Tensor | SampledToken], first: int, end: int
) -> torch.Tensor | Sequence[torch.Tensor | SampledToken]:
    """A draft's rows `first .. end - 1` of a step: `[k + 1, vocab]` logits, or a launched
    step's entries, one per row (tokens chosen elsewhere, `speculation.remote_rows`)."""
    if isinstance(logits, torch.Tensor):
        return logits[first:end]
    rows = logits[first:end]
    if all(isinstance(row, torch.Tensor) for row in rows):
        return torch.stack([row for row in rows if isinstance(row, torch.Tensor)])
    return rows
