"""One decoder layer as the direct forward holds it (`LeanLayer`): its fused projections,
norm weights, activation and rotary kind, read once from the loaded transformers layer;
a MoE layer's sparse block as a `LeanMoe` in place of the dense MLP's projections."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

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
        gate_up / down: the dense MLP's projections (None in a MoE layer).
        moe: the layer's sparse MLP block (None in a dense layer).
    """

    __slots__ = (
        "activation", "activation_number", "decode_arguments", "down", "gate_up", "head_dim",
        "heads", "input_norm", "intermediate", "kv_heads", "moe", "output", "post_attention_norm",
        "post_mlp_norm", "pre_mlp_norm", "qk_norm", "qkv", "reduced", "rope", "scaling", "sinks",
    )  # fmt: skip

    def __init__(
        self, layer: nn.Module, family: ModelFamily, bf16: bool, rope: int, config: Any
    ) -> None:
        layout = family.layout
        assert layout is not None
        attention: Any = layer.get_submodule("self_attn")
        if getattr(attention, "attn_logit_softcapping", None) is not None:
            raise LeanUnsupportedError("attention logit soft-capping")
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.rope = rope
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
        if layout.qk_norms is not None:
            q_weight, eps = norm_weight(layer.get_submodule(layout.qk_norms[0]), offset)
            k_weight, _ = norm_weight(layer.get_submodule(layout.qk_norms[1]), offset)
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

    def _decode_arguments(self) -> _DecodeArguments | None:
        """The `linears`, `norms`, `eps` and `activation` arguments of exo's decode layer
        (`native/decode_layer.cpp`), or None where a projection cannot run there (or only
        some of a layer's row-parallel projections are; a MoE layer: the decode layer has
        no sparse block; attention sinks: its attention has none)."""
        if self.gate_up is None or self.down is None or self.sinks is not None:
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


def parent_module(layer: nn.Module, path: str) -> nn.Module:
    parent, _, _ = path.rpartition(".")
    return layer.get_submodule(parent) if parent else layer
