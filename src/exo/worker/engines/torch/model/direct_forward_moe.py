"""A MoE block as the direct forward holds it (`LeanMoe`): the router's weight, the routing
rules and, per expert this rank holds, its fused gate/up and down projections (dense or
quantized, as `Projection` holds any linear), read once from the loaded `RoutedExperts`.

A step's rows are routed and grouped by expert (`moe.dispatch`): each chosen expert's
weights are read once for all of its rows. Where every held expert is a plain gated MLP of
exo's native int4 linears (Qwen3-MoE, Mixtral, ... quantized to int4), all of a step's
chosen experts run in one native call (`NativeInt4Experts`, `native/moe_experts.cpp`), the
same products bit for bit without a Python call per expert, and where the routing is not
group-limited the router, the routing and the grouping in that same call too
(`NativeInt4Experts.route`); gpt-oss's MXFP4 experts (biased, clamped SwiGLU) likewise
(`NativeMxfp4Experts`, `native/moe_mxfp4_experts.cpp`), routed in Python. In a decode step
the native calls share the chosen experts out among the threads (`native/moe_parallel.h`).
A rank holding part of the block (a tensor rank's slices of every expert, an expert rank's
experts) all-reduces the summed output once.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.direct_forward_parts import (
    Activation,
    LeanUnsupportedError,
    Projection,
    activation_code,
    mlp_activation,
)
from exo.worker.engines.torch.model.families import ModelFamily
from exo.worker.engines.torch.model.families.gpt_oss import ClampedSwiglu
from exo.worker.engines.torch.model.families.spec import ExpertActivation, Routing
from exo.worker.engines.torch.model.moe import (
    GATED_MLP_NAMES,
    ExpertFunction,
    RoutedExperts,
    dispatch,
    route,
    router_bias,
    router_weight,
)
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.mxfp4 import NATIVE_MAX_ROWS, Mxfp4Linear, Mxfp4Projection
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel, native_int4_kernel
from exo.worker.engines.torch.quant.quantized_linear import DECODE_ROWS


class LeanExpert:
    """One expert's `down(act(gate(x)) * up(x))` over `[n, hidden]` float32 rows, or
    `down(gated(gate(x), up(x)))` with the family's gated activation (gpt-oss); biases as
    the linears have them."""

    __slots__ = ("activation", "down", "gate_up", "gated")

    def __init__(
        self,
        gate_up: Projection | Mxfp4Projection,
        down: Projection | Mxfp4Projection,
        activation: Activation | None,
        gated: ExpertActivation | None = None,
    ) -> None:
        self.gate_up = gate_up
        self.down = down
        self.activation = activation
        self.gated = gated

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up(rows.to(self.gate_up.in_dtype))  # [n, 2 * intermediate]
        middle = gate_up.shape[-1] // 2
        if self.gated is not None:
            activated = self.gated(gate_up[:, :middle], gate_up[:, middle:])
        else:
            assert self.activation is not None
            activated = self.activation(gate_up[:, :middle]).mul_(gate_up[:, middle:])
        return self.down(activated.to(self.down.in_dtype)).float()


class LeanSharedExpert:
    """A MoE block's shared expert (`MixtureOfExperts.shared_expert`: a gated MLP every
    row goes through, DeepSeek-V3's and GLM-4.5's `shared_experts`), over `[T, hidden]`
    float32 rows. On a tensor rank its down projection gives a partial sum (`partial`),
    left for the caller to all-reduce with the routed experts' in one collective.
    """

    __slots__ = ("expert", "partial")

    def __init__(self, mlp: nn.Module, bf16: bool) -> None:
        gate, up, down_name = GATED_MLP_NAMES
        gate_up = Projection([mlp.get_submodule(gate), mlp.get_submodule(up)], bf16)
        down = Projection([mlp.get_submodule(down_name)], bf16)
        if gate_up.reduce:
            raise LeanUnsupportedError("a shared expert's gate/up projection that all-reduces")
        self.partial = down.reduce
        if down.reduce:
            if down.bias is not None or down.parts:
                raise LeanUnsupportedError("a row-parallel shared expert with a bias")
            down.reduce = False  # summed with the routed part, reduced once (`LeanMoe`)
        self.expert = LeanExpert(gate_up, down, mlp_activation(mlp))

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.expert(rows)


def _native_int4(projection: Projection | Mxfp4Projection) -> Int4Linear | None:
    """The projection's exo-layout int4 linear, None where it is anything else (MXFP4,
    torch's int4 layout, unfusable parts, a bias, a row-parallel linear)."""
    if not isinstance(projection, Projection) or projection.parts or projection.reduce:
        return None
    linear = projection.quantized
    if not isinstance(linear, Int4Linear) or not linear.native or linear.bias is not None:
        return None
    return linear if projection.bias is None else None


