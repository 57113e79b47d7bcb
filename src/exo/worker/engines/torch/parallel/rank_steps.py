"""What the ranks of a split instance exchange to run one batched step together.

Rank 0 runs the single-rank `BatchScheduler` (admission, chunked prefill, pre-emption,
prefix cache, sampling) over its part of the model. Each step it sends the other ranks a
`StepHeader`: the KV operations it made since the last step (`parallel/cache_ops.py`:
recorded on rank 0, replayed in the same order on the others, so every rank's slot `s` holds
the same request's KV and every rank's prefix entry `k` the same sequence's) and the step's
`BatchPlan` (decoding slots and positions, prefill segments), its token ids, positions and
logit rows. The header is one int64 tensor, sent as its length then its values (one
message over the links of `comm/tcp_mesh.py`, or two gloo sends without them).

A prompt with images (a vision model's, `batching/prompt_images.py`): the vision tower runs
on rank 0 only, before the prompt's prefill. The header carries each prefill segment's
image blocks (`PrefillSegment.image_blocks`: every rank's attention mask needs them, in
every layer, in every chunk) and the rows whose embeddings rank 0 replaces with an image's
features (`image_rows`, of `image_width` columns); the features themselves travel only where
another rank embeds the tokens too (tensor parallel: `tensor.py` sends them after the
header), never the pixels. A pipeline's first rank alone embeds: the later ranks get the
image rows inside its hidden states, and Qwen3-VL's deepstack features (added after the
first decoder layers: rows wider than the hidden size) after them where a later rank holds
such a layer (`pipeline.py`). A model that places image tokens by row and column (Qwen-VL's
multimodal rotary positions, `BatchPlan.rotary_positions`) has the step's three position
rows in the header (`rotary_positions`), in decode steps too.

A pipeline step with enough rows (`micro_batch_count`) is split into micro-batches
(`split_micro_batches`): rank 0 computes its layers for micro-batch A and sends it on, then
computes micro-batch B while rank 1 computes A (as in Huang et al. 2019, "GPipe", without
the backward pass).
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, cast

import torch
from transformers import PreTrainedModel

from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    commit_lengths,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.comm.process_group import (
    broadcast_message,
    receive_message,
    receive_tensor,
    send_message,
    send_tensor,
)
from exo.worker.engines.torch.parallel.cache_ops import CacheOp
from exo.worker.engines.torch.parallel.last_rank_sampling import FULL_ROW, RowSampling

# StepHeader.command
STEP = 1  # run the step the header describes
WARMUP_DONE = 2  # rank 0 finished its warm-up generation
SHUTDOWN = 3  # rank 0 is shutting down: the other ranks return


@dataclass(frozen=True, slots=True)
class StepHeader:
    """One step (or one pipeline micro-batch) as rank 0 tells it to the other ranks.

    Attributes:
        command: `STEP`, `WARMUP_DONE` or `SHUTDOWN` (the other fields empty for the last two).
        cache_ops: KV operations to replay before the step (`CACHE_*`, a, b, c).
        decode_slots / decode_positions: one row per decoding request (`BatchPlan`).
        prefill: prefill segments following the decode rows.
        input_ids / position_ids: `[T]` the step's flattened tokens and their positions.
        logit_rows: `[R]` rows whose logits are wanted.
        image_rows: `(row, count)` per run of rows whose embeddings rank 0 replaces with
            an image's projected features (`BatchPlan.row_embeddings`), in row order.
        image_width: the width of those features' rows (the hidden size, or a multiple of
            it where deepstack features follow: Qwen3-VL); 0 without image rows.
        rotary_positions: `[3, T]` flattened row by row: the step's multimodal rotary
            positions (`BatchPlan.rotary_positions`), empty when the plan has none.
        samplings: a pipeline step's, one per logit row: what the last rank sends back for
            it (`last_rank_sampling.RowSampling`); empty: `[R, vocab]` logits (tensor
            and expert ranks never send logits).
    """

    command: int
    cache_ops: tuple[CacheOp, ...] = ()
    decode_slots: tuple[int, ...] = ()
    decode_positions: tuple[int, ...] = ()
    prefill: tuple[PrefillSegment, ...] = ()
    input_ids: tuple[int, ...] = ()
    position_ids: tuple[int, ...] = ()
    logit_rows: tuple[int, ...] = ()
    samplings: tuple[RowSampling, ...] = ()
    image_rows: tuple[tuple[int, int], ...] = ()
    image_width: int = 0
    rotary_positions: tuple[int, ...] = ()

    @classmethod
    def from_plan(
        cls,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor,
        cache_ops: tuple[CacheOp, ...],
        samplings: tuple[RowSampling, ...] = (),
    ) -> StepHeader:
        """The header of a step `forward_batch` would run (`input_ids` / `position_ids`
        `[1, T]`, `logit_rows` `[R]`)."""
        image_rows = tuple(
            (row, int(embeddings.shape[0])) for row, embeddings in plan.row_embeddings
        )
        widths = {int(embeddings.shape[1]) for _, embeddings in plan.row_embeddings}
        if len(widths) > 1:
            raise ValueError(f"image rows of several widths in one step: {sorted(widths)}")
        rotary = plan.rotary_positions
        return cls(
            STEP, cache_ops, tuple(plan.decode_slots), tuple(plan.decode_positions),
            tuple(plan.prefill), tuple(input_ids[0].tolist()), tuple(position_ids[0].tolist()),
            tuple(logit_rows.tolist()), samplings, image_rows, widths.pop() if widths else 0,
            () if rotary is None else tuple(rotary.reshape(-1).tolist()),
        )  # fmt: skip

    @property
    def rows(self) -> int:
        return len(self.input_ids)

    @property
    def row_samplings(self) -> tuple[RowSampling, ...]:
        """One per logit row: `samplings`, or whole logits for every row without them."""
        return self.samplings or (FULL_ROW,) * len(self.logit_rows)

    def plan(self, cache: SlotKVCache, windows: Any, layer_of: dict[int, int]) -> BatchPlan:
        """This rank's `BatchPlan` of the step (over this rank's cache and layers)."""
        rotary = None
        if self.rotary_positions:
            rotary = torch.tensor(self.rotary_positions, dtype=torch.long).view(3, self.rows)
        return BatchPlan(
            cache=cache, windows=windows, decode_slots=list(self.decode_slots),
            decode_positions=list(self.decode_positions), prefill=list(self.prefill),
            layer_of=layer_of, rotary_positions=rotary,
        )  # fmt: skip

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`input_ids` `[1, T]`, `position_ids` `[1, T]`, `logit_rows` `[R]` (int64)."""
        return (
            torch.tensor([self.input_ids], dtype=torch.long),
            torch.tensor([self.position_ids], dtype=torch.long),
            torch.tensor(self.logit_rows, dtype=torch.long),
        )

    def encode(self) -> torch.Tensor:
        """The header as one int64 vector (counts first, then each list)."""
        values = [self.command, len(self.cache_ops)]
        for op in self.cache_ops:
            values += op
        values += [len(self.decode_slots), *self.decode_slots, *self.decode_positions]
        values.append(len(self.prefill))
        for segment in self.prefill:
            values += [segment.slot, segment.start, segment.offset, segment.length]
            values.append(len(segment.image_blocks))
            for first, end in segment.image_blocks:
                values += [first, end]
        values += [len(self.input_ids), *self.input_ids, *self.position_ids]
        values += [len(self.logit_rows), *self.logit_rows]
        values.append(len(self.samplings))
        for sampling in self.samplings:
            values += sampling.encode()
        values.append(len(self.image_rows))
        for row, count in self.image_rows:
            values += [row, count]
        values += [self.image_width, len(self.rotary_positions), *self.rotary_positions]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def decode(cls, encoded: torch.Tensor) -> StepHeader:
        """Inverse of `encode`."""
        values = encoded.tolist()
        cursor = 0

        def take(count: int) -> list[int]:
            nonlocal cursor
            taken = values[cursor : cursor + count]
            cursor += count
            return taken

        command, op_count = take(2)
        flat_ops = take(4 * op_count)
        ops = tuple(
            (flat_ops[i], flat_ops[i + 1], flat_ops[i + 2], flat_ops[i + 3])
            for i in range(0, len(flat_ops), 4)
        )
        (decoding,) = take(1)
        slots, positions = tuple(take(decoding)), tuple(take(decoding))
        (segment_count,) = take(1)
        segments_read: list[PrefillSegment] = []
        for _ in range(segment_count):
            slot, start, offset, length, block_count = take(5)
            flat = take(2 * block_count)
            blocks = tuple((flat[i], flat[i + 1]) for i in range(0, len(flat), 2))
            segments_read.append(PrefillSegment(slot, start, offset, length, blocks))
        segments = tuple(segments_read)
        (rows,) = take(1)
        input_ids, position_ids = tuple(take(rows)), tuple(take(rows))
        (logit_count,) = take(1)
        logit_rows = tuple(take(logit_count))
        (sampling_count,) = take(1)
        width = RowSampling.WIDTH
        flat_samplings = take(width * sampling_count)
        samplings = tuple(
            RowSampling.decode(flat_samplings[i : i + width])
            for i in range(0, len(flat_samplings), width)
        )
        (image_count,) = take(1)
        flat_images = take(2 * image_count)
        image_rows = tuple(
            (flat_images[i], flat_images[i + 1]) for i in range(0, len(flat_images), 2)
        )
        image_width, rotary_count = take(2)
        rotary_positions = tuple(take(rotary_count))
        if cursor != len(values):
            raise RuntimeError(f"malformed step header ({len(values)} values, read {cursor})")
        return cls(
            command, ops, slots, positions, segments, input_ids, position_ids, logit_rows,
            samplings, image_rows, image_width, rotary_positions,
        )  # fmt: skip


