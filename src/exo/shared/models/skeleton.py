"""A model's skeleton: transformers' causal LM for a config with no weights in memory.

Used where a checkpoint's tensor names and shapes are needed without reading them: the
loader plans each rank's tensors against it (`exo.worker.engines.torch.model.loading`) and
the GGUF repacker names and lays out the tensors it writes (`exo.download.gguf_repack`).
torch, transformers and accelerate are imported on call, so importing this module costs
nothing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel


def empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The causal LM for `config` (its text config for multimodal checkpoints) with every
    parameter on the meta device; buffers computed at construction (rotary inverse
    frequencies, not stored in checkpoints) are real. Its `config.architectures` names the
    text model built, whatever wrapped it in the checkpoint."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from exo.shared.models.architectures import (
        MROPE_INTERLEAVED_TEXT_MODEL_TYPES,
        TEXT_MODEL_TYPE_ALIASES,
    )

    text_config = config.get_text_config()
    model_type = str(getattr(text_config, "model_type", ""))
    alias = TEXT_MODEL_TYPE_ALIASES.get(model_type)
    if alias is not None:  # a multimodal text model transformers has no causal LM for
        fields = {k: v for k, v in text_config.to_dict().items() if k != "model_type"}
        if model_type in MROPE_INTERLEAVED_TEXT_MODEL_TYPES:
            rope = dict(fields.get("rope_parameters") or {})
            fields["rope_parameters"] = {**rope, "mrope_interleaved": True}
        # Qwen2.5-VL's text config has no tying flag: the wrapper's config ties the head.
        fields.setdefault("tie_word_embeddings", bool(getattr(config, "tie_word_embeddings", 0)))
        text_config = AutoConfig.for_model(alias, **fields)
    # SDPA where transformers offers it; eager for models it refuses SDPA (gpt-oss: its
    # attention sinks). The engine switches either to its own batched attention.
    implementation = "sdpa"
    model_class = AutoModelForCausalLM._model_mapping.get(type(text_config), None)
    if model_class is not None and not getattr(model_class, "_supports_sdpa", True):
        implementation = "eager"
    with init_empty_weights(include_buffers=False):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            text_config, dtype=torch.float32, attn_implementation=implementation
        )
    model.config.architectures = [type(model).__name__]
    return model
