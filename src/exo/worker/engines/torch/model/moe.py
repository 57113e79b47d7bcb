"""The sparse mixture-of-experts MLP, shared by every MoE family: routing (`route`), the
routed experts as one gated MLP each (`RoutedExperts`, swapped into the transformers
skeleton at load) and the grouped dispatch both forwards use (`dispatch`).

Only what a token needs is read: a step's rows are grouped by the experts they are routed
to (one stable sort of the `[rows * experts_per_token]` choices), and each expert that some
row chose runs once, on all of its rows together, reading its weights once per step;
experts no row chose are not touched. Prefill takes the same path (a prompt's rows grouped
by expert). The expert outputs, weighted by the routing scores, are summed into their rows
in ascending expert order, as transformers' own Qwen3-MoE experts module sums them.

Each expert's gate, up and down projections are ordinary `nn.Linear` modules named as
checkpoints store them (`mlp.experts.N.gate_proj.weight`), so loading, quantization (int4
groups like every dense linear) and the tensor-parallel split treat them as the dense MLP's.
A rank holding part of the work (tensor ranks: a slice of every expert; expert ranks: some
whole experts) sums its part and all-reduces once per MoE block (`RoutedExperts.reduce`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import torch
from torch import nn

from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.families.spec import (
    ExpertActivation,
    ModelFamily,
    Routing,
    UnsupportedArchitectureError,
)
from exo.worker.engines.torch.quant.mxfp4 import BLOCK as MXFP4_BLOCK
from exo.worker.engines.torch.quant.mxfp4 import Mxfp4Linear

# One expert's computation over its rows: `[n, hidden]` float32 → `[n, hidden]` float32.
ExpertFunction = Callable[[torch.Tensor], torch.Tensor]


def route(
    logits: torch.Tensor, routing: Routing, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts and their weights (`Routing` describes the rules).

    Args:
        logits: router logits `[T, experts]` float32.
        correction_bias: `[experts]` added to the scores for the choice only, or None.

    Returns:
        weights `[T, experts_per_token]` float32 and experts `[T, experts_per_token]` int64
        (highest choice score first).

    Sources: Qwen3-MoE's router (softmax, top-k, `norm_topk_prob`) and DeepSeek-V3's
    (sigmoid, correction bias, group-limited choice, `routed_scaling_factor`), as
    transformers implements them (`Qwen3MoeTopKRouter`, `DeepseekV3MoE.route_tokens_to_experts`).
    """
    if routing.scoring == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
    else:
        scores = torch.sigmoid(logits.float())
    choice = scores if correction_bias is None else scores + correction_bias
    if routing.groups > 1:
        rows = choice.shape[0]
        grouped = choice.view(rows, routing.groups, -1)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, groups]
        best = group_scores.topk(routing.groups_per_token, dim=-1, sorted=False).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        mask = kept.unsqueeze(-1).expand_as(grouped).reshape(rows, -1)
        choice = choice.masked_fill(~mask, float("-inf"))
    experts = choice.topk(routing.experts_per_token, dim=-1).indices
    weights = scores.gather(1, experts)
    if routing.normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if routing.scaling != 1.0:
        weights = weights * routing.scaling
    return weights, experts


def dispatch(
    rows: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    functions: Sequence[ExpertFunction | None],
) -> torch.Tensor:
    """The routed experts' weighted outputs summed per row, each chosen expert run once on
    all the rows routed to it.

    Args:
        rows: `[T, hidden]` the MLP's input rows.
        experts / weights: `route`'s `[T, k]` choices and weights.
        functions: per expert id, its computation, or None for an expert this rank does not
            hold (its rows get nothing from it here).

    Returns:
        `[T, hidden]` float32: the sum over each row's held experts of weight × output.
    """
    count, per_token = experts.shape
    out = torch.zeros(count, rows.shape[-1], dtype=torch.float32, device=rows.device)
    if count == 0:
        return out
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # choices grouped by expert, rows ascending
    row_of = order // per_token
    weight_of = weights.reshape(-1).index_select(0, order)
    counts = torch.bincount(flat, minlength=len(functions)).tolist()
    outputs: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    start = 0
    for expert, routed in enumerate(counts):
        if routed == 0:
            continue
        end = start + routed
        function = functions[expert]
        if function is not None:
            chosen = row_of[start:end]
            output = function(rows.index_select(0, chosen))
            outputs.append(output.float() * weight_of[start:end, None])
            targets.append(chosen)
        start = end
    # One scatter for the step, not one per expert: a decode step's experts hold a row or
    # two each, and each small `index_add_` cost a parallel region (a profile of
    # bench_moe.py's decode put 45% of its time there). Its rows keep their order, so each
    # output row still sums its experts in ascending expert order.
    if outputs:
        out.index_add_(0, torch.cat(targets), torch.cat(outputs))
    return out


