"""One forward pass over a batch of requests: their KV slots and the attention that keeps
them apart.

The step's new tokens of every running request (one per decoding request, a chunk of the
prompt per prefilling one) are flattened into one `[1, T]` sequence with per-request
`position_ids`, so the decoder layers' linears and MLPs run once over all `T` rows. Only
attention must know where one request ends: the model is switched to the attention
implementation `BATCHED_ATTENTION` (registered through transformers' `AttentionInterface`),
which, while a `BatchPlan` is active, writes each request's new keys/values into that
request's slot of `SlotKVCache` and attends each request's queries to its own keys only
(causal within its new tokens, within the layer's sliding window). Outside a plan (the
multi-rank engines' sessions) it is transformers' SDPA attention, with SDPA's masks.

Decoding requests attend in one SDPA call over the slots `[S, kv_heads, max_len, head_dim]`
(a view of the cache: nothing is copied) with a `[S, 1, 1, max_len]` key-validity mask;
each prefill chunk attends in its own call (a handful per step). This is the layout of
vLLM's "continuous batching" (Yu et al. 2022, "Orca", iteration-level scheduling) with
contiguous per-request buffers instead of paged blocks.

A model with a lean step attached (`attach_lean_step`, see `model/direct_forward.py`) runs that
instead of transformers' forward; it calls `attend` directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import (
    ALL_MASK_ATTENTION_FUNCTIONS,
    AttentionMaskInterface,
    sdpa_mask,
)

from exo.worker.engines.torch.batching.prefill_attention import (
    image_prefill_attention,
    prefill_attention,
    sink_attention,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.whole_inputs import WholeInputs, whole_input_attention
from exo.worker.engines.torch.quant.quantized_linear import DECODE_ROWS

BATCHED_ATTENTION = "exo_batched"


@dataclass(frozen=True, slots=True)
class PrefillSegment:
    """A chunk of one request's prompt in the flattened step: rows `offset .. offset + n`
    go to positions `start .. start + n` of `slot`. `image_blocks`: the `(first, end)`
    position spans of the images the chunk overlaps, whose tokens attend to each other in
    both directions (`prompt_images`)."""

    slot: int
    start: int
    offset: int
    length: int
    image_blocks: tuple[tuple[int, int], ...] = ()


@dataclass(slots=True)
class BatchPlan:
    """Where each row of the flattened step goes.

    Rows `0 .. len(decode_slots) - 1` are decode rows, one token each at position
    `decode_positions[i]` of slot `decode_slots[i]`: one per decoding request (slots in
    ascending order), except that a request verifying a speculative draft has a row per
    draft position and one more (`repeated_slots`; `step_layout.py` lays them out from the
    last position down). Every decode row attends, as a decode row, to its slot's keys up
    to its own position (the step's keys written first). Prefill segments follow.
    """

    cache: SlotKVCache
    windows: Sequence[int | None]  # per layer: sliding window in tokens, None for full
    decode_slots: list[int]
    decode_positions: list[int]
    prefill: list[PrefillSegment]
    layer_of: dict[int, int]  # id(attention module) -> layer index in the cache
    # Filled by `prepare`:
    decode_index: torch.Tensor | None = None  # [D] slots (int64)
    decode_pos: torch.Tensor | None = None  # [D] positions (int64)
    # window -> [S, 1, 1, max_len] bool, None where every key up to max_len is visible
    masks: dict[int | None, torch.Tensor | None] | None = None
    max_len: int = 0  # keys the decode rows attend over (the longest decoding slot's)
    all_slots_decode: bool = False
    # Some slot has several decode rows (a speculative draft's): `masks` are then per
    # decode row, `[D, 1, 1, max_len]`, and the rows read their slots' keys by index.
    repeated_slots: bool = False
    # (row, [n, hidden] float32): embeddings that replace those of rows row .. row + n - 1
    # (an image's projected vision features; read by the first rank's embedding step).
    row_embeddings: list[tuple[int, torch.Tensor]] = field(default_factory=list)
    # [3, T] int64: each row's multimodal rotary positions (temporal, height, width) where
    # some request of the step has them (`prompt_images.MultimodalPositions`; the others'
    # rows repeat their position), else None: rotary positions are the cache positions.
    rotary_positions: torch.Tensor | None = None
    # Set where the prefill segments are independent whole inputs from position 0 whose
    # keys no later step reads (embeddings): `attend` then runs `whole_input_attention`.
    whole_inputs: WholeInputs | None = None

    def prepare(self, device: torch.device) -> None:
        """Index tensors and the decode masks, once per step (shared by every layer); the
        step's decode row count for the quantized linears (`quantized_linear.DECODE_ROWS`)."""
        DECODE_ROWS.set(len(self.decode_slots))
        if not self.decode_slots:
            return
        self.decode_index = torch.tensor(self.decode_slots, dtype=torch.long, device=device)
        self.decode_pos = torch.tensor(self.decode_positions, dtype=torch.long, device=device)
        occupied = self.cache.occupied
        self.repeated_slots = len(set(self.decode_slots)) < len(self.decode_slots)
        if self.repeated_slots:
            self._prepare_row_masks(device)
            return
        self.all_slots_decode = self.decode_slots == list(range(occupied))
        # Key positions visible to each slot's new token: those written so far, this one
        # included; other slots' rows are never read.
        ends = torch.zeros(occupied, dtype=torch.long, device=device)
        ends[self.decode_index] = self.decode_pos + 1
        max_len = int(ends.max().item())
        self.max_len = max_len
        keys = torch.arange(max_len, device=device)  # [max_len]
        self.masks = {}
        # One decoding slot that sees all its keys (the single-stream case) needs no mask:
        # SDPA then skips turning a boolean mask into an additive one in every layer.
        single = occupied == 1
        for window in set(self.windows):
            if single and (window is None or max_len <= window):
                self.masks[window] = None
                continue
            visible = keys[None, :] < ends[:, None]  # [S, max_len]
            if window is not None:
                visible &= keys[None, :] > ends[:, None] - 1 - window
            self.masks[window] = visible[:, None, None, :]

    def _prepare_row_masks(self, device: torch.device) -> None:
        """`masks` per decode row (`repeated_slots`): row i sees its slot's keys up to
        `decode_positions[i]`, within each window."""
        assert self.decode_pos is not None
        ends = self.decode_pos + 1  # [D]
        self.max_len = int(ends.max().item())
        self.all_slots_decode = False
        keys = torch.arange(self.max_len, device=device)
        self.masks = {}
        for window in set(self.windows):
            visible = keys[None, :] < ends[:, None]  # [D, max_len]
            if window is not None:
                visible &= keys[None, :] > ends[:, None] - 1 - window
            self.masks[window] = visible[:, None, None, :]


_active_plan: BatchPlan | None = None


def batched_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The attention of `BATCHED_ATTENTION` (transformers' attention-function signature).

    Args:
        query: `[1, heads, T, head_dim]` the step's queries (rotary applied).
        key / value: `[1, kv_heads, T, head_dim]` the step's new keys/values (no cache is
            passed to the model in a batched step, so these are only the new rows).

    Returns:
        `[1, T, heads, head_dim]` attention output, and no weights.
    """
    plan = _active_plan
    sinks = kwargs.pop("s_aux", None)  # gpt-oss's attention sinks, `[heads]`
    if plan is None:
        if sinks is not None:
            raise NotImplementedError("attention sinks outside a batched step")
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if plan.cache.latent_values:
        raise RuntimeError("a latent (MLA) KV cache is written by the lean forward only")
    layer = plan.layer_of[id(module)]
    return attend(plan, layer, query, key, value, scaling, sinks=sinks), None


def attend(
    plan: BatchPlan,
    layer: int,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    prefill_dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
    row_kernel: bool = False,
) -> torch.Tensor:
    """Write the step's new keys/values of decoder layer `layer` into the plan's slots and
    attend each request's queries to its own keys (a plan of `whole_inputs`, where the
    layer's window, if any, cuts none of them: one padded call, nothing written).

    Args:
        query: `[1, heads, T, head_dim]` (rotary applied; any strides).
        key / value: `[1, kv_heads, T, head_dim]` the step's new rows, in the queries'
            dtype: written rounded to the cache's where it is narrower (a bfloat16 cache;
            the keys and values read are widened back, so products and sums stay in the
            queries' dtype) (with the cache's `latent_values`, values are the keys' first
            values and are not written: `value` is read for its width only).
        scaling: the softmax scale (None: `head_dim ** -0.5`).
        prefill_dtype: the dtype prompt chunks attend in (`prefill_attention`; None: the
            queries'). Decode rows always attend in the queries'.
        sinks: `[heads]` learned logits joining each query's softmax denominator
            (gpt-oss; `sink_attention`), None for plain attention.
        row_kernel: each prompt chunk's last row attends by exo's row kernel
            (`last_row_attention`; float32 queries, exo's kernels loaded), not with its chunk.

    Returns:
        `[1, T, heads, value head_dim]` attention output.
    """
    window = plan.windows[layer]
    whole = plan.whole_inputs
    if (
        whole is not None
        and (window is None or whole.longest <= window)
        and sinks is None
        and not plan.cache.latent_values
    ):  # independent whole inputs: one padded call, nothing written (`whole_inputs`)
        return whole_input_attention(whole, query, key, value, scaling)
    keys, values = plan.cache.keys[layer], plan.cache.values[layer]
    write_values = not plan.cache.latent_values
    if key.dtype != keys.dtype:  # a bfloat16 cache: store rounded, read widened
        key, value = key.to(keys.dtype), value.to(keys.dtype)
    output = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3])
    decoding = len(plan.decode_slots)
    if decoding:
        assert plan.decode_index is not None and plan.decode_pos is not None
        assert plan.masks is not None
        if decoding == 1:  # a plain copy, not an indexed write
            slot, position = plan.decode_slots[0], plan.decode_positions[0]
            keys[slot, :, position] = key[0, :, 0]
            if write_values:
                values[slot, :, position] = value[0, :, 0]
        else:
            new_keys = key[0, :, :decoding].transpose(0, 1)  # [D, kv_heads, head_dim]
            keys[plan.decode_index, :, plan.decode_pos] = new_keys
            if write_values:
                new_values = value[0, :, :decoding].transpose(0, 1)
                values[plan.decode_index, :, plan.decode_pos] = new_values
        mask = plan.masks[window]  # [S or D, 1, 1, max_len] or None (all visible)
        max_len = plan.max_len
        occupied = plan.cache.occupied
        queries = query[0, :, :decoding].transpose(0, 1).unsqueeze(2)  # [D, heads, 1, dim]
        if plan.repeated_slots:  # a draft's rows: each row its slot's keys (gathered)
            keys_read = keys[plan.decode_index, :, :max_len]  # [D, kv_heads, max_len, dim]
            values_read = values[plan.decode_index, :, :max_len]
        else:
            if not plan.all_slots_decode:  # a prefilling request holds a slot between them
                full = query.new_zeros(occupied, *queries.shape[1:])
                full[plan.decode_index] = queries
                queries = full
            keys_read = keys[:occupied, :, :max_len]
            values_read = values[:occupied, :, :max_len]
        if keys_read.dtype != queries.dtype:
            keys_read, values_read = keys_read.to(queries.dtype), values_read.to(queries.dtype)
        if sinks is None:
            attended = F.scaled_dot_product_attention(
                queries, keys_read, values_read, attn_mask=mask, scale=scaling, enable_gqa=True
            )
        else:
            attended = sink_attention(queries, keys_read, values_read, mask, scaling, sinks=sinks)
        # attended: [S or D, heads, 1, dim]
        if not plan.all_slots_decode and not plan.repeated_slots:
            attended = attended[plan.decode_index]
        output[0, :decoding] = attended[:, :, 0]
    for segment in plan.prefill:
        rows = slice(segment.offset, segment.offset + segment.length)
        end = segment.start + segment.length
        keys[segment.slot, :, segment.start : end] = key[0, :, rows]
        if write_values:
            values[segment.slot, :, segment.start : end] = value[0, :, rows]
        slot_keys = keys[segment.slot : segment.slot + 1]
        slot_values = values[segment.slot : segment.slot + 1]
        start = segment.start
        if segment.image_blocks:
            attended = image_prefill_attention(
                query[:, :, rows], slot_keys[:, :, :end], slot_values[:, :, :end], start,
                window, scaling, segment.image_blocks, sinks,
            )  # fmt: skip
            output[0, rows] = attended[0].transpose(0, 1)
            continue
        # The chunk's last row by exo's row kernel (`last_row_attention`); a chunk of one
        # row (a prompt's last token after a prefix-cache hit) needs nothing else.
        exact = row_kernel and sinks is None and write_values
        last = segment.offset + segment.length - 1
        if exact and segment.length == 1:
            output[0, last] = last_row_attention(
                query[0, :, last], keys, values, segment.slot, end - 1, window, scaling
            )
            continue
        if slot_keys.dtype != query.dtype and (prefill_dtype is None or sinks is not None):
            # A bfloat16 cache: the positions this chunk sees, widened to the queries' dtype.
            first = 0 if window is None else max(0, start - window + 1)
            slot_keys = slot_keys[:, :, first:end].to(query.dtype)
            slot_values = slot_values[:, :, first:end].to(query.dtype)
            start -= first
        attended = prefill_attention(
            query[:, :, rows],
            slot_keys,
            slot_values,
            start,
            window,
            scaling,
            None if sinks is not None else prefill_dtype,
            sinks,
        )
        output[0, rows] = attended[0].transpose(0, 1)
        if exact:
            output[0, last] = last_row_attention(
                query[0, :, last], keys, values, segment.slot, end - 1, window, scaling
            )
    return output


def last_row_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slot: int,
    position: int,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """One prompt row's attention to its slot's keys up to `position` by exo's row kernel
    (`native/decode_attention.cpp`), whose arithmetic depends on that row and its keys
    only. torch's flash attention gives a row other bits (~1e-7) with each number of rows
    in its query block, so the prompt's last row (the one whose logits are sampled) would
    differ between a cold prefill's chunk and the row left alone after a prefix-cache hit;
    attending every prompt row this way would make any chunking exact but cost far more
    than the ~2 % allowed (figures: docs/benchmarks/2026-12-07-seeded-prefix-cache.md).

    Args:
        query: `[heads, head_dim]` float32, rotary applied.
        keys / values: the layer's cache `[slots, kv_heads, capacity, head_dim]` (float32
            or bfloat16), written up to `position`.

    Returns:
        `[heads, head_dim]` float32.
    """
    heads, head_dim = query.shape
    scale = head_dim**-0.5 if scaling is None else scaling
    slots = torch.tensor([slot], dtype=torch.long)
    positions = torch.tensor([position], dtype=torch.long)
    attended: torch.Tensor = torch.ops.exo_native.decode_attention_of(
        query.reshape(1, heads * head_dim).contiguous(), keys, values, slots, positions,
        heads, window or 0, scale,
    )  # fmt: skip
    return attended.view(heads, head_dim)


def _batched_mask(*args: Any, **kwargs: Any) -> Any:
    """SDPA's mask outside a batched step; none inside (the attention builds its own)."""
    if _active_plan is not None:
        return None
    return sdpa_mask(*args, **kwargs)


def use_batched_attention(model: PreTrainedModel) -> None:
    """Switch `model` to `BATCHED_ATTENTION` (SDPA behaviour outside a `BatchPlan`)."""
    AttentionInterface.register(BATCHED_ATTENTION, batched_attention_forward)
    AttentionMaskInterface.register(BATCHED_ATTENTION, _batched_mask)
    assert BATCHED_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS
    model.set_attn_implementation(BATCHED_ATTENTION)


def attention_layers(model: PreTrainedModel) -> dict[int, int]:
    """id(attention module) -> index of its decoder layer among this shard's layers."""
    layers: Any = model.model.layers
    return {id(layer.self_attn): index for index, layer in enumerate(layers)}


@torch.inference_mode()
def forward_batch(
    model: PreTrainedModel,
    plan: BatchPlan,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    logit_rows: torch.Tensor,
) -> torch.Tensor:
    """Run one batched step.

    Args:
        input_ids / position_ids: `[1, T]` int64, rows laid out as `plan` says.
        logit_rows: `[R]` int64 rows whose logits are wanted.

    Returns:
        `[R, vocab]` float32 logits.
    """
    global _active_plan
    plan.prepare(input_ids.device)
    lean = lean_step_of(model)
    if lean is not None:
        logits = lean(plan, input_ids[0], None, position_ids[0], logit_rows)
        commit_lengths(plan)
        return logits
    images = plan.row_embeddings or any(segment.image_blocks for segment in plan.prefill)
    if images or plan.rotary_positions is not None:  # (multimodal positions: decode too)
        raise RuntimeError("image tokens need the direct forward (transformers' forward is on)")
    _active_plan = plan
    try:
        output = model(
            input_ids=input_ids, position_ids=position_ids, use_cache=False,
            logits_to_keep=logit_rows,
        )  # fmt: skip
    finally:
        _active_plan = None
    commit_lengths(plan)
    logits = output.logits[0].float()
    return logits


def commit_lengths(plan: BatchPlan) -> None:
    """After a step: every slot it wrote holds its new positions (`SlotKVCache.commit`:
    its windowed layers drop what their windows no longer see). A slot with several decode
    rows (a speculative draft's) holds only its first row's position: the draft's are
    committed once verified (the scheduler's `SlotKVCache.commit` of the accepted ones),
    so a rejected position never counts as held nor moves a window's trim; until then the
    slot carries them along where it moves (`SlotKVCache.hold_unverified`)."""
    for segment in plan.prefill:
        plan.cache.commit(segment.slot, segment.start + segment.length)
    first: dict[int, int] = {}
    last: dict[int, int] = {}
    for slot, position in zip(plan.decode_slots, plan.decode_positions, strict=True):
        first[slot] = min(position, first.get(slot, position))
        last[slot] = max(position, last.get(slot, position))
    for slot, position in first.items():
        plan.cache.commit(slot, position + 1)
        if last[slot] > position:
            plan.cache.hold_unverified(slot, last[slot] + 1)


class LeanStep(Protocol):
    """A model's own batched step (`direct_forward.LeanModel`), attached with
    `attach_lean_step`: `(plan, input_ids [T] or None, hidden [T, hidden] float32 or None,
    position_ids [T], logit_rows [R] or None)` -> `[R, vocab]` float32 logits, or `[T,
    hidden]` float32 hidden states when `logit_rows` is None (a pipeline rank before the
    last). The plan is prepared by the caller, which also commits the lengths."""

    enabled: bool

    def __call__(
        self,
        plan: BatchPlan,
        input_ids: torch.Tensor | None,
        hidden: torch.Tensor | None,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor | None,
    ) -> torch.Tensor: ...


_LEAN_ATTRIBUTE = "_exo_lean_step"


def attach_lean_step(model: torch.nn.Module, step: LeanStep | None) -> None:
    """Make `forward_batch` run `step` for `model` (None: transformers' forward again)."""
    model.__dict__[_LEAN_ATTRIBUTE] = step


def lean_step_of(model: Any) -> LeanStep | None:
    """The enabled lean step attached to `model`, if any."""
    step: LeanStep | None = getattr(model, "__dict__", {}).get(_LEAN_ATTRIBUTE)
    return step if step is not None and step.enabled else None