def broadcast_step(header: StepHeader | None, idle_wait: timedelta) -> StepHeader:
    """Tensor parallel: rank 0 sends `header` to every rank; the others (`header` None)
    receive it, waiting up to `idle_wait` for it to start (rank 0 may be idle), then the
    group's timeout (`distributed.broadcast_message`: one message over the links)."""
    if header is not None:
        broadcast_message(header.encode(), idle_wait)
        return header
    return StepHeader.decode(broadcast_message(None, idle_wait))


def send_step(header: StepHeader, destination: int) -> None:
    """Pipeline: send a header to the next rank (`distributed.send_message`)."""
    send_message(header.encode(), destination)


def receive_step(source: int, idle_wait: timedelta) -> StepHeader:
    """Pipeline: receive a header from the previous rank, waiting up to `idle_wait` for it
    to start, then the group's timeout."""
    return StepHeader.decode(receive_message(source, idle_wait))


def send_image_rows(
    row_embeddings: list[tuple[int, torch.Tensor]], destinations: Iterable[int]
) -> None:
    """A step's image features (`BatchPlan.row_embeddings`, each `[n, width]`), concatenated
    in row order into one `[rows, width]` float32 message to each rank of `destinations`
    (after the step's header, which says where they go and how wide they are): from rank 0
    to every other rank of a tensor group, along a pipeline for deepstack features."""
    rows = torch.cat([embeddings for _, embeddings in row_embeddings]).float().cpu()
    rows = rows.contiguous()
    for rank in destinations:
        send_tensor(rows, rank)