# How the experts' weights are held: float (loaded as float32, then quantized like any
# linear), or MXFP4 as the checkpoint stores them (`quant/mxfp4.py`).
ExpertFormat = Literal["float", "mxfp4"]


def _expert_linear(
    in_features: int, out_features: int, bias: bool, expert_format: ExpertFormat
) -> nn.Module:
    if expert_format == "mxfp4":
        return Mxfp4Linear(in_features, out_features, bias)
    return nn.Linear(in_features, out_features, bias=bias, device="meta")


# An expert's (gate, up, down) linears' names, as the family's checkpoints store them
# (`MixtureOfExperts.expert_gate_up` / `expert_down`; Mixtral's are w1, w3, w2).
ExpertNames = tuple[str, str, str]
GATED_MLP_NAMES: ExpertNames = ("gate_proj", "up_proj", "down_proj")


class ExpertMLP(nn.Module):
    """One expert: `down(act(gate(x)) * up(x))`, its linears named as checkpoints name them;
    with `gated`, `down(gated(gate(x), up(x)))` (gpt-oss's clamped SwiGLU), and with `bias`
    biased linears; `expert_format` "mxfp4": `Mxfp4Linear`s."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        act_fn: Callable[..., Any],
        names: ExpertNames = GATED_MLP_NAMES,
        bias: bool = False,
        gated: ExpertActivation | None = None,
        expert_format: ExpertFormat = "float",
    ) -> None:
        super().__init__()
        self.names = names
        gate, up, down = names
        self.add_module(gate, _expert_linear(hidden, intermediate, bias, expert_format))
        self.add_module(up, _expert_linear(hidden, intermediate, bias, expert_format))
        self.add_module(down, _expert_linear(intermediate, hidden, bias, expert_format))
        self.act_fn = act_fn
        self.gated = gated

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up, down = (getattr(self, name) for name in self.names)
        if self.gated is not None:
            return down(self.gated(gate(x), up(x)))
        return down(self.act_fn(gate(x)) * up(x))


class RoutedExperts(nn.Module):
    """A MoE block's routed experts, one `ExpertMLP` child per expert this rank holds, named
    by its expert id (`experts.7.gate_proj`), with the call signature of transformers'
    experts modules: `(hidden [T, hidden], top_k_index [T, k], top_k_weights [T, k])`.

    Attributes:
        total: experts of the block over every rank.
        reduce: this rank holds part of the block (tensor slices or some experts): its
            output is a partial sum, all-reduced over the group.
        bias / gated: the experts' biased linears and gated activation (`ExpertMLP`).
        expert_format: how the experts' weights are held (`ExpertFormat`).
    """

    def __init__(
        self,
        total: int,
        hidden: int,
        intermediate: int,
        act_fn: Any,
        names: ExpertNames = GATED_MLP_NAMES,
        bias: bool = False,
        gated: ExpertActivation | None = None,
        expert_format: ExpertFormat = "float",
    ) -> None:
        super().__init__()
        self.total = total
        self.expert_format: ExpertFormat = expert_format
        self.hidden = hidden
        self.intermediate = intermediate
        self.names = names
        self.bias = bias
        self._act_fn = (act_fn, gated)  # in a tuple: not children (children are the experts)
        self.reduce = False
        for expert in range(total):
            self.add_module(str(expert), self._expert(intermediate))

    def _expert(self, intermediate: int) -> ExpertMLP:
        act_fn, gated = self._act_fn
        return ExpertMLP(
            self.hidden, intermediate, act_fn, self.names, self.bias, gated, self.expert_format
        )

    def held(self) -> dict[int, ExpertMLP]:
        """The experts this rank holds, by id."""
        return {int(name): module for name, module in self.named_children()}  # type: ignore[misc]

    def keep(self, experts: Iterable[int]) -> None:
        """Hold only `experts` (an expert-parallel rank's share); the output becomes a
        partial sum."""
        wanted = set(experts)
        for name in [name for name, _ in self.named_children()]:
            if int(name) not in wanted:
                delattr(self, name)
        self.reduce = True

    def split_for_tensor(self, world_size: int) -> None:
        """Give every expert its tensor rank's shapes (on meta): gate / up rows and down
        columns `intermediate / world_size` wide; the output becomes a partial sum."""
        if self.intermediate % world_size:
            raise ValueError(
                f"moe_intermediate_size={self.intermediate} is not divisible by the tensor "
                f"parallel world size {world_size}"
            )
        share = self.intermediate // world_size
        if self.expert_format == "mxfp4" and share % MXFP4_BLOCK:
            raise ValueError(
                f"an expert's {self.intermediate} MXFP4 inputs split {world_size} ways are not "
                f"whole blocks of {MXFP4_BLOCK}"
            )
        for name, _ in list(self.named_children()):
            self.add_module(name, self._expert(share))
        self.reduce = True

    def functions(self) -> list[ExpertFunction | None]:
        held = self.held()
        return [held.get(expert) for expert in range(self.total)]

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        out = dispatch(hidden_states, top_k_index, top_k_weights, self.functions())
        if self.reduce:
            all_reduce_sum(out)
        return out.to(hidden_states.dtype)


def install_routed_experts(
    model: nn.Module, family: ModelFamily, expert_format: ExpertFormat = "float"
) -> int:
    """Replace every MoE block's experts module (transformers' stacked weights, on the meta
    device) by a `RoutedExperts` of the same shapes, so checkpoints' per-expert tensors
    load into it by name (fused checkpoints: cut per expert, `model/fused_experts.py`),
    held as `expert_format` says. The number of MoE layers; 0 for a dense family.

    Raises:
        UnsupportedArchitectureError: a config whose routing the family cannot run (the
            message names the field: `Routing`, `MixtureOfExperts.routing`), or an experts
            module whose weights are not the stacked `gate_up_proj` `[experts, 2 *
            intermediate, hidden]` and `down_proj` `[experts, hidden, intermediate]` this
            knows (input-major `[experts, hidden, 2 * intermediate]` and `[experts,
            intermediate, hidden]` for a family with `fused_checkpoint`: gpt-oss).
    """
    moe = family.moe
    if moe is None:
        return 0
    parent_path, _, attribute = moe.experts.rpartition(".")
    layers: Any = model.model.layers  # type: ignore[union-attr]
    config: Any = model.config.get_text_config()  # type: ignore[union-attr,operator]
    moe.routing(config)  # refuse what the family cannot route
    gated = None if moe.expert_activation is None else moe.expert_activation(config)
    input_major = moe.fused_checkpoint is not None
    replaced = 0
    for index, layer in enumerate(layers):
        parent = layer.get_submodule(parent_path) if parent_path else layer
        experts = getattr(parent, attribute, None)
        if experts is None or isinstance(experts, RoutedExperts):
            continue  # a dense layer
        gate_up = getattr(experts, "gate_up_proj", None)
        down = getattr(experts, "down_proj", None)
        act_fn = getattr(experts, "act_fn", None)
        if (
            not isinstance(gate_up, torch.Tensor)
            or not isinstance(down, torch.Tensor)
            or gate_up.dim() != 3
            or down.dim() != 3
            or (act_fn is None and gated is None)
        ):
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: layer {index}'s {type(experts).__name__} is not "
                "the stacked gate_up_proj / down_proj experts module the engine replaces"
            )
        if input_major:
            total, intermediate, hidden = down.shape
            expected = (total, hidden, 2 * intermediate)
        else:
            total, hidden, intermediate = down.shape
            expected = (total, 2 * intermediate, hidden)
        if tuple(gate_up.shape) != expected:
            raise UnsupportedArchitectureError(
                f"{type(model).__name__}: layer {index}'s experts' gate_up_proj has shape "
                f"{tuple(gate_up.shape)}, expected {expected}"
            )
        names = (*moe.expert_gate_up, moe.expert_down)
        if len(names) != 3:
            raise UnsupportedArchitectureError(
                f"{family.name}: an expert is gate, up and down linears, not {names}"
            )
        routed = RoutedExperts(
            total, hidden, intermediate, act_fn, (names[0], names[1], names[2]),
            moe.expert_bias, gated, expert_format,
        )  # fmt: skip
        setattr(parent, attribute, routed)
        replaced += 1
    return replaced


def routed_experts_of(layer: nn.Module, family: ModelFamily) -> RoutedExperts | None:
    """The layer's `RoutedExperts` (None: a dense layer or family)."""
    if family.moe is None:
        return None
    try:
        module = layer.get_submodule(family.moe.experts)
    except AttributeError:
        return None
    return module if isinstance(module, RoutedExperts) else None


def router_weight(layer: nn.Module, family: ModelFamily) -> torch.Tensor:
    """The layer's router weight `[experts, hidden]` float32."""
    assert family.moe is not None
    router = layer.get_submodule(family.moe.router)
    weight = getattr(router, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise UnsupportedArchitectureError(f"{type(router).__name__} has no router weight")
    return weight.detach().float()


def router_bias(layer: nn.Module, family: ModelFamily) -> torch.Tensor | None:
    """The layer's router bias `[experts]` float32 (gpt-oss's), None where it has none."""
    assert family.moe is not None
    bias = getattr(layer.get_submodule(family.moe.router), "bias", None)
    return bias.detach().float() if isinstance(bias, torch.Tensor) else None
