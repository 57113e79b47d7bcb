"""The attention of a step's prompt chunks (`batch_attention.attend` calls these for every
prefilling request): causal attention over a chunk's queries and its slot's keys without a
prompt x prompt mask, in query blocks (first chunks, sliding windows) or key splits (later
chunks of full attention) so all threads stay busy (flash-attention style: torch's CPU
flash kernel per block); gpt-oss's attention sinks (`sink_attention`); and the
bidirectional blocks of an image's tokens (`image_prefill_attention`).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

# Queries of a prompt's first chunk, or of a chunk whose sliding window cuts its keys, attend
# in blocks of this many positions, each to the keys up to its own last position (a later
# chunk of full attention splits its keys instead: `prefill_attention`). torch's CPU flash
# attention skips keys past the causal diagonal only in blocks of 512 keys, so one call over
# a 512-token chunk computes all 512 x 512 scores; in blocks of 128 it computes 62.5% of
# them, faster at 512 tokens and no slower at 128 or 1024 (figures:
# docs/benchmarks/engine-design-figures.md#prefill_attentionpy).
PREFILL_QUERY_BLOCK = 128
# The most attention scores (queries x heads x keys) one `sink_attention` call of a prompt
# chunk holds (64 MiB of float32): a long prompt's chunk then attends in smaller query
# blocks (gpt-oss-20b's 64 heads over 32k keys: 8 queries per block).
SINK_SCORE_ELEMENTS = 1 << 24


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    scale: float | None = None,
    is_causal: bool = False,
    enable_gqa: bool = True,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`F.scaled_dot_product_attention` (grouped-query) with a learned logit per head in
    each softmax's denominator that attends to nothing: `softmax([q·k * scale..., sink])`
    without the sink's column (gpt-oss's attention sinks, as transformers' gpt-oss eager
    attention computes them; the sink enters after the max, so no large logit overflows).

    Args:
        query: `[B, heads, n, dim]`; key / value: `[B, kv_heads, L, dim]`.
        attn_mask: bool `[B or 1, 1, n, L]` (True: visible), or None.
        is_causal: query i sees keys 0..i + L - n (with `attn_mask` None).
        sinks: `[heads]` float32 logits.

    Returns:
        `[B, heads, n, dim]` in the query's dtype.
    """
    assert sinks is not None and enable_gqa
    batch, heads, count, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scale is None else scale
    # Query head h reads KV head h // group: [B, kv_heads, group * n, dim] against [L, dim].
    grouped = query.reshape(batch, kv_heads, group * count, dim)
    scores = torch.matmul(grouped, key.transpose(-1, -2)).mul_(scale)
    scores = scores.view(batch, heads, count, length)
    if is_causal:
        attn_mask = torch.ones(count, length, dtype=torch.bool, device=query.device).tril_(
            length - count
        )
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, heads, 1, 1)
    peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = (scores - peak).exp_()
    denominator = weights.sum(dim=-1, keepdim=True) + (sink - peak).exp()
    weights = weights.div_(denominator).to(value.dtype)
    out = torch.matmul(weights.view(batch, kv_heads, group * count, length), value)
    return out.view(batch, heads, count, dim)


def image_prefill_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scaling: float | None,
    blocks: tuple[tuple[int, int], ...],
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """A prompt chunk holding image tokens: causal attention, except that the positions of
    one image block see each other both ways, then cut to the sliding window where the
    layer has one (transformers' Gemma 3 masks: full layers `causal OR block`, sliding
    layers `window AND (causal OR block)`). One explicit boolean mask `[n, start + n]` and
    one SDPA call in the queries' dtype: image chunks are short next to long text prompts.

    Args:
        queries: `[1, heads, n, dim]`, positions `start .. start + n - 1`.
        keys / values: `[1, kv_heads, start + n, dim]`, the slot's positions up to the
            chunk's end (widened to the queries' dtype here when the cache is narrower).
        blocks: `(first, end)` position spans of the image blocks the chunk overlaps.

    Raises:
        ValueError: attention sinks (no family with image blocks has them).

    Returns:
        `[1, heads, n, dim]`.
    """
    if sinks is not None:
        raise ValueError("image blocks with attention sinks are not supported")
    count = queries.shape[2]
    device = queries.device
    query_positions = torch.arange(start, start + count, device=device)[:, None]
    key_positions = torch.arange(0, start + count, device=device)[None, :]
    visible = key_positions <= query_positions
    for first, end in blocks:
        visible |= (
            (query_positions >= first) & (query_positions < end)
            & (key_positions >= first) & (key_positions < end)
        )  # fmt: skip
    if window is not None:
        visible &= key_positions > query_positions - window
    keys, values = keys.to(queries.dtype), values.to(queries.dtype)
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=visible, scale=scaling, enable_gqa=True
    )


