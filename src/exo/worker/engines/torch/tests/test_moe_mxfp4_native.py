"""The native MXFP4 routed-experts call (`direct_forward_moe.NativeMxfp4Experts`,
`native/moe_mxfp4_experts.cpp`) against the per-expert path it replaces (`moe.dispatch`
over `LeanExpert`s of the same `Mxfp4Linear`s with gpt-oss's `ClampedSwiglu`): bit for bit
equal for decode-sized groups (the fused MXFP4 kernel), prefill-sized ones (`block_matmul`
on int8 blocks) and a step mixing both, with one and two threads, with and without biases,
top-k 2 and 4, and an expert-parallel rank's share (experts it does not hold, or no row
chose, add nothing); its int8 blocks are `mxfp4_int8_blocks`'s; it names a bad argument,
and it does not form for experts it has no code for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from exo.worker.engines.torch.model.direct_forward_moe import LeanExpert, NativeMxfp4Experts
from exo.worker.engines.torch.model.direct_forward_parts import Projection
from exo.worker.engines.torch.model.families.gpt_oss import ClampedSwiglu
from exo.worker.engines.torch.model.moe import ExpertFunction, dispatch
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.mxfp4 import (
    NATIVE_MAX_ROWS,
    Mxfp4Linear,
    Mxfp4Projection,
    mxfp4_int8_blocks,
    quantize_mxfp4,
)
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, native_int4_kernel

HIDDEN = 256
# 18 blocks of 32; with ~67 rows an expert's [rows, I] activation passes torch's 32,768-
# element grain, so its operators split over two threads as the per-expert path's do.
INTERMEDIATE = 576
EXPERTS = 6
# A clamp that binds on both sides for these weights (gate and up of std ~0.8).
SWIGLU = ClampedSwiglu(alpha=1.702, limit=0.5)

pytestmark = pytest.mark.skipif(
    native_int4_kernel() is None, reason="exo's native kernels are not built here"
)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _mxfp4(
    out_features: int, in_features: int, bias: bool, generator: torch.Generator
) -> Mxfp4Linear:
    linear = Mxfp4Linear(in_features, out_features, bias, device="cpu")
    blocks, scales = quantize_mxfp4(
        torch.randn(out_features, in_features, generator=generator) * 0.05
    )
    linear.blocks = nn.Parameter(blocks, requires_grad=False)
    linear.scales = nn.Parameter(scales, requires_grad=False)
    if bias:
        linear.bias = nn.Parameter(
            torch.randn(out_features, generator=generator) * 0.1, requires_grad=False
        )
    return linear


def _experts(bias: bool = True, seed: int = 0) -> list[ExpertFunction | None]:
    generator = torch.Generator().manual_seed(seed)
    experts: list[ExpertFunction | None] = []
    for _ in range(EXPERTS):
        gate, up = (_mxfp4(INTERMEDIATE, HIDDEN, bias, generator) for _ in range(2))
        down = _mxfp4(HIDDEN, INTERMEDIATE, bias, generator)
        experts.append(
            LeanExpert(Mxfp4Projection([gate, up]), Mxfp4Projection([down]), None, SWIGLU)
        )
    return experts


def _routing(
    rows: int, per_token: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, HIDDEN, generator=generator)
    experts = torch.stack(
        [torch.randperm(EXPERTS, generator=generator)[:per_token] for _ in range(rows)]
    )
    weights = torch.rand(rows, per_token, generator=generator)
    return x, experts, weights


@pytest.mark.parametrize("per_token", [2, 4], ids=["top-2", "top-4"])
@pytest.mark.parametrize("rows", [1, 3, 24, 200], ids=["decode", "few", "mixed", "prefill"])
def test_native_mxfp4_experts_equal_the_per_expert_path(
    threads: int, rows: int, per_token: int
) -> None:
    """1 and 3 rows: every group through the fused kernel (and some experts with none);
    24 rows: groups of ~8 (top-2) and ~16 (top-4), the fused kernel; 200 rows: ~67 and
    ~133 per expert, prefill's `block_matmul` on int8 blocks."""
    functions = _experts()
    native = NativeMxfp4Experts.of(functions)
    assert native is not None
    x, experts, weights = _routing(rows, per_token, seed=rows * 10 + per_token)
    expected = dispatch(x, experts, weights, functions)
    assert torch.equal(native(x, experts, weights), expected)
    assert expected.abs().sum() > 0


