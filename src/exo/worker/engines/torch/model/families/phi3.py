"""Phi-3 and Phi-4-mini (`Phi3ForCausalLM`): fused `qkv_proj` and `gate_up_proj`.

Tensor parallelism splits each part of a fused linear separately (every rank holds its
query heads, then its key heads, then its value heads), and the attention, which finds
the query/key/value boundaries from head counts in its config, gets this rank's counts.
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn
from transformers import Phi3Config, Phi3ForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.phi3.modeling_phi3 import Phi3RMSNorm

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    ModelFamily,
    UnsupportedArchitectureError,
)


def _head_dim(config: PretrainedConfig) -> int:
    head_dim = getattr(config, "head_dim", None)
    return int(head_dim) if head_dim else config.hidden_size // config.num_attention_heads


def qkv_parts(config: PretrainedConfig) -> tuple[int, ...]:
    """Widths of the query, key and value blocks of `qkv_proj`'s output."""
    head_dim = _head_dim(config)
    key_value = config.num_key_value_heads * head_dim
    return (config.num_attention_heads * head_dim, key_value, key_value)


def gate_up_parts(config: PretrainedConfig) -> tuple[int, ...]:
    """Widths of the gate and up blocks of `gate_up_proj`'s output."""
    return (config.intermediate_size, config.intermediate_size)


def give_attention_rank_heads(layer: nn.Module, config: PretrainedConfig, world_size: int) -> None:
    """Phi3Attention slices its fused output at `config.num_attention_heads * head_dim`
    and `self.num_key_value_heads * head_dim`: give it this rank's head counts."""
    attention = getattr(layer, "self_attn", None)
    if attention is None or not hasattr(attention, "num_key_value_heads"):
        raise UnsupportedArchitectureError("Phi3ForCausalLM: a decoder layer has no self_attn")
    rank_config = copy.copy(config)
    rank_config.num_attention_heads = config.num_attention_heads // world_size
    rank_config.num_key_value_heads = config.num_key_value_heads // world_size
    attention.config = rank_config
    attention.num_key_value_heads = rank_config.num_key_value_heads


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return Phi3ForCausalLM(Phi3Config(**settings, pad_token_id=None))


FAMILY = ModelFamily(
    name="phi3",
    architectures=("Phi3ForCausalLM",),
    column_parallel=("self_attn.qkv_proj", "mlp.gate_up_proj"),
    row_parallel=("self_attn.o_proj", "mlp.down_proj"),
    fused_parts={"self_attn.qkv_proj": qkv_parts, "mlp.gate_up_proj": gate_up_parts},
    rms_norms=(Phi3RMSNorm,),
    after_tensor_split=give_attention_rank_heads,
    tiny_model=tiny_model,
    layout=DecoderLayout(qkv=("self_attn.qkv_proj",), gate_up=("mlp.gate_up_proj",)),
)
