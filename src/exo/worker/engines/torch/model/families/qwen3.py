"""Qwen3 dense models (`Qwen3ForCausalLM`; per-head q/k norms, explicit `head_dim`), and the
text model of Qwen3-VL (`Qwen3VLForConditionalGeneration`: the decoder under
`model.language_model.`, the head at the top or tied, the tower under `model.visual.`; its
interleaved multimodal rotary positions and deepstack features are the direct forward's,
`qwen3_vl_vision.py`)."""

from __future__ import annotations

from typing import Any

from transformers import PreTrainedModel, Qwen3Config, Qwen3ForCausalLM
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    ModelFamily,
    attention_windows_from_layer_types,
    standard_attention_and_mlp,
)


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return Qwen3ForCausalLM(Qwen3Config(**{"head_dim": 16, **settings}))


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="qwen3",
    architectures=("Qwen3ForCausalLM",),
    wrapped_architectures=("Qwen3VLForConditionalGeneration",),
    wrapped_prefixes={"Qwen3VLForConditionalGeneration": ""},
    checkpoint_renames=(("model.language_model.", "model."),),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(Qwen3RMSNorm,),
    attention_windows=attention_windows_from_layer_types,
    tiny_model=tiny_model,
    layout=DecoderLayout(qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
)
