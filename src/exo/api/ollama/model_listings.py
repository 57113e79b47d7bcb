"""Ollama's model listings: model cards as `/api/tags`, `/api/show` and `/api/ps` entries.

`digest` is the SHA-256 of the model id (a stable stand-in: exo has no Ollama blobs).
Details come from the card: family from the architecture, `parameter_size` from its stated
parameter count, and `quantization_level` from the weights the engine holds: int4 on CPU
(the engine's default there), float32 on GPUs.
"""

from __future__ import annotations

import hashlib
from typing import Literal

from exo.api.ollama.request import NEVER_EXPIRES
from exo.api.ollama.wire_types import (
    OllamaModelDetails,
    OllamaProcessModel,
    OllamaShowResponse,
    OllamaTagModel,
)
from exo.shared.models.parameter_count import decoder_parameter_count, human_parameter_count
from exo.shared.types.models import ModelCard

QuantizationLevel = Literal["INT4", "F32"]
CPU_QUANTIZATION: QuantizationLevel = "INT4"
"""The engine's default weights on CPU (`worker/engines/torch/engine.py`)."""
GPU_QUANTIZATION: QuantizationLevel = "F32"


def quantization_level(on_gpus: bool) -> QuantizationLevel:
    """How the engine holds the weights: float32 on GPUs, int4 on CPU."""
    return GPU_QUANTIZATION if on_gpus else CPU_QUANTIZATION


def model_digest(model_id: str) -> str:
    """A stable stand-in for Ollama's blob digest: the SHA-256 hex of the model id."""
    return hashlib.sha256(model_id.encode()).hexdigest()


def _parameter_count(card: ModelCard) -> int:
    """The card's stated count, else the count its shapes imply."""
    return card.parameter_count or decoder_parameter_count(card) + card.vision_parameter_count


def model_family(card: ModelCard) -> str:
    """`LlamaForCausalLM` -> "llama" (Ollama's family names are the architectures')."""
    name = card.architecture
    for suffix in ("ForCausalLM", "ForConditionalGeneration", "LMHeadModel", "Model"):
        name = name.removesuffix(suffix)
    return name.lower() or card.architecture.lower()


def model_details(card: ModelCard, quantization: QuantizationLevel) -> OllamaModelDetails:
    family = model_family(card)
    return OllamaModelDetails(
        format="safetensors",
        family=family,
        families=[family],
        parameter_size=human_parameter_count(_parameter_count(card)),
        quantization_level=quantization,
    )


def tag_model(card: ModelCard, modified_at: str, quantization: QuantizationLevel) -> OllamaTagModel:
    """One `/api/tags` entry; `size` is the card's storage size in bytes."""
    return OllamaTagModel(
        name=card.model_id,
        model=card.model_id,
        modified_at=modified_at,
        size=card.storage_size_bytes,
        digest=model_digest(card.model_id),
        details=model_details(card, quantization),
        capabilities=model_capabilities(card, ""),
    )


def process_model(
    card: ModelCard,
    size_vram: int,
    quantization: QuantizationLevel,
    expires_at: str = NEVER_EXPIRES,
) -> OllamaProcessModel:
    """One `/api/ps` entry for a placed model; `expires_at` (RFC 3339) is when it is
    unloaded if unused until then (far in the future: kept until deleted)."""
    return OllamaProcessModel(
        name=card.model_id,
        model=card.model_id,
        size=card.storage_size_bytes,
        digest=model_digest(card.model_id),
        details=model_details(card, quantization),
        expires_at=expires_at,
        size_vram=size_vram,
        context_length=card.context_length,
    )


def model_capabilities(card: ModelCard, template: str) -> list[str]:
    """Ollama's capability names: "completion" always; "tools" for every model with a chat
    template (exo parses the model's own tool-call format, and asks a model trained on none
    for hermes blocks); "thinking" when the card says so or the chat template reads a
    thinking switch, "vision" when the card says so (such a model reads `images`): these
    only for a card with "text"; "embedding" (Ollama's name) and "rerank" as the card says."""
    capabilities: list[str] = []
    if "text" in card.capabilities:
        capabilities.append("completion")
        if getattr(card, "has_chat_template", True):
            capabilities.append("tools")
        if "thinking" in card.capabilities or "enable_thinking" in template:
            capabilities.append("thinking")
        if "vision" in card.capabilities:
            capabilities.append("vision")
    capabilities += [name for name in ("embedding", "rerank") if name in card.capabilities]
    return capabilities


def show_response(
    card: ModelCard, template: str, modified_at: str, quantization: QuantizationLevel
) -> OllamaShowResponse:
    """The `/api/show` body for a model: a generated Modelfile, the card's sampling
    defaults as `parameters`, `template` (the chat template, "" when unknown on this node)
    and GGUF-style `model_info` keys built from the card (and exo's `exo.draft_model`, the
    card's draft model for speculative decoding, where it names one)."""
    family = model_family(card)
    defaults = card.sampling_defaults
    parameter_values = {
        "temperature": defaults.temperature,
        "top_p": defaults.top_p,
        "top_k": defaults.top_k,
        "min_p": defaults.min_p,
    }
    parameters = "\n".join(f"{name:<30} {value}" for name, value in parameter_values.items())
    modelfile_lines = [
        "# Modelfile generated by exo",
        f"FROM {card.model_id}",
        *(f"PARAMETER {name} {value}" for name, value in parameter_values.items()),
    ]
    if template:
        modelfile_lines.insert(2, f'TEMPLATE """{template}"""')
    model_info: dict[str, object] = {
        "general.architecture": family,
        "general.basename": card.model_id.rsplit("/", 1)[-1],
        "general.parameter_count": _parameter_count(card),
        f"{family}.block_count": card.n_layers,
        f"{family}.context_length": card.context_length,
        f"{family}.embedding_length": card.hidden_size,
        f"{family}.feed_forward_length": card.intermediate_size,
        f"{family}.attention.head_count": card.num_attention_heads,
        f"{family}.attention.head_count_kv": card.num_key_value_heads,
        f"{family}.attention.key_length": card.attention_head_dim,
        f"{family}.vocab_size": card.vocab_size,
    }
    if card.draft_model is not None:
        model_info["exo.draft_model"] = card.draft_model
    return OllamaShowResponse(
        modelfile="\n".join(modelfile_lines) + "\n",
        parameters=parameters,
        template=template,
        details=model_details(card, quantization),
        model_info=model_info,
        capabilities=model_capabilities(card, template),
        modified_at=modified_at,
    )
