"""The native routed-experts call (`direct_forward_moe.NativeInt4Experts`,
`native/moe_experts.cpp`) against the per-expert path it replaces (`moe.dispatch` over
`LeanExpert`s of the same int4 linears): bit for bit equal for decode-sized groups (the
int4 decode kernel), prefill-sized ones (`block_matmul`, int16 and int8 activations), both
activations it takes, an expert-parallel rank's share (experts it does not hold add
nothing), experts shared out among threads in decode steps and prompts (one large expert:
not); the routed call (router, routing and experts in one native call) against `moe.route`
then the experts; and it refuses experts it has no code for (a gated activation) by not
forming.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.model.direct_forward_moe import LeanExpert, NativeInt4Experts
from exo.worker.engines.torch.model.direct_forward_parts import Activation, Projection
from exo.worker.engines.torch.model.families.spec import Routing
from exo.worker.engines.torch.model.moe import ExpertFunction, dispatch, route
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
@pytest.mark.parametrize("rows", [1, 3, 40, 90], ids=["decode", "few", "prefill", "prompt"])
def test_native_experts_equal_the_per_expert_path(activation: Activation, rows: int) -> None:
    """1 and 3 rows: every expert's group goes through the decode kernel; 40 and 90 rows
    (about 13 and 30 per expert, shared out among the threads): through prefill's
    `block_matmul`."""
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


@pytest.mark.parametrize(
    "rows", [3, 7, 40, 90, 200], ids=["3-rows", "7-rows", "13-each", "30-each", "67-each"]
)
def test_experts_shared_out_among_threads_equal_one_thread(rows: int) -> None:
    """With at least two chosen experts per thread and few rows each (decode) or none
    with more than a thread's share of the rows (a prompt), the experts are shared out
    among the threads (`moe_parallel.h`), each running whole experts, the largest first,
    and a prompt's weighted sum is split over the threads by columns: the same bits as one
    thread running them one after another, and as the per-expert path."""
    functions = _experts(F.silu)
    native = NativeInt4Experts.of(functions)
    assert native is not None
    x, experts, weights = _routing(rows, seed=11)
    assert len(experts.unique()) >= 4  # two per thread at two threads
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native(x, experts, weights)
        torch.set_num_threads(2)
        shared = native(x, experts, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(shared, alone)
    assert torch.equal(alone, dispatch(x, experts, weights, functions))


def test_one_large_expert_is_not_shared_out() -> None:
    """A prompt whose rows mostly route to one expert (more than a thread's share of this
    rank's choices) keeps one expert after another, each product split over the threads:
    the same bits."""
    functions = _experts(F.silu)
    held = [f if index < 4 else None for index, f in enumerate(functions)]
    native = NativeInt4Experts.of(held)  # an expert rank holding experts 0-3
    assert native is not None
    x, experts, weights = _routing(60, seed=12)
    experts[:, 0] = 0  # every row's first choice: expert 0, 60 of this rank's ~96 choices
    experts[:, 1] = torch.where(experts[:, 1] == 0, 1, experts[:, 1])
    sizes = torch.bincount(experts.reshape(-1), minlength=EXPERTS)[:4]
    assert (sizes > 0).all() and 2 * sizes[0] > sizes.sum()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native(x, experts, weights)
        torch.set_num_threads(2)
        split = native(x, experts, weights)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(split, alone)
    assert torch.equal(alone, dispatch(x, experts, weights, held))


_ROUTINGS = {
    "softmax-normalized": (Routing(EXPERTS, PER_TOKEN, "softmax", normalize=True), False, False),
    "softmax-biased-router": (Routing(EXPERTS, PER_TOKEN, "softmax"), True, False),
    "sigmoid-corrected-scaled": (
        Routing(EXPERTS, PER_TOKEN, "sigmoid", normalize=True, scaling=2.5),
        False,
        True,
    ),
}


@pytest.mark.parametrize("name", list(_ROUTINGS))
@pytest.mark.parametrize("rows", [1, 5, 40], ids=["decode", "few", "prefill"])
def test_routed_call_equals_route_then_experts(name: str, rows: int) -> None:
    """`NativeInt4Experts.route` (router, routing, grouping and experts in one native call)
    gives `moe.route` then the experts bit for bit, for each routing rule it takes; an
    expert rank's share likewise."""
    routing, router_bias, correction = _ROUTINGS[name]
    generator = torch.Generator().manual_seed(rows)
    router = torch.randn(EXPERTS, HIDDEN, generator=generator) * 0.1
    bias = torch.randn(EXPERTS, generator=generator) if router_bias else None
    correction_bias = torch.rand(EXPERTS, generator=generator) if correction else None
    x = torch.randn(rows, HIDDEN, generator=generator)
    functions = _experts(F.silu)
    for share in (functions, [f if index % 2 else None for index, f in enumerate(functions)]):
        native = NativeInt4Experts.of(share)
        assert native is not None
        weights, experts = route(F.linear(x, router, bias), routing, correction_bias)
        expected = native(x, experts, weights)
        assert torch.equal(native.route(x, router, bias, routing, correction_bias), expected)
        assert torch.equal(expected, dispatch(x, experts, weights, share))
    assert expected.abs().sum() > 0


def test_routed_call_refuses_a_router_of_another_size() -> None:
    native = NativeInt4Experts.of(_experts(F.silu))
    assert native is not None
    routing = Routing(EXPERTS, PER_TOKEN, "softmax")
    with pytest.raises(RuntimeError, match="router must be"):
        native.route(torch.randn(1, HIDDEN), torch.randn(EXPERTS + 1, HIDDEN), None, routing, None)
