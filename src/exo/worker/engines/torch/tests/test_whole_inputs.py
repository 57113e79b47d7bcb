"""`whole_inputs.whole_input_attention`: independent inputs packed in one step's rows attend
as each does alone (causal SDPA over its own keys), grouped-query heads included."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.batching.whole_inputs import WholeInputs, whole_input_attention


def test_packed_inputs_attend_as_each_alone() -> None:
    torch.manual_seed(0)
    lengths = [3, 1, 7, 5]
    heads, kv_heads, dim = 4, 2, 8
    rows = sum(lengths)
    query = torch.randn(1, heads, rows, dim)
    key = torch.randn(1, kv_heads, rows, dim)
    value = torch.randn(1, kv_heads, rows, dim)
    layout = WholeInputs.of_lengths(lengths, torch.device("cpu"))
    packed = whole_input_attention(layout, query, key, value, scaling=0.3)  # [1, T, heads, dim]
    assert packed.shape == (1, rows, heads, dim)
    start = 0
    for length in lengths:
        span = slice(start, start + length)
        alone = F.scaled_dot_product_attention(
            query[:, :, span], key[:, :, span], value[:, :, span], is_causal=True, scale=0.3,
            enable_gqa=True,
        )  # fmt: skip
        torch.testing.assert_close(packed[0, span], alone[0].transpose(0, 1))
        start += length
    assert torch.isfinite(packed).all()
