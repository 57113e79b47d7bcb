"""A MoE block as the direct forward holds it (`LeanMoe`): the router's weight, the routing
rules and, per expert this rank holds, its fused gate/up and down projections (dense or
quantized, as `Projection` holds any linear), read once from the loaded `RoutedExperts`.

A step's rows are routed and grouped by expert (`moe.dispatch`): each chosen expert's
weights are read once for all of its rows. A rank holding part of the block (a tensor
rank's slices of every expert, an expert rank's experts) all-reduces the summed output once.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.direct_forward_parts import (
    Activation,
    LeanUnsupportedError,
    Projection,
    mlp_activation,
)
from exo.worker.engines.torch.model.families import ModelFamily
from exo.worker.engines.torch.model.families.spec import ExpertActivation
from exo.worker.engines.torch.model.moe import (
    GATED_MLP_NAMES,
    ExpertFunction,
    RoutedExperts,
    moe_output,
    router_bias,
    router_weight,
)
from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear, Mxfp4Projection


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
        "correction_bias", "experts", "reduce", "router", "router_bias", "routing", "shared",
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
        self.reduce = routed.reduce
        if self.shared is not None and self.shared.partial and not self.reduce:
            raise LeanUnsupportedError("a tensor-split shared expert beside whole experts")

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        out = moe_output(
            rows, self.router, self.routing, self.correction_bias, self.experts, self.router_bias
        )
        shared = None if self.shared is None else self.shared(rows)
        if shared is not None and self.shared is not None and self.shared.partial:
            out.add_(shared)  # a tensor rank: both parts partial, one all-reduce
            shared = None
        if self.reduce:
            all_reduce_sum(out)
        if shared is not None:  # whole on every rank (expert parallel, or one rank)
            out.add_(shared)
        return out
