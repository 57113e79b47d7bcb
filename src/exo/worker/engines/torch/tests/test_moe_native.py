"""The native routed-experts call (`direct_forward_moe.NativeInt4Experts`,
`native/moe_experts.cpp`) against the per-expert path it replaces (`moe.dispatch` over
`LeanExpert`s of the same int4 linears): bit for bit equal for decode-sized groups (the
int4 decode kernel), prefill-sized ones (`block_matmul`, int16 and int8 activations), both
activations it takes, and an expert-parallel rank's share (experts it does not hold add
nothing); and it refuses experts it has no code for (a gated activation) by not forming.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.model.direct_forward_moe import LeanExpert, NativeInt4Experts
from exo.worker.engines.torch.model.direct_forward_parts import Activation, Projection
from exo.worker.engines.torch.model.moe import ExpertFunction, dispatch
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel

HIDDEN = 256
INTERMEDIATE = 128
EXPERTS = 6
PER_TOKEN = 2

pytestmark = pytest.mark.skipif(
    native_int4_kernel() is None, reason="exo's native int4 kernels are not built here"
)


def _int4(out_features: int, in_features: int) -> Int4Linear:
    linear = nn.Linear(in_features, out_features, bias=False)
    nn.init.normal_(linear.weight, std=0.05)
    return Int4Linear(linear)


def _experts(activation: Activation) -> list[ExpertFunction | None]:
    torch.manual_seed(0)
    return [
        LeanExpert(
            Projection([_int4(INTERMEDIATE, HIDDEN), _int4(INTERMEDIATE, HIDDEN)], False),
            Projection([_int4(HIDDEN, INTERMEDIATE)], False),
            activation,
        )
        for _ in range(EXPERTS)
    ]


def _routing(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=generator)
    experts = torch.stack(
        [torch.randperm(EXPERTS, generator=generator)[:PER_TOKEN] for _ in range(rows)]
    )
    weights = torch.rand(rows, PER_TOKEN, generator=generator)
    return x, experts, weights


@pytest.mark.parametrize("activation", [F.silu, F.gelu], ids=["silu", "gelu"])
@pytest.mark.parametrize("rows", [1, 3, 40], ids=["decode", "few", "prefill"])
def test_native_experts_equal_the_per_expert_path(activation: Activation, rows: int) -> None:
    """1 and 3 rows: every expert's group goes through the decode kernel; 40 rows (about
    13 per expert): through prefill's `block_matmul`."""
    functions = _experts(activation)
    native = NativeInt4Experts.of(functions)
    assert native is not None
    x, experts, weights = _routing(rows, seed=rows)
    expected = dispatch(x, experts, weights, functions)
    assert torch.equal(native(x, experts, weights), expected)
    assert expected.abs().sum() > 0


def test_native_experts_equal_with_int8_prefill_activations() -> None:
    functions = _experts(F.silu)
    for function in functions:
        assert isinstance(function, LeanExpert)
        for projection in (function.gate_up, function.down):
            assert isinstance(projection, Projection) and projection.quantized is not None
            projection.quantized.prefill_activations = "int8"
    native = NativeInt4Experts.of(functions)
    assert native is not None
    x, experts, weights = _routing(48, seed=5)
    int16 = NativeInt4Experts.of(_experts(F.silu))
    assert int16 is not None
    expected = dispatch(x, experts, weights, functions)
    assert torch.equal(native(x, experts, weights), expected)
    assert not torch.equal(int16(x, experts, weights), expected)  # the mode reached the kernel


def test_native_experts_on_an_expert_rank_sum_to_the_whole() -> None:
    """A rank holding some experts (None for the others) adds only theirs; two ranks'
    parts are each the per-expert path's part and sum to the whole block's output."""
    functions = _experts(F.silu)
    x, experts, weights = _routing(9, seed=2)
    first = [f if index % 2 == 0 else None for index, f in enumerate(functions)]
    second = [f if index % 2 == 1 else None for index, f in enumerate(functions)]
    parts = []
    for share in (first, second):
        native = NativeInt4Experts.of(share)
        assert native is not None
        part = native(x, experts, weights)
        assert torch.equal(part, dispatch(x, experts, weights, share))
        parts.append(part)
    whole = dispatch(x, experts, weights, functions)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)
    nothing = NativeInt4Experts.of([functions[0]] + [None] * (EXPERTS - 1))
    assert nothing is not None
    unrouted = torch.tensor([[1, 2]])  # expert 0 not chosen: this rank adds nothing
    assert torch.equal(nothing(x[:1], unrouted, weights[:1]), torch.zeros(1, HIDDEN))


def test_native_experts_do_not_form_for_a_gated_activation() -> None:
    """gpt-oss's clamped SwiGLU (`gated`) has no native code: the per-expert path runs."""
    functions = _experts(F.silu)
    first = functions[0]
    assert isinstance(first, LeanExpert)
    gated = LeanExpert(first.gate_up, first.down, None, lambda gate, up: F.silu(gate) * up)
    assert NativeInt4Experts.of([gated, *functions[1:]]) is None