def receive_image_rows(
    image_rows: tuple[tuple[int, int], ...], width: int, device: torch.device, source: int
) -> list[tuple[int, torch.Tensor]]:
    """Rank `source`'s `send_image_rows` for a header's `image_rows` (of `image_width`
    columns), as the plan's `row_embeddings` (`(row, [count, width])` float32 on `device`).

    Raises:
        torch.distributed.DistError (or the links' error): `source` sent nothing in time.
    """
    counts = [count for _, count in image_rows]
    rows = torch.empty((sum(counts), width), dtype=torch.float32)
    receive_tensor(rows, source)
    pieces = torch.split(rows.to(device), counts)
    return [(row, piece) for (row, _), piece in zip(image_rows, pieces, strict=True)]


# A pipeline step is split into micro-batches only from this many rows (tokens) on. A
# decode step of a few rows costs about as much as one of a single row (reading the weights
# and the per-layer work dominate, not the rows), so splitting it makes every rank run its
# layers once per micro-batch, nearly doubling the step (figures:
# docs/benchmarks/engine-design-figures.md#rank_stepspy).
# Without overlapping consecutive steps a decode step gains nothing from the split; a long
# prefill's rows are where the work grows with rows and the split lets the ranks overlap.
MICRO_BATCH_MIN_ROWS = 64


