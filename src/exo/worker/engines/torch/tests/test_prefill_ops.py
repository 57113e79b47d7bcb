"""exo's prefill operators (`native/decode_layer.cpp`, what the decode layer runs per row)
against torch's:
- the gated activation act(gate) * up: SiLU equal where torch dispatches to AVX2 (else within
  the bound below), the tanh GELU (computed as
  g sigmoid(2 z)) and the exact GELU within a few float32 ulps of |gate * up|, at widths
  with and without a vector tail, over rows split across threads;
- per-head q/k norm and rotary in place (`qk_norm_rotary`): the lean forward's torch
  operators (rms_norm, the weight's product, x cos + x[perm] sin) to float32 rounding,
  with and without the norm, full and partial rotary, the rest of each row untouched."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from exo.worker.engines.torch.model.direct_forward_parts import rotary_tables
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel

pytestmark = pytest.mark.skipif(
    built_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)

# Largest |exo - torch| over |gate * up|: SLEEF's exp (what torch's SiLU calls too) in
# g / (1 + exp(-2 z)) against torch's tanh form measured 2.3e-7; the scalar erf GELU 3.1e-7.
ULPS = 1e-6
ACTIVATIONS = [(0, F.silu), (1, lambda x: F.gelu(x, approximate="tanh")), (2, F.gelu)]


@pytest.mark.parametrize(("code", "reference"), ACTIVATIONS)
@pytest.mark.parametrize(("rows", "intermediate"), [(1, 8), (3, 20), (7, 1536), (130, 2048)])
def test_gated_activation_matches_torch(
    code: int, reference: Callable[[torch.Tensor], torch.Tensor], rows: int, intermediate: int
) -> None:
    generator = torch.Generator().manual_seed(rows + intermediate)
    gate_up = torch.randn(rows, 2 * intermediate, generator=generator) * 4
    special = [0.0, -0.0, 30.0, -30.0, 100.0, -100.0, 1e-20, -1e-20]
    gate_up[0, : min(len(special), intermediate)] = torch.tensor(special[:intermediate])
    out = torch.ops.exo_native.gated_activation(gate_up, code)
    gate, up = gate_up[:, :intermediate], gate_up[:, intermediate:]
    expected = reference(gate) * up
    assert out.shape == (rows, intermediate) and torch.isfinite(out).all()
    bound = ULPS * (gate.abs() * up.abs()) + 1e-30
    assert ((out - expected).abs() <= bound).all()
    if code == 0 and torch.backends.cpu.get_cpu_capability() == "AVX2":
        # The same SLEEF exp at the same vector width as torch's SiLU: equal. (Where torch
        # dispatches to AVX512 its 16-wide kernel rounds differently, within the bound.)
        assert torch.equal(out, expected)


def test_gated_activation_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 3), 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 4, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="activation must be"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 4), 3)


@pytest.mark.parametrize("normed", [True, False])
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(64, 64), (256, 256), (96, 64)])
def test_qk_norm_rotary_matches_the_operators(normed: bool, head_dim: int, rotary_dim: int) -> None:
    generator = torch.Generator().manual_seed(head_dim + rotary_dim)
    rows, heads, kv_heads = 70, 4, 1
    qk_heads = heads + kv_heads
    width = (heads + 2 * kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=generator) * 3
    positions = torch.arange(rows, dtype=torch.float32)[:, None]
    frequencies = positions / 10_000 ** (torch.arange(0, rotary_dim, 2) / rotary_dim)
    angles = torch.cat([frequencies, frequencies], dim=-1)  # [rows, rotary_dim]
    cos, sin, perm = rotary_tables(angles.cos(), angles.sin(), head_dim)
    weight = torch.rand(qk_heads, head_dim, generator=generator) + 0.5
    expected = qkv[:, : qk_heads * head_dim].view(rows, qk_heads, head_dim)
    if normed:
        expected = F.rms_norm(expected, (head_dim,), None, 1e-6) * weight
    expected = expected * cos + expected.index_select(-1, perm) * sin
    values = qkv[:, qk_heads * head_dim :].clone()
    torch.ops.exo_native.qk_norm_rotary(
        qkv, qk_heads, head_dim, weight if normed else None, 1e-6,
        cos.reshape(rows, head_dim), sin.reshape(rows, head_dim), perm,
    )  # fmt: skip
    got = qkv[:, : qk_heads * head_dim].view(rows, qk_heads, head_dim)
    assert (got - expected).abs().max().item() < 1e-5
    assert torch.equal(qkv[:, qk_heads * head_dim :], values)  # the values are untouched


def test_qk_norm_rotary_refuses_what_it_cannot_read() -> None:
    qkv, table, perm = torch.ones(3, 192), torch.ones(3, 64), torch.arange(64)
    with pytest.raises(RuntimeError, match="heads x head_dim"):
        torch.ops.exo_native.qk_norm_rotary(qkv, 4, 64, None, 1e-6, table, table, perm)
    with pytest.raises(RuntimeError, match="cos / sin"):
        torch.ops.exo_native.qk_norm_rotary(qkv, 2, 64, None, 1e-6, table[:2], table, perm)
    with pytest.raises(RuntimeError, match="perm out of range"):
        torch.ops.exo_native.qk_norm_rotary(qkv, 2, 64, None, 1e-6, table, table, perm + 1)
    with pytest.raises(RuntimeError, match="norm must be"):
        torch.ops.exo_native.qk_norm_rotary(qkv, 2, 64, torch.ones(3, 64), 1e-6, table, table, perm)
