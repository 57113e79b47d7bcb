"""`prefill_attention.prefill_attention` (the mask-free split of a chunk's keys into the
earlier ones and the chunk's own, merged by log-sum-exp; or queries in blocks, each to the
keys up to its own last position, where a window cuts) against attention written out in
float64 from its definition; in bfloat16 (`--prefill-activations bf16`) against the same
definition on the bfloat16-rounded inputs."""

from __future__ import annotations

import pytest
import torch

from exo.worker.engines.torch.batching.prefill_attention import (
    PREFILL_QUERY_BLOCK,
    prefill_attention,
)

HEADS, KV_HEADS, DIM, CAPACITY = 4, 2, 16, 1024


def reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(dim) + mask) v per head, float64; query i of head h (position
    start + i) sees key j when j <= start + i and, with a window, j > start + i - window."""
    count, group = queries.shape[2], queries.shape[1] // keys.shape[1]
    q = queries[0].double()  # [heads, n, dim]
    k = keys[0, :, : start + count].double().repeat_interleave(group, dim=0)
    v = values[0, :, : start + count].double().repeat_interleave(group, dim=0)
    scores = q @ k.transpose(1, 2) / DIM**0.5  # [heads, n, keys]
    query_positions = torch.arange(start, start + count)[:, None]
    key_positions = torch.arange(start + count)[None, :]
    visible = key_positions <= query_positions
    if window is not None:
        visible &= key_positions > query_positions - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return (scores.softmax(dim=-1) @ v).unsqueeze(0)


@pytest.mark.parametrize("window", [None, 4, 100, 2 * PREFILL_QUERY_BLOCK + 5])
@pytest.mark.parametrize(
    ("start", "count"),
    [(0, 5), (0, PREFILL_QUERY_BLOCK), (0, PREFILL_QUERY_BLOCK + 1), (0, 300), (37, 300),
     (300, 1), (130, PREFILL_QUERY_BLOCK), (300, 64), (500, 100)],
)  # fmt: skip
def test_prefill_attention_equals_attention_by_its_definition(
    start: int, count: int, window: int | None
) -> None:
    generator = torch.Generator().manual_seed(start * 1000 + count)
    queries = torch.randn(1, HEADS, count, DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator)
    got = prefill_attention(queries, keys, values, start, window, None)
    assert got.shape == (1, HEADS, count, DIM)
    expected = reference(queries, keys, values, start, window)
    assert torch.allclose(got.double(), expected, atol=2e-6, rtol=0)
    # In bfloat16: the inputs rounded, the output in float32 within bfloat16's rounding of
    # the definition on those rounded inputs (a key out of place is off by far more).
    rounded = prefill_attention(queries, keys, values, start, window, None, torch.bfloat16)
    assert rounded.dtype == torch.float32 and rounded.shape == got.shape
    on_rounded = reference(queries.bfloat16(), keys.bfloat16(), values.bfloat16(), start, window)
    assert torch.allclose(rounded.double(), on_rounded, atol=2e-2, rtol=0)
    assert not torch.equal(rounded, got)


def test_prefill_attention_takes_the_given_scale() -> None:
    generator = torch.Generator().manual_seed(1)
    queries = torch.randn(1, HEADS, 200, DIM, generator=generator)
    keys = torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator)
    values = torch.randn(1, KV_HEADS, CAPACITY, DIM, generator=generator)
    scaled = prefill_attention(queries, keys, values, 0, None, 0.5 * DIM**-0.5)
    expected = reference(queries * 0.5, keys, values, 0, None)
    assert torch.allclose(scaled.double(), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("count", [3, 40, 200])
def test_a_long_prefix_with_one_kv_head_in_both_layouts(count: int) -> None:
    """Gemma 3's grouping (4 query heads on 1 KV head) after a 1,000-key prefix: a chunk
    of 3 rows makes one flash task stacked, so its query heads attend as separate tasks;
    40 and 200 rows stack the group (both layouts of `_split_attention`'s earlier keys)."""
    generator = torch.Generator().manual_seed(count)
    start = 1000
    queries = torch.randn(1, 4, count, DIM, generator=generator)
    keys = torch.randn(1, 1, start + count, DIM, generator=generator)
    values = torch.randn(1, 1, start + count, DIM, generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = prefill_attention(queries, keys, values, start, None, None)
    finally:
        torch.set_num_threads(threads)
    expected = reference(queries, keys, values, start, None)
    assert torch.allclose(got.double(), expected, atol=2e-6, rtol=0)
