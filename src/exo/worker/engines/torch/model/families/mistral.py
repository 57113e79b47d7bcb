"""Mistral 7B (`MistralForCausalLM`) and the text model of Mistral-Small 3.1
(`Mistral3ForConditionalGeneration`: tensors under `language_model.`). Mistral 7B v0.1
attends within a sliding window on every layer; later versions set no window."""

from __future__ import annotations

from typing import Any

from transformers import (
    Mistral3Config,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.mistral.modeling_mistral import MistralRMSNorm

from exo.worker.engines.torch.model.families.spec import ModelFamily, standard_attention_and_mlp


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    # MistralConfig's own default window (4096) is longer than any test prompt.
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return MistralForCausalLM(MistralConfig(**{"head_dim": 16, **settings}))


def wrapped_config(text_config: PretrainedConfig) -> PretrainedConfig:
    """The multimodal config around a text config, as Mistral-Small 3.1 has."""
    return Mistral3Config(text_config=text_config.to_dict())


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="mistral",
    architectures=("MistralForCausalLM",),
    wrapped_architectures=("Mistral3ForConditionalGeneration",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(MistralRMSNorm,),
    tiny_model=tiny_model,
    tiny_wrapped_config=wrapped_config,
)