def _product_mode(linear: Int4Linear) -> list[int]:
    """How `linear`'s prefill product rounds activations, as `quantized_linear.
    prefill_product` passes it to `block_matmul`: [activation_bits, int16_rows, bf16]."""
    activations = linear.prefill_activations
    decode_rows = DECODE_ROWS.get() if activations != "int16" else 0
    return [8 if activations == "int8" else 16, decode_rows, int(activations == "bf16")]


def grouped_choices(
    experts: torch.Tensor, weights: torch.Tensor, expert_count: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """A step's routing choices grouped by expert, as the native expert calls take them:
    each choice's row (int64) and weight (float32) in expert order, rows ascending within
    an expert (a stable sort), and the number of choices per expert (`expert_count` long).

    Args:
        experts / weights: `route`'s `[T, k]` choices (int64) and weights."""
    per_token = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)
    row_of = order // per_token
    weight_of = weights.reshape(-1).float().index_select(0, order)
    counts = torch.bincount(flat, minlength=expert_count).tolist()
    return row_of, weight_of, counts


# `Routing.scoring` as `Int4ExpertTable.route` numbers it.
_SCORING = {"softmax": 0, "sigmoid": 1}


class NativeInt4Experts:
    """A MoE block's routed experts, each a gated MLP of exo's native int4 linears (fused
    gate/up `[2 I, hidden]`, down `[hidden, I]`, no biases), run by one native call per
    step (`torch.ops.exo_native.moe_int4_experts`, `native/moe_experts.cpp`) instead of one
    `LeanExpert` call per chosen expert: the same kernels, activation and summation order,
    so the output is `moe.dispatch`'s bit for bit, without ~20 torch operators dispatched
    from Python per expert per layer (a decode step of Qwen3-30B-A3B chooses 8 experts in
    each of its 48 layers).
    """

    __slots__ = (
        "activation", "down", "down_scales", "gate_up", "gate_up_scales", "linears", "table",
    )  # fmt: skip

    def __init__(
        self,
        activation: int,
        linears: list[tuple[Int4Linear, Int4Linear] | None],
    ) -> None:
        self.activation = activation
        self.linears = linears
        self.gate_up = [None if pair is None else pair[0].packed for pair in linears]
        self.gate_up_scales = [
            None if pair is None else pair[0].scales_and_zeros for pair in linears
        ]
        self.down = [None if pair is None else pair[1].packed for pair in linears]
        self.down_scales = [None if pair is None else pair[1].scales_and_zeros for pair in linears]
        # The same weights by expert id, held natively for `route` (routing and experts in
        # one call, `native/moe_experts.cpp` `Int4ExpertTable`).
        held = [expert for expert, pair in enumerate(linears) if pair is not None]
        self.table: Any = torch.classes.exo_native.Int4ExpertTable(
            [self.gate_up[expert] for expert in held],
            [self.gate_up_scales[expert] for expert in held],
            [self.down[expert] for expert in held],
            [self.down_scales[expert] for expert in held],
            held, len(linears), activation,
        )  # fmt: skip

    @classmethod
    def of(cls, experts: list[ExpertFunction | None]) -> NativeInt4Experts | None:
        """The native form of `experts` (per expert id, a `LeanExpert` or None where this
        rank does not hold it), or None where some held expert is not a plain gated MLP of
        native int4 linears with one activation, or the native kernels are not built."""
        linears: list[tuple[Int4Linear, Int4Linear] | None] = []
        activations: set[int] = set()
        for expert in experts:
            if expert is None:
                linears.append(None)
                continue
            if not isinstance(expert, LeanExpert) or expert.gated is not None:
                return None
            if expert.activation is None:
                return None
            try:
                activations.add(activation_code(expert.activation))
            except KeyError:
                return None
            gate_up, down = _native_int4(expert.gate_up), _native_int4(expert.down)
            if gate_up is None or down is None:
                return None
            linears.append((gate_up, down))
        if len(activations) != 1 or built_int4_kernel() is None:
            return None
        if not hasattr(torch.ops.exo_native, "moe_int4_experts"):
            return None
        if not any(pair is not None for pair in linears):
            return None
        return cls(activations.pop(), linears)

    def route(
        self,
        rows: torch.Tensor,
        router: torch.Tensor,
        router_bias: torch.Tensor | None,
        routing: Routing,
        correction_bias: torch.Tensor | None,
    ) -> torch.Tensor:
        """`self(rows, *route(F.linear(rows, router, router_bias), routing,
        correction_bias))` in one native call, bit for bit: the router's product, the
        routing (torch's operators in `moe.route`'s order), the grouping by expert and these
        experts. Not for group-limited routing (`routing.groups` > 1: the caller keeps
        `moe.route`).

        Args:
            rows: `[T, hidden]` float32, the block's normed input.
            router / router_bias: `[experts, hidden]` / `[experts]` float32.

        Returns:
            `[T, hidden]` float32: the sum over each row's held experts of weight × output.
        """
        first = next(pair for pair in self.linears if pair is not None)
        out: torch.Tensor = self.table.route(
            rows.float().contiguous(), router, router_bias, correction_bias,
            _SCORING[routing.scoring], routing.experts_per_token, routing.normalize,
            routing.scaling, _product_mode(first[0]), _product_mode(first[1]),
        )  # fmt: skip
        return out

    def __call__(
        self, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`moe.dispatch(rows, experts, weights, ...)` for these experts.

        Args:
            rows: `[T, hidden]` float32.
            experts / weights: `route`'s `[T, k]` choices (int64) and weights (float32).

        Returns:
            `[T, hidden]` float32: the sum over each row's held experts of weight × output.
        """
        count = experts.shape[0]
        row_of, weight_of, counts = grouped_choices(experts, weights, len(self.linears))
        spans: list[int] = []
        gate_up: list[torch.Tensor] = []
        gate_up_scales: list[torch.Tensor] = []
        down: list[torch.Tensor] = []
        down_scales: list[torch.Tensor] = []
        first: tuple[Int4Linear, Int4Linear] | None = None
        start = 0
        for expert, routed in enumerate(counts):
            if routed == 0:
                continue
            pair = self.linears[expert]
            if pair is not None:
                first = first or pair
                spans += (start, start + routed)
                gate_up.append(self.gate_up[expert])  # type: ignore[arg-type]
                gate_up_scales.append(self.gate_up_scales[expert])  # type: ignore[arg-type]
                down.append(self.down[expert])  # type: ignore[arg-type]
                down_scales.append(self.down_scales[expert])  # type: ignore[arg-type]
            start += routed
        if first is None:
            return torch.zeros(count, rows.shape[-1], dtype=torch.float32)
        # `set_prefill_activations` sets every quantized linear alike.
        out: torch.Tensor = torch.ops.exo_native.moe_int4_experts(
            rows.float().contiguous(), row_of, weight_of.contiguous(), spans,
            gate_up, gate_up_scales, down, down_scales, self.activation,
            _product_mode(first[0]), _product_mode(first[1]),
        )  # fmt: skip
        return out


# One MXFP4 expert as `moe_mxfp4_experts` takes it: its gate, up and down linears' blocks,
# scales and float32 biases (empty: none), in that order.
_Mxfp4Weights = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]
_NO_BIAS = torch.empty(0)


def _mxfp4_weights(expert: LeanExpert) -> _Mxfp4Weights | None:
    """`expert`'s MXFP4 weights as the native call takes them, None where it is not a gate
    and an up `Mxfp4Linear` of one width and a down one back, contiguous. The biases are
    the ones its `Mxfp4Projection`s add (gate and up: both or neither)."""
    gate_up, down = expert.gate_up, expert.down
    if not isinstance(gate_up, Mxfp4Projection) or not isinstance(down, Mxfp4Projection):
        return None
    if len(gate_up.modules) != 2 or len(down.modules) != 1:
        return None
    (gate, up), (down_linear,) = gate_up.modules, down.modules
    width = gate.out_features
    if up.out_features != width or down_linear.in_features != width:
        return None
    linears = (gate, up, down_linear)
    if not all(
        linear.blocks.is_contiguous() and linear.scales.is_contiguous() for linear in linears
    ):
        return None
    gate_bias = up_bias = _NO_BIAS
    if gate_up.bias is not None:
        gate_bias, up_bias = gate_up.bias[:width].contiguous(), gate_up.bias[width:].contiguous()
    down_bias = _NO_BIAS if down.bias is None else down.bias.contiguous()
    return (
        tuple(linear.blocks.detach() for linear in linears),
        tuple(linear.scales.detach() for linear in linears),
        (gate_bias, up_bias, down_bias),
    )


class NativeMxfp4Experts:
    """A MoE block's routed experts held as MXFP4 with gpt-oss's clamped SwiGLU (each a
    gate and an up `Mxfp4Linear` `[I, hidden]` and a down one `[hidden, I]`, biased or
    not), run by one native call per step (`torch.ops.exo_native.moe_mxfp4_experts`,
    `native/moe_mxfp4_experts.cpp`) instead of one `LeanExpert` call per chosen expert:
    the same products (`mxfp4_linear`'s), activation operators and summation order, so the
    output is `moe.dispatch`'s bit for bit, without ~25 torch operators dispatched from
    Python per expert per layer (figures: docs/benchmarks/2026-12-06-mxfp4-experts.md).
    """

    __slots__ = ("activation", "weights")

    def __init__(self, activation: ClampedSwiglu, weights: list[_Mxfp4Weights | None]) -> None:
        self.activation = activation
        self.weights = weights

    @classmethod
    def of(cls, experts: list[ExpertFunction | None]) -> NativeMxfp4Experts | None:
        """The native form of `experts` (per expert id, a `LeanExpert` or None where this
        rank does not hold it), or None where some held expert is not an MXFP4 gate / up /
        down with one `ClampedSwiglu`, or the per-expert path would not take exo's MXFP4
        kernels (`mxfp4_linear`: `native_int4_kernel`)."""
        weights: list[_Mxfp4Weights | None] = []
        activations: set[ClampedSwiglu] = set()
        for expert in experts:
            if expert is None:
                weights.append(None)
                continue
            if not isinstance(expert, LeanExpert) or not isinstance(expert.gated, ClampedSwiglu):
                return None
            held = _mxfp4_weights(expert)
            if held is None:
                return None
            weights.append(held)
            activations.add(expert.gated)
        if len(activations) != 1 or native_int4_kernel() is None:
            return None
        if not hasattr(torch.ops.exo_native, "moe_mxfp4_experts"):
            return None
        return cls(activations.pop(), weights)

    def __call__(
        self, rows: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor
    ) -> torch.Tensor:
        """`moe.dispatch(rows, experts, weights, ...)` for these experts.

        Args:
            rows: `[T, hidden]` float32.
            experts / weights: `route`'s `[T, k]` choices (int64) and weights (float32).

        Returns:
            `[T, hidden]` float32: the sum over each row's held experts of weight × output.
        """
        count = experts.shape[0]
        row_of, weight_of, counts = grouped_choices(experts, weights, len(self.weights))
        spans: list[int] = []
        blocks: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        biases: list[torch.Tensor] = []
        start = 0
        for expert, routed in enumerate(counts):
            if routed == 0:
                continue
            held = self.weights[expert]
            if held is not None:
                spans += (start, start + routed)
                blocks += held[0]
                scales += held[1]
                biases += held[2]
            start += routed
        if not spans:
            return torch.zeros(count, rows.shape[-1], dtype=torch.float32)
        out: torch.Tensor = torch.ops.exo_native.moe_mxfp4_experts(
            rows.float().contiguous(), row_of, weight_of.contiguous(), spans, blocks, scales,
            biases, self.activation.alpha, self.activation.limit, NATIVE_MAX_ROWS,
        )  # fmt: skip
        return out


def _expert_projections(
    expert: nn.Module, family: ModelFamily, bf16: bool
) -> tuple[Projection | Mxfp4Projection, Projection | Mxfp4Projection]:
    """An expert's fused gate/up and its down projection: `Projection`s over its linears,
    or `Mxfp4Projection`s where they are held as MXFP4."""
    moe = family.moe
    assert moe is not None
    gate_up = [expert.get_submodule(path) for path in moe.expert_gate_up]
    down = expert.get_submodule(moe.expert_down)
    held = [linear for linear in (*gate_up, down) if isinstance(linear, Mxfp4Linear)]
    if len(held) == len(gate_up) + 1:
        return Mxfp4Projection(held[:-1]), Mxfp4Projection(held[-1:])
    return Projection(gate_up, bf16), Projection([down], bf16)


class LeanMoe:
    """One decoder layer's MoE block (`family.moe`), called on the normed `[T, hidden]`
    float32 rows; returns the block's `[T, hidden]` float32 output (whole: reduced over the
    group where this rank holds part of it).

    Raises:
        LeanUnsupportedError: a part of the block the lean forward has no code for yet
            (a gated shared expert, a correction bias not found).
    """

    __slots__ = (
        "correction_bias", "experts", "native", "reduce", "router", "router_bias", "routing",
        "shared",
    )  # fmt: skip

    def __init__(
        self, layer: nn.Module, routed: RoutedExperts, family: ModelFamily, config: Any, bf16: bool
    ) -> None:
        moe = family.moe
        assert moe is not None
        if moe.shared_expert_gate is not None:
            raise LeanUnsupportedError("a gated shared expert")
        self.shared: LeanSharedExpert | None = None
        if moe.shared_expert is not None:
            self.shared = LeanSharedExpert(layer.get_submodule(moe.shared_expert), bf16)
        self.routing = moe.routing(config)
        if self.routing.experts != routed.total:
            raise LeanUnsupportedError(
                f"the config routes over {self.routing.experts} experts, the block has "
                f"{routed.total}"
            )
        self.router = router_weight(layer, family)
        self.router_bias = router_bias(layer, family)
        self.correction_bias: torch.Tensor | None = None
        if moe.correction_bias is not None:
            owner, _, name = moe.correction_bias.rpartition(".")
            bias = getattr(layer.get_submodule(owner) if owner else layer, name, None)
            if not isinstance(bias, torch.Tensor):
                raise LeanUnsupportedError(f"no correction bias at {moe.correction_bias}")
            self.correction_bias = bias.detach().float()
        self.experts: list[ExpertFunction | None] = [None] * routed.total
        for expert_id, expert in routed.held().items():
            gate_up, down = _expert_projections(expert, family, bf16)
            if gate_up.reduce or down.reduce:
                raise LeanUnsupportedError("an expert linear that all-reduces by itself")
            gated = expert.gated
            activation = None if gated is not None else mlp_activation(expert)
            self.experts[expert_id] = LeanExpert(gate_up, down, activation, gated)
        self.native: NativeInt4Experts | NativeMxfp4Experts | None = NativeInt4Experts.of(
            self.experts
        ) or NativeMxfp4Experts.of(self.experts)
        self.reduce = routed.reduce
        if self.shared is not None and self.shared.partial and not self.reduce:
            raise LeanUnsupportedError("a tensor-split shared expert beside whole experts")

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if isinstance(self.native, NativeInt4Experts) and self.routing.groups == 1:
            out = self.native.route(
                rows, self.router, self.router_bias, self.routing, self.correction_bias
            )
        else:
            logits = F.linear(rows, self.router, self.router_bias)  # gpt-oss: a biased router
            weights, experts = route(logits, self.routing, self.correction_bias)
            if self.native is not None:
                out = self.native(rows, experts, weights)
            else:
                out = dispatch(rows, experts, weights, self.experts)
        shared = None if self.shared is None else self.shared(rows)
        if shared is not None and self.shared is not None and self.shared.partial:
            out.add_(shared)  # a tensor rank: both parts partial, one all-reduce
            shared = None
        if self.reduce:
            all_reduce_sum(out)
        if shared is not None:  # whole on every rank (expert parallel, or one rank)
            out.add_(shared)
        return out