def prefill_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scaling: float | None,
    dtype: torch.dtype | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of a request's prompt chunk to the keys each position may see: causal,
    within the layer's sliding window.

    On the CPU, where no window cuts the chunk's view (full attention, or a window that
    still holds every key up to the chunk's end), in two mask-free flash-attention calls
    merged by their log-sum-exps (`_split_attention`): the whole chunk to the keys before
    it, and the chunk to itself, causal. Where a window cuts, and for a prompt's first
    chunk (longer than a block), in blocks of `PREFILL_QUERY_BLOCK` queries, each to the
    keys up to its own last position under an additive mask built once per chunk for
    every layer (`_cached_mask_blocks`). Otherwise (attention sinks, values narrower than
    the keys as multi-head latent attention's, another device) in the same blocks under
    boolean masks built per call (`_block_attention`). Neither holds a prompt x prompt score
    matrix: torch's CPU flash attention walks the keys in blocks with an online softmax
    (Dao et al. 2022, "FlashAttention"), so a 32k-token prompt's chunk holds its
    queries, outputs and per-thread score tiles, not `[heads, chunk, 32k]` scores.

    Args:
        queries: `[1, heads, n, dim]`, the queries of positions `start .. start + n - 1`.
        keys / values: `[1, kv_heads, capacity, dim]`, the request's slot, written up to
            position `start + n - 1`.
        start: the position of the chunk's first query (> 0 after a cached prefix or an
            earlier chunk).
        window: the layer's sliding window in tokens (None: full attention).
        scaling: the softmax scale (None: `head_dim ** -0.5`).
        dtype: where given and not the queries' (bfloat16 with `--prefill-activations bf16`),
            the queries and the keys / values they read are rounded to it and attend in
            it (torch's flash attention accumulates in float32; with bfloat16 it multiplies
            on AMX tiles, faster casts included; figures:
            docs/benchmarks/engine-design-figures.md#prefill_attentionpy); the output comes
            back in the queries' dtype.
        sinks: `[heads]` attention-sink logits (`sink_attention`), or None.

    Returns:
        `[1, heads, n, dim]`.
    """
    count = queries.shape[2]
    if dtype is not None and dtype != queries.dtype:
        end = start + count
        first = 0 if window is None else max(0, start - window + 1)
        rounded = prefill_attention(
            queries.to(dtype), keys[:, :, first:end].to(dtype), values[:, :, first:end].to(dtype),
            start - first, window, scaling,
        )  # fmt: skip
        return rounded.to(queries.dtype)
    uncut = window is None or start + count <= window
    same_width = values.shape[3] == queries.shape[3]  # torch's flash kernel needs it
    if sinks is None and same_width and queries.device.type == "cpu":
        if uncut and (start > 0 or count <= PREFILL_QUERY_BLOCK):
            return _split_attention(queries, keys, values, start, scaling)
        return _cached_mask_blocks(queries, keys, values, start, window, scaling)
    block = PREFILL_QUERY_BLOCK
    if sinks is not None:  # `sink_attention` holds its scores: bound them per block
        seen = start + count if window is None else min(start + count, window + block)
        block = max(1, min(block, SINK_SCORE_ELEMENTS // (queries.shape[1] * seen)))
    if count <= block:
        return _block_attention(queries, keys, values, start, window, scaling, sinks)
    output = queries.new_empty(queries.shape)
    for offset in range(0, count, block):
        rows = slice(offset, min(count, offset + block))
        output[:, :, rows] = _block_attention(
            queries[:, :, rows], keys, values, start + offset, window, scaling, sinks
        )
    return output


_cpu_flash_attention = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default


@functools.lru_cache(maxsize=16)
def _block_mask(
    start: int,
    count: int,
    first: int,
    window: int | None,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """`[count, start + count - first]` additive mask (0 visible, -inf hidden) of queries at
    positions `start ..` to keys at `first ..`: key j visible to query i when `j <= i` and,
    with a window, `j > i - window`. Cached: every layer of a step reads the same blocks'
    masks (read-only); a chunk of 512 tokens has four."""
    query_positions = torch.arange(start, start + count, device=device)[:, None]
    key_positions = torch.arange(first, start + count, device=device)[None, :]
    hidden = key_positions > query_positions
    if window is not None:
        hidden |= key_positions <= query_positions - window
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
    return mask.masked_fill_(hidden, float("-inf"))


def _cached_mask_blocks(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scaling: float | None,
) -> torch.Tensor:
    """`prefill_attention` in blocks of `PREFILL_QUERY_BLOCK` queries (CPU), each in one
    call of torch's CPU flash attention to the keys from its window's start to its own
    last position, under `_block_mask` (the query heads of a KV head as a batch over a
    stride-0 view of it: nothing copied).

    The same blocks as `_block_attention`, so the same scores computed (a sliding layer's
    chunk ~1.0x its visible ones; torch skips keys past the diagonal only in blocks of 512
    keys, so one call over a 512-token chunk would compute all of them), but each block's
    mask is built once per chunk for every layer, where `_block_attention` built it (and
    SDPA converted it) in every layer: on Gemma 3 270M 60 mask operators per 512-token
    chunk, each a wake-up of the threads, ~20 ms apiece on a shared 2-core machine
    (docs/benchmarks/2026-12-05-long-prompt.md).

    Args / Returns: as `prefill_attention` (queries in the keys' dtype).
    """
    heads, count, dim = queries.shape[1], queries.shape[2], queries.shape[3]
    kv_heads, value_dim = keys.shape[1], values.shape[3]
    group = heads // kv_heads
    output = queries.new_empty(1, heads, count, value_dim)
    for offset in range(0, count, PREFILL_QUERY_BLOCK):
        rows = slice(offset, min(count, offset + PREFILL_QUERY_BLOCK))
        position = start + offset
        length = rows.stop - offset
        end = position + length
        first = 0 if window is None else max(0, position - window + 1)
        span = end - first
        mask = _block_mask(position, length, first, window, queries.dtype, queries.device)
        grouped = queries[0, :, rows].unflatten(0, (kv_heads, group))  # [kv, group, m, dim]
        block_keys = keys[0, :, first:end].unsqueeze(1).expand(kv_heads, group, span, dim)
        block_values = values[0, :, first:end].unsqueeze(1)
        block_values = block_values.expand(kv_heads, group, span, value_dim)
        attended, _ = _cpu_flash_attention(
            grouped, block_keys, block_values, attn_mask=mask, scale=scaling
        )
        output[:, :, rows] = attended.reshape(1, heads, length, value_dim)
    return output


def _flash_tasks(batch_heads: int, rows: int) -> int:
    """How many parallel tasks torch's CPU flash attention splits a call into: batch x
    heads x query blocks, the blocks 256 rows from 768 rows, 64 from 192, else 32
    (`aten/src/ATen/native/cpu/FlashAttentionKernel.cpp`, torch 2.13)."""
    split = 256 if rows >= 768 else 64 if rows >= 192 else 32
    return batch_heads * -(-rows // split)


def _split_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    scaling: float | None,
) -> torch.Tensor:
    """`prefill_attention` of a chunk that sees every key before it (CPU): the chunk's
    queries to keys `0 .. start - 1` (all visible: no mask; the heads sharing a KV head
    stacked as one `[group x n]` query block, so the keys are read once per KV head and
    nothing is copied into query heads), and to keys `start .. start + n - 1` (the chunk
    itself: a square, so torch's `is_causal` is exactly this causality), each in one call
    of torch's CPU flash attention, which also returns each row's log-sum-exp `l`. The two
    partial softmaxes are merged as `o = o1 exp(l1 - l) + o2 exp(l2 - l)` with `l =
    logaddexp(l1, l2)` (the split-key softmax of FlashAttention-2's and flash-decoding's
    reductions), in float32.

    Compared with blocks of 128 queries under masks (the other path), this makes two calls
    per layer and chunk, builds no `[block, keys]` masks, and reads the earlier keys once
    per chunk rather than once per block; it computes the chunk's whole `n x n` diagonal
    square (torch skips keys past the diagonal only in blocks of 512 keys), a small share
    once the prefix is long. Figures: docs/benchmarks/2026-12-05-long-prompt.md.

    Args / Returns: as `prefill_attention` (queries in the keys' dtype).
    """
    heads, count, dim = queries.shape[1], queries.shape[2], queries.shape[3]
    kv_heads, value_dim = keys.shape[1], values.shape[3]
    group = heads // kv_heads
    end = start + count
    # The chunk to itself: batch = KV heads, heads = the group's query heads, the KV head
    # broadcast over its group by a stride-0 view (no copy).
    chunk_keys = keys[0, :, start:end].unsqueeze(1).expand(kv_heads, group, count, dim)
    chunk_values = values[0, :, start:end].unsqueeze(1)
    chunk_values = chunk_values.expand(kv_heads, group, count, value_dim)
    grouped = queries[0].unflatten(0, (kv_heads, group))  # [kv_heads, group, n, dim]
    diagonal, diagonal_lse = _cpu_flash_attention(
        grouped, chunk_keys, chunk_values, is_causal=True, scale=scaling
    )
    diagonal = diagonal.reshape(1, heads, count, value_dim)
    if start == 0:
        return diagonal
    if _flash_tasks(kv_heads, group * count) >= min(torch.get_num_threads(), heads):
        # query head h = (kv, g): the group's rows one block, the keys read once per KV head
        stacked = queries.reshape(1, kv_heads, group * count, dim)
        before, before_lse = _cpu_flash_attention(
            stacked, keys[:, :, :start], values[:, :, :start], scale=scaling
        )
    else:  # a few rows (a chunk beside decodes): one task per query head keeps threads busy
        before_keys = keys[0, :, :start].unsqueeze(1).expand(kv_heads, group, start, dim)
        before_values = values[0, :, :start].unsqueeze(1)
        before_values = before_values.expand(kv_heads, group, start, value_dim)
        before, before_lse = _cpu_flash_attention(
            grouped, before_keys, before_values, scale=scaling
        )
    before = before.reshape(1, heads, count, value_dim).float()
    before_lse = before_lse.reshape(1, heads, count, 1)
    diagonal_lse = diagonal_lse.reshape(1, heads, count, 1)
    total = torch.logaddexp(before_lse, diagonal_lse)
    merged = before.mul_((before_lse - total).exp_())
    merged.addcmul_(diagonal.float(), (diagonal_lse - total).exp_())
    return merged.to(queries.dtype)


def _block_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    start: int,
    window: int | None,
    scaling: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prefill_attention` of one block, in one SDPA call (`sink_attention` with sinks)."""
    end = start + queries.shape[2]
    first = 0 if window is None else max(0, start - window + 1)
    block_keys, block_values = keys[:, :, first:end], values[:, :, first:end]
    if sinks is not None:
        query_positions = torch.arange(start, end, device=queries.device)[:, None]
        key_positions = torch.arange(first, end, device=queries.device)[None, :]
        visible = key_positions <= query_positions
        if window is not None:
            visible &= key_positions > query_positions - window
        return sink_attention(queries, block_keys, block_values, visible, scaling, sinks=sinks)
    if start == 0 and (window is None or end <= window):  # plain causal: no mask to build
        return F.scaled_dot_product_attention(
            queries, block_keys, block_values, is_causal=True, scale=scaling, enable_gqa=True
        )
    query_positions = torch.arange(start, end, device=queries.device)[:, None]
    key_positions = torch.arange(first, end, device=queries.device)[None, :]
    visible = key_positions <= query_positions  # [n, keys]
    if window is not None:
        visible &= key_positions > query_positions - window
    return F.scaled_dot_product_attention(
        queries, block_keys, block_values, attn_mask=visible, scale=scaling, enable_gqa=True
    )
