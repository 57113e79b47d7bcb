"""Gemma 3 text (`Gemma3ForCausalLM`: 270M, 1B) and the text model of the multimodal
`Gemma3ForConditionalGeneration` checkpoints (4B and up: tensors under `language_model.`).

Layers alternate sliding-window and full attention (`layer_types`); the norms scale by
`1 + weight`, so none is fused.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    Gemma3Config,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    PretrainedConfig,
    PreTrainedModel,
)

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    ModelFamily,
    attention_windows_from_layer_types,
    standard_attention_and_mlp,
)


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    layers = int(settings["num_hidden_layers"])
    # One full-attention layer after each sliding one (real Gemma 3: one in six).
    layer_types = ["sliding_attention", "full_attention"] * (layers // 2)
    layer_types += ["sliding_attention"] * (layers % 2)
    return Gemma3ForCausalLM(
        Gemma3TextConfig(**{"head_dim": 16, **settings}, layer_types=layer_types)
    )


def wrapped_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The multimodal config around a text config, as Gemma 3 4B+ checkpoints have."""
    return Gemma3Config(text_config=text_config.to_dict())


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="gemma3",
    architectures=("Gemma3ForCausalLM",),
    wrapped_architectures=("Gemma3ForConditionalGeneration",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(),
    attention_windows=attention_windows_from_layer_types,
    tiny_model=tiny_model,
    tiny_wrapped_config=wrapped_config,
    layout=DecoderLayout(
        pre_mlp_norm="pre_feedforward_layernorm",
        post_attention_norm="post_attention_layernorm",
        post_mlp_norm="post_feedforward_layernorm",
        qk_norms=("self_attn.q_norm", "self_attn.k_norm"),
        norm_offset=1.0,
        rope_per_layer_type=True,
    ),
)
