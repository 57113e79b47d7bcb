"""Qwen2: Qwen2.5, Qwen2.5-Coder, DeepSeek-R1-Distill-Qwen (`Qwen2ForCausalLM`; biases on
q/k/v, which split with their rows), and the text model of Qwen2.5-VL
(`Qwen2_5_VLForConditionalGeneration`: its published tensors are named as Qwen2's,
`model.layers.N...` beside the tower's `visual.`; its multimodal rotary positions are the
direct forward's, `qwen2_5_vl_vision.py`)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, Qwen2Config, Qwen2ForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

from exo.worker.engines.torch.model.families.spec import (
    ModelFamily,
    attention_windows_from_layer_types,
    standard_attention_and_mlp,
)


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return Qwen2ForCausalLM(Qwen2Config(**settings))


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="qwen2",
    architectures=("Qwen2ForCausalLM",),
    wrapped_architectures=("Qwen2_5_VLForConditionalGeneration",),
    wrapped_prefixes={"Qwen2_5_VLForConditionalGeneration": ""},
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(Qwen2RMSNorm,),
    attention_windows=attention_windows_from_layer_types,
    tiny_model=tiny_model,
)