def micro_batch_count(step: StepHeader, world_size: int) -> int:
    """How many micro-batches a pipeline step is split into: `world_size` when it has at
    least `MICRO_BATCH_MIN_ROWS` rows, else 1; 1 for a step with a speculative draft's
    rows (several decode rows of one slot, which `split_micro_batches` would part; such a
    step has no prompt rows and stays within `Speculation.max_decode_rows` anyway)."""
    if len(set(step.decode_slots)) < len(step.decode_slots):
        return 1
    return world_size if step.rows >= MICRO_BATCH_MIN_ROWS else 1


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """One micro-batch of a pipeline step: its own header (rows renumbered from 0), per
    logit row of it the index of that row in the whole step's `logit_rows`, and per row of
    it the row of the whole step (`step_rows`)."""

    header: StepHeader
    logit_order: tuple[int, ...]
    step_rows: tuple[int, ...] = ()

    def row_embeddings(
        self, step_embeddings: list[tuple[int, torch.Tensor]]
    ) -> list[tuple[int, torch.Tensor]]:
        """The step's `BatchPlan.row_embeddings` that fall in this micro-batch, renumbered
        to its rows (a run of image rows lies in one prefill segment, whole in one
        micro-batch)."""
        local = {row: index for index, row in enumerate(self.step_rows)}
        return [(local[row], embeddings) for row, embeddings in step_embeddings if row in local]


def split_micro_batches(step: StepHeader, parts: int) -> list[MicroBatch]:
    """Split a step's requests (a decoding request's row, a prefill segment's rows) into at
    most `parts` micro-batches of about equal rows (longest first to the least loaded, the
    LPT rule of Graham 1969). The step's cache operations go with the first micro-batch; the
    order of rows inside a micro-batch follows the step's (decode rows first); a prefill
    segment keeps its image blocks, and its image rows and multimodal rotary positions go
    with it. A micro-batch's logit rows keep the order they have in the step.

    Raises:
        ValueError: `parts` < 1.
    """
    if parts < 1:
        raise ValueError("parts must be at least 1")
    # Items: (rows in the step, decode index or None, prefill segment or None).
    items: list[tuple[range, int | None, PrefillSegment | None]] = [
        (range(index, index + 1), index, None) for index in range(len(step.decode_slots))
    ]
    items += [
        (range(segment.offset, segment.offset + segment.length), None, segment)
        for segment in step.prefill
    ]
    parts = max(1, min(parts, len(items)))
    loads = [(0, part) for part in range(parts)]
    assigned: list[list[int]] = [[] for _ in range(parts)]
    for item in sorted(range(len(items)), key=lambda index: -len(items[index][0])):
        load, part = heapq.heappop(loads)
        assigned[part].append(item)
        heapq.heappush(loads, (load + len(items[item][0]), part))
    logit_index = {row: order for order, row in enumerate(step.logit_rows)}
    micro_batches: list[MicroBatch] = []
    for part, members in enumerate(assigned):
        if not members:
            continue
        members.sort()  # decode items (lower indices) first, each kind in the step's order
        slots: list[int] = []
        positions: list[int] = []
        segments: list[PrefillSegment] = []
        rows: list[int] = []
        for member in members:
            step_rows, decode, segment = items[member]
            if decode is not None:
                slots.append(step.decode_slots[decode])
                positions.append(step.decode_positions[decode])
            else:
                assert segment is not None
                segments.append(
                    PrefillSegment(
                        segment.slot, segment.start, len(rows), segment.length,
                        segment.image_blocks,
                    )
                )  # fmt: skip
            rows.extend(step_rows)
        # In the step's logit order (a draft's rows, laid out last position first, keep
        # their position order: the last rank verifies them in it, `last_rank_sampling`).
        local_logits = sorted(
            (local for local, row in enumerate(rows) if row in logit_index),
            key=lambda local: logit_index[rows[local]],
        )
        samplings = (
            tuple(step.samplings[logit_index[rows[local]]] for local in local_logits)
            if step.samplings
            else ()
        )
        local_row = {row: local for local, row in enumerate(rows)}
        image_rows = tuple(
            (local_row[row], count) for row, count in step.image_rows if row in local_row
        )
        rotary: tuple[int, ...] = ()
        if step.rotary_positions:  # each of the three position rows, at this batch's rows
            rotary = tuple(
                step.rotary_positions[axis * step.rows + row] for axis in range(3) for row in rows
            )
        header = StepHeader(
            STEP,
            step.cache_ops if not micro_batches else (),
            tuple(slots),
            tuple(positions),
            tuple(segments),
            tuple(step.input_ids[row] for row in rows),
            tuple(step.position_ids[row] for row in rows),
            tuple(local_logits),
            samplings,
            image_rows,
            step.image_width if image_rows else 0,
            rotary,
        )
        order = tuple(logit_index[rows[local]] for local in local_logits)
        micro_batches.append(MicroBatch(header, order, tuple(rows)))
        del part
    return micro_batches


