"""One decoder layer as the direct forward holds it (`LeanLayer`): its fused projections,
norm weights, activation and rotary kind, read once from the loaded transformers layer;
a MoE layer's sparse block as a `LeanMoe` in place of the dense MLP's projections."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum
from exo.worker.engines.torch.model.direct_forward_mla import LeanLatentAttention
from exo.worker.engines.torch.model.direct_forward_moe import LeanMoe
from exo.worker.engines.torch.model.direct_forward_parts import (
    Activation,
    LeanUnsupportedError,
    Projection,
    activation_code,
    mlp_activation,
    norm_weight,
)
from exo.worker.engines.torch.model.families import ModelFamily
from exo.worker.engines.torch.model.moe import routed_experts_of

_Norm = tuple[torch.Tensor, float]  # (offset + weight float32, eps)
# linears (weight, scale_zero, bias per projection), norms, epsilons, activation code.
_DecodeArguments = tuple[list[torch.Tensor | None], list[torch.Tensor | None], list[float], int]


class LeanLayer:
    """One decoder layer's tensors, read from the loaded modules.

    Attributes:
        heads / kv_heads / head_dim: this rank's query and KV heads, and their width.
        rope: index of the layer's rotary tables in the step (0 unless Gemma 3 local).
        sinks: this rank's heads' attention-sink logits `[heads]` float32 (gpt-oss), or None.
        qkv: the fused Q/K/V projection (None in an MLA layer).
        latent: the layer's multi-head latent attention (None: Q/K/V attention).
        gate_up / down: the dense MLP's projections (None in a MoE layer).
        moe: the layer's sparse MLP block (None in a dense layer).
        decode_arguments: exo's decode layer's arguments for the whole layer, or None.
        attention_arguments: for a MoE layer, the same for its attention block alone (the
            decode layer's stage 1; the routed experts then run as `moe`), or None.
    """

    __slots__ = (
        "activation", "activation_number", "attention_arguments", "decode_arguments", "down",
        "gate_up", "head_dim",
        "heads", "input_norm", "intermediate", "kv_heads", "latent", "layout", "moe", "output",
        "post_attention_norm",
        "post_mlp_norm", "pre_mlp_norm", "projection_qk_norm", "qk_norm", "qkv", "reduced",
        "rope", "scaling", "sinks",
    )  # fmt: skip

    def __init__(
        self, layer: nn.Module, family: ModelFamily, bf16: bool, rope: int, config: Any
    ) -> None:
        layout = family.layout
        assert layout is not None
        self.layout = layout
        attention: Any = layer.get_submodule("self_attn")
        if getattr(attention, "attn_logit_softcapping", None) is not None:
            raise LeanUnsupportedError("attention logit soft-capping")
        self.rope = rope
        self.latent: LeanLatentAttention | None = None
        self.qkv: Projection | None = None
        if layout.latent_attention:  # MLA: its own projections and compressed cache
            self.latent = LeanLatentAttention(attention, bf16)
            self.head_dim = self.latent.rope  # the rotary tables' width
            self.scaling = self.latent.scaling
            self.heads, self.kv_heads = self.latent.heads, 1
            self.output = self.latent.output
        else:
            self._standard_attention(layer, attention, bf16)
        self._mlp_and_norms(layer, family, bf16, config)

    def _standard_attention(self, layer: nn.Module, attention: Any, bf16: bool) -> None:
        layout = self.layout
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.qkv = Projection([layer.get_submodule(path) for path in layout.qkv], bf16)
        if len(layout.qkv) == 3:
            query: Any = layer.get_submodule(layout.qkv[0])
            key: Any = layer.get_submodule(layout.qkv[1])
            self.heads = int(query.out_features) // self.head_dim
            self.kv_heads = int(key.out_features) // self.head_dim
        else:  # one fused qkv_proj: heads in the config's ratio, this rank's share
            own: Any = attention.config
            heads, kv_heads = int(own.num_attention_heads), int(own.num_key_value_heads)
            share = self.qkv.out_features / ((heads + 2 * kv_heads) * self.head_dim)
            self.heads, self.kv_heads = round(heads * share), round(kv_heads * share)
        if (self.heads + 2 * self.kv_heads) * self.head_dim != self.qkv.out_features:
            raise LeanUnsupportedError("Q/K/V widths do not match the head counts")
        self.output = Projection([layer.get_submodule(layout.output)], bf16)

    def _mlp_and_norms(
        self, layer: nn.Module, family: ModelFamily, bf16: bool, config: Any
    ) -> None:
        layout = self.layout
        self.gate_up: Projection | None = None
        self.down: Projection | None = None
        self.moe: LeanMoe | None = None
        self.intermediate = 0
        self.activation: Activation | None = None
        self.activation_number = -1
        routed = routed_experts_of(layer, family)
        if routed is not None:
            self.moe = LeanMoe(layer, routed, family, config, bf16)
        else:
            self.gate_up = Projection([layer.get_submodule(path) for path in layout.gate_up], bf16)
            self.intermediate = self.gate_up.out_features // 2
            self.down = Projection([layer.get_submodule(layout.down)], bf16)
            self.activation = mlp_activation(parent_module(layer, layout.down))
            self.activation_number = activation_code(self.activation)
        offset = layout.norm_offset
        self.input_norm = norm_weight(layer.get_submodule(layout.input_norm), offset)
        self.pre_mlp_norm = norm_weight(layer.get_submodule(layout.pre_mlp_norm), offset)
        self.post_attention_norm: _Norm | None = None
        self.post_mlp_norm: _Norm | None = None
        if layout.post_attention_norm is not None:
            module = layer.get_submodule(layout.post_attention_norm)
            self.post_attention_norm = norm_weight(module, offset)
        if layout.post_mlp_norm is not None:
            self.post_mlp_norm = norm_weight(layer.get_submodule(layout.post_mlp_norm), offset)
        self.qk_norm: _Norm | None = None
        self.projection_qk_norm: ProjectionNorms | None = None
        qk_norms = _qk_norm_modules(layer, layout.qk_norms)
        if qk_norms is not None and not layout.qk_norms_per_head:
            q_width, k_width = self.heads * self.head_dim, self.kv_heads * self.head_dim
            self.projection_qk_norm = ProjectionNorms(*qk_norms, q_width, k_width, offset)
        elif qk_norms is not None:
            q_weight, eps = norm_weight(qk_norms[0], offset)
            k_weight, _ = norm_weight(qk_norms[1], offset)
            weight = torch.cat(
                [q_weight.expand(self.heads, -1), k_weight.expand(self.kv_heads, -1)]
            )  # [heads + kv_heads, head_dim]
            self.qk_norm = (weight, eps)
        self.sinks: torch.Tensor | None = None
        if layout.attention_sinks is not None:
            owner, _, name = layout.attention_sinks.rpartition(".")
            sinks = getattr(layer.get_submodule(owner) if owner else layer, name, None)
            if not isinstance(sinks, torch.Tensor) or sinks.shape != (self.heads,):
                raise LeanUnsupportedError(
                    f"no [heads] attention sinks at {layout.attention_sinks}"
                )
            self.sinks = sinks.detach().float()
        # A tensor rank: the output and down projections' partial sums are all-reduced.
        self.reduced = self.output.reduce and (self.down is None or self.down.reduce)
        self.decode_arguments = self._decode_arguments()
        self.attention_arguments = self._attention_arguments()

    def _attention_arguments(self) -> _DecodeArguments | None:
        """A MoE layer's arguments for exo's decode layer's attention block alone (stage 1:
        norm, Q/K/V, q/k norm, rotary, KV write, attention, output projection without its
        bias), the gate/up and down entries empty: a decode step then calls ~20 fewer torch
        operators per layer. None where it is not a MoE layer or its attention cannot run
        there (as `_decode_arguments`: MLA, norms over all heads, attention sinks, a
        column-split Q/K/V)."""
        if self.moe is None or self.qkv is None:
            return None
        if self.projection_qk_norm is not None or self.sinks is not None or self.qkv.reduce:
            return None
        linears: list[torch.Tensor | None] = []
        for projection in (self.qkv, self.output):
            tensors = projection.decode_tensors()
            if tensors is None:
                return None
            linears += tensors
        linears += [None] * 6  # no gate/up, no down
        norms: list[torch.Tensor | None] = []
        epsilons: list[float] = []
        for norm in (self.input_norm, None, None, None, self.qk_norm):
            norms.append(None if norm is None else norm[0].contiguous())
            epsilons.append(0.0 if norm is None else norm[1])
        return linears, norms, epsilons, 0

    def _decode_arguments(self) -> _DecodeArguments | None:
        """The `linears`, `norms`, `eps` and `activation` arguments of exo's decode layer
        (`native/decode_layer.cpp`), or None where a projection cannot run there (or only
        some of a layer's row-parallel projections are; a MoE layer: the decode layer has
        no sparse block, nor norms over all heads; attention sinks: its attention has
        none)."""
        if (
            self.gate_up is None
            or self.down is None
            or self.projection_qk_norm is not None
            or self.sinks is not None
        ):
            return None
        if self.qkv is None:  # MLA: no decode-layer code for it
            return None
        if self.qkv.reduce or self.gate_up.reduce or self.output.reduce != self.down.reduce:
            return None
        linears: list[torch.Tensor | None] = []
        for projection in (self.qkv, self.output, self.gate_up, self.down):
            tensors = projection.decode_tensors()
            if tensors is None:
                return None
            linears += tensors
        norms: list[torch.Tensor | None] = []
        epsilons: list[float] = []
        for norm in (
            self.input_norm, self.pre_mlp_norm, self.post_attention_norm, self.post_mlp_norm,
            self.qk_norm,
        ):  # fmt: skip
            norms.append(None if norm is None else norm[0].contiguous())
            epsilons.append(0.0 if norm is None else norm[1])
        return linears, norms, epsilons, self.activation_number


def _qk_norm_modules(
    layer: nn.Module, paths: tuple[str, str] | None
) -> tuple[nn.Module, nn.Module] | None:
    """The query and key norms at `paths`, None where the family has none or this model's
    config turns them off (GLM-4.5's `use_qk_norm`: the modules are not built)."""
    if paths is None:
        return None
    try:
        return layer.get_submodule(paths[0]), layer.get_submodule(paths[1])
    except AttributeError:
        return None


class ProjectionNorms:
    """RMSNorms over all of a step's query heads together and all of its key heads
    together (MiniMax-M2's `q_norm` over `heads * head_dim`), applied to the fused Q/K/V
    rows before rotary. On a tensor rank (a `SplitWidthRMSNorm`: the rank holds its heads'
    columns) the sums of squares are all-reduced, one `[T, 2]` tensor for both norms.
    """

    __slots__ = ("eps", "k_width", "q_width", "reduce", "totals", "weight")

    def __init__(
        self, query: nn.Module, key: nn.Module, q_width: int, k_width: int, offset: float
    ) -> None:
        q_weight, self.eps = norm_weight(query, offset)
        k_weight, _ = norm_weight(key, offset)
        if q_weight.numel() != q_width or k_weight.numel() != k_width:
            raise LeanUnsupportedError("q/k norm widths differ from the projections'")
        self.weight = torch.cat([q_weight, k_weight])  # [q_width + k_width]
        totals = [int(getattr(norm, "total_width", width)) for norm, width in
                  ((query, q_width), (key, k_width))]  # fmt: skip
        self.reduce = totals != [q_width, k_width]
        self.totals = torch.tensor(totals, dtype=torch.float32)
        self.q_width, self.k_width = q_width, k_width

    def __call__(self, qkv: torch.Tensor) -> torch.Tensor:
        """`qkv` `[T, q + k + v widths]` → the same with queries and keys normalized."""
        width = self.q_width + self.k_width
        qk = qkv[:, :width].float()
        squares = torch.stack(
            [qk[:, : self.q_width].pow(2).sum(-1), qk[:, self.q_width :].pow(2).sum(-1)], dim=-1
        )  # [T, 2]
        if self.reduce:
            all_reduce_sum(squares)
        scale = torch.rsqrt(squares / self.totals + self.eps)
        scales = torch.cat(
            [scale[:, :1].expand(-1, self.q_width), scale[:, 1:].expand(-1, self.k_width)], dim=-1
        )
        normed = (qk * scales * self.weight).to(qkv.dtype)
        return torch.cat([normed, qkv[:, width:]], dim=-1)


def parent_module(layer: nn.Module, path: str) -> nn.Module:
    parent, _, _ = path.rpartition(".")
    return layer.get_submodule(parent) if parent else layer