def test_a_step_with_groups_on_both_sides_of_the_fused_kernels_rows(threads: int) -> None:
    """One expert takes more than `NATIVE_MAX_ROWS` rows (`block_matmul`), the others few
    (the fused kernel), one none."""
    functions = _experts(seed=1)
    native = NativeMxfp4Experts.of(functions)
    assert native is not None
    rows = NATIVE_MAX_ROWS + 8
    x, experts, weights = _routing(rows, 2, seed=7)
    experts[:, 0] = 2  # every row chooses expert 2 first
    experts[:, 1] = torch.tensor([0, 1, 3, 4])[torch.arange(rows) % 4]  # expert 5: no row
    expected = dispatch(x, experts, weights, functions)
    assert torch.equal(native(x, experts, weights), expected)


def test_native_mxfp4_experts_without_biases() -> None:
    functions = _experts(bias=False, seed=2)
    native = NativeMxfp4Experts.of(functions)
    assert native is not None
    for rows in (2, 80):
        x, experts, weights = _routing(rows, 2, seed=rows)
        assert torch.equal(native(x, experts, weights), dispatch(x, experts, weights, functions))


def test_native_mxfp4_experts_on_an_expert_rank_sum_to_the_whole() -> None:
    """A rank holding some experts (None for the others) adds only theirs; two ranks'
    parts are each the per-expert path's part and sum to the whole block's output."""
    functions = _experts(seed=3)
    x, experts, weights = _routing(9, 2, seed=2)
    parts = []
    for parity in (0, 1):
        share = [f if index % 2 == parity else None for index, f in enumerate(functions)]
        native = NativeMxfp4Experts.of(share)
        assert native is not None
        part = native(x, experts, weights)
        assert torch.equal(part, dispatch(x, experts, weights, share))
        parts.append(part)
    whole = dispatch(x, experts, weights, functions)
    assert torch.allclose(parts[0] + parts[1], whole, atol=1e-5)
    nothing = NativeMxfp4Experts.of([functions[0]] + [None] * (EXPERTS - 1))
    assert nothing is not None
    unrouted = torch.tensor([[1, 2]])  # expert 0 not chosen: this rank adds nothing
    assert torch.equal(nothing(x[:1], unrouted, weights[:1]), torch.zeros(1, HIDDEN))


def test_native_int8_blocks_are_the_python_ones() -> None:
    """The int8 blocks the native call hands `block_matmul` (`mxfp4_int8_blocks` in
    mxfp4.cpp) equal `quant.mxfp4.mxfp4_int8_blocks`'s for every byte and scale byte."""
    blocks = torch.arange(256, dtype=torch.uint8).view(16, 1, 16).repeat(1, 16, 1)  # [16, 16, 16]
    scales = torch.arange(256, dtype=torch.uint8).view(16, 16)
    values, block_scales = torch.ops.exo_native.mxfp4_int8_blocks(blocks, scales)
    expected_values, expected_scales = mxfp4_int8_blocks(blocks, scales)
    assert torch.equal(values, expected_values)
    assert torch.equal(block_scales.view(torch.int16), expected_scales.view(torch.int16))


def test_the_native_call_names_a_wrong_bias() -> None:
    functions = _experts(seed=4)
    native = NativeMxfp4Experts.of(functions)
    assert native is not None
    held = native.weights[0]
    assert held is not None
    native.weights[0] = (held[0], held[1], (held[2][0][:-1], held[2][1], held[2][2]))
    x, experts, weights = _routing(1, 2, seed=0)
    experts[0] = torch.tensor([0, 1])
    with pytest.raises(
        RuntimeError, match="expert 0's gate bias must be empty or a contiguous float32"
    ):
        native(x, experts, weights)


def test_native_mxfp4_experts_do_not_form_for_other_experts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int4 experts, another gated activation, or the MXFP4 kernels switched off (where the
    per-expert path widens the weight instead): the per-expert path runs."""
    functions = _experts(seed=5)
    first = functions[0]
    assert isinstance(first, LeanExpert)
    other_gate = LeanExpert(first.gate_up, first.down, None, lambda gate, up: gate * up)
    assert NativeMxfp4Experts.of([other_gate, *functions[1:]]) is None
    int4 = LeanExpert(
        Projection([Int4Linear(nn.Linear(HIDDEN, 2 * INTERMEDIATE, bias=False))], False),
        Projection([Int4Linear(nn.Linear(INTERMEDIATE, HIDDEN, bias=False))], False),
        None,
        SWIGLU,
    )
    assert NativeMxfp4Experts.of([int4, *functions[1:]]) is None
    assert NativeMxfp4Experts.of(functions) is not None
    monkeypatch.setenv(NATIVE_INT4_ENV, "0")
    assert NativeMxfp4Experts.of(functions) is None