class _Stage:
    """One pipeline rank's layers, called by `forward_batch` as if they were the whole
    causal LM: the first rank embeds `input_ids`, later ranks take `hidden` `[1, T, hidden]`
    as `inputs_embeds`; a rank before the last returns its hidden states as `logits`."""

    def __init__(self, model: PreTrainedModel, hidden: torch.Tensor | None, is_last: bool):
        self._model = model
        self._hidden = hidden
        self._is_last = is_last

    def __call__(
        self,
        *,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        use_cache: bool,
        logits_to_keep: torch.Tensor,
    ) -> Any:
        tokens = input_ids if self._hidden is None else None
        if self._is_last:
            return self._model(
                input_ids=tokens, inputs_embeds=self._hidden, position_ids=position_ids,
                use_cache=use_cache, logits_to_keep=logits_to_keep,
            )  # fmt: skip
        inner: Any = self._model.model
        hidden = inner(
            input_ids=tokens, inputs_embeds=self._hidden, position_ids=position_ids,
            use_cache=use_cache,
        ).last_hidden_state  # fmt: skip
        return SimpleNamespace(logits=hidden)


def stage_forward_batch(
    model: PreTrainedModel,
    plan: BatchPlan,
    header: StepHeader,
    *,
    hidden: torch.Tensor | None,
    is_last: bool,
    device: torch.device,
) -> torch.Tensor:
    """Run this pipeline rank's layers over a (micro-)batch with `batch_attention`.

    Args:
        hidden: `[1, T, hidden]` the previous rank's output (None on the first rank, which
            embeds `header.input_ids`).
        is_last: this rank holds the final norm and LM head.

    Returns:
        `[R, vocab]` float32 logits of `header.logit_rows` on the last rank, else `[1, T,
        hidden]` float32 hidden states for the next rank.
    """
    input_ids, position_ids, logit_rows = (t.to(device) for t in header.tensors())
    lean = lean_step_of(model)
    if lean is not None:
        with torch.inference_mode():
            plan.prepare(device)
            output = lean(
                plan, input_ids[0] if hidden is None else None,
                None if hidden is None else hidden[0], position_ids[0],
                logit_rows if is_last else None,
            )  # fmt: skip
            commit_lengths(plan)
        return output if is_last else output.unsqueeze(0)
    stage = cast(PreTrainedModel, _Stage(model, hidden, is_last))
    output = forward_batch(stage, plan, input_ids, position_ids, logit_rows)
    return output if is_last else output.unsqueeze(0)
