"""Llama: SmolLM2, Llama 3.x, DeepSeek-R1-Distill-Llama (`LlamaForCausalLM`), and the text
model of Idefics3 / SmolVLM checkpoints (`Idefics3ForConditionalGeneration`, SmolVLM2's
`SmolVLMForConditionalGeneration`: the decoder under `model.text_model.`, the LM head at the
top, the vision tower beside them)."""

from __future__ import annotations

from typing import Any

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from exo.worker.engines.torch.model.families.spec import ModelFamily, standard_attention_and_mlp


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return LlamaForCausalLM(LlamaConfig(**settings))


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="llama",
    architectures=("LlamaForCausalLM",),
    wrapped_architectures=("Idefics3ForConditionalGeneration", "SmolVLMForConditionalGeneration"),
    wrapped_prefixes={
        "Idefics3ForConditionalGeneration": "",
        "SmolVLMForConditionalGeneration": "",
    },
    checkpoint_renames=(("model.text_model.", "model."),),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(LlamaRMSNorm,),
    tiny_model=tiny_model,
)
