"""`batch_attention.prefill_attention` (queries in blocks, each to the keys up to its own
last position) against attention written out in float64 from its definition; in bfloat16
(`--prefill-activations bf16`) against the same definition on the bfloat16-rounded inputs."""

from __future__ import annotations

import pytest
import torch

from exo.worker.engines.torch.batching.batch_attention import PREFILL_QUERY_BLOCK, prefill_attention

HEADS, KV_HEADS, DIM, CAPACITY = 4, 2, 16, 1024


def reference(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int | None
) -> torch.Tensor:
    """softmax(q k^T / sqrt(dim) + mask) v per head, float64; query i of head h (position
    start + i) sees key j when j <= start + i and, with a window, j > start + i - window."""
    count = queries.shape[2]
    q = queries[0].double()  # [heads, n, dim]
    k = keys[0, :, : start + count].double().repeat_interleave(HEADS // KV_HEADS, dim=0)
    v = values[0, :, : start + count].double().repeat_interleave(HEADS // KV_HEADS, dim=0)
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
     (300, 1), (130, PREFILL_QUERY_BLOCK)],
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
