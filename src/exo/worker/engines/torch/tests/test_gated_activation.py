"""exo's gated activation (`native/decode_layer.cpp`: act(gate) * up, what the decode layer
and the lean forward's prefill run) against torch's activations: SiLU equal, the tanh
GELU (computed as g sigmoid(2 z)) and the exact GELU within a few float32 ulps of
|gate * up|, at widths with and without a vector tail, over rows split across threads."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from exo.worker.engines.torch.native_int4 import built_int4_kernel

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
    if code == 0:
        assert torch.equal(out, expected)


def test_gated_activation_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 3), 0)
    with pytest.raises(RuntimeError, match="contiguous float32"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 4, dtype=torch.bfloat16), 0)
    with pytest.raises(RuntimeError, match="activation must be"):
        torch.ops.exo_native.gated_activation(torch.ones(2, 4), 3)
