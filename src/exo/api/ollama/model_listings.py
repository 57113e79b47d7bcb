"""Ollama's model listings: model cards as `/api/tags`, `/api/show` and `/api/ps` entries.

`digest` is the SHA-256 of the model id (a stable stand-in: exo has no Ollama blobs).
Details come from the card: `format` from the files the weights come from ("gguf" for a
GGUF source, as Ollama says of its GGUF models, though exo reads them converted; else
"safetensors"), family from the architecture, `parameter_size` from its stated parameter
count, and `quantization_level` from what the weights are (`quantization_level`).

Sizes are what Ollama means by them: `/api/tags` `size` the bytes of the model's files on
this node's disk (`bytes_on_disk`; the card's storage size where this node has no copy),
`/api/ps` `size` the bytes its loaded weights take (`resident_bytes`), `size_vram` the
part of those on GPUs (0 on CPU).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from pathlib import Path

from exo.api.ollama.request import NEVER_EXPIRES
from exo.api.ollama.wire_types import (
    OllamaModelDetails,
    OllamaProcessModel,
    OllamaShowResponse,
    OllamaTagModel,
)
from exo.shared.models.memory import GGUF_FLOAT_TYPES, mxfp4_experts, resident_weight_bytes
from exo.shared.models.parameter_count import decoder_parameter_count, human_parameter_count
from exo.shared.models.weight_formats import ENGINE_CPU_WEIGHT_FORMAT
from exo.shared.types.models import ModelCard
from exo.shared.types.runners import RunnerReady, RunnerRunning, RunnerStatus

CPU_QUANTIZATION = "INT4"
"""The engine's default weights on CPU (`worker/engines/torch/engine.py`)."""
GPU_QUANTIZATION = "F32"
MXFP4_QUANTIZATION = "MXFP4"
"""Ollama's name for gpt-oss's MXFP4 experts (its gpt-oss models report it)."""


def quantization_level(card: ModelCard, on_gpus: bool) -> str:
    """Ollama's `quantization_level`: what the model's weights are, as Ollama names them.

    A GGUF quantized by a recipe answers its file type ("Q4_K_M", "Q4_1":
    `GgufWeightTypes.file_type`): the engine computes with its blocks' own values, never
    requantized (`worker/engines/torch/quant/gguf_weights.py`: only scales are rounded to
    bfloat16). A model whose routed experts are MXFP4 (gpt-oss: `memory.mxfp4_experts`, held
    so on every device) answers "MXFP4". Any other model (a float checkpoint or float GGUF)
    is held as the engine converts it: int4 on CPU, float32 on GPUs.
    """
    file_type = card.gguf_weight_types.file_type if card.gguf_weight_types else None
    if file_type is not None and file_type not in GGUF_FLOAT_TYPES:
        return file_type
    if mxfp4_experts(card):
        return MXFP4_QUANTIZATION
    return GPU_QUANTIZATION if on_gpus else CPU_QUANTIZATION


def model_digest(model_id: str) -> str:
    """A stable stand-in for Ollama's blob digest: the SHA-256 hex of the model id."""
    return hashlib.sha256(model_id.encode()).hexdigest()


def _parameter_count(card: ModelCard) -> int:
    """The card's stated count, else the count its shapes imply."""
    return card.parameter_count or decoder_parameter_count(card) + card.vision_parameter_count


ENCODER_FAMILIES: dict[str, str] = {
    "BertModel": "bert",
    "XLMRobertaModel": "bert",
    "XLMRobertaForSequenceClassification": "bert",
    "NomicBertModel": "nomic-bert",
    "Gemma3TextModel": "gemma3",
}
"""The family Ollama reports for each encoder architecture: its GGUF's
`general.architecture`, as llama.cpp's converter writes it (XLM-RoBERTa, bge-m3 and the bge
reranker included, is converted as "bert"; NomicBERT as "nomic-bert"); Ollama's library
lists EmbeddingGemma as "gemma3"."""


def model_family(card: ModelCard) -> str:
    """`LlamaForCausalLM` -> "llama" (Ollama's family names are the architectures'); an
    encoder's as Ollama names it (`ENCODER_FAMILIES`)."""
    if card.architecture in ENCODER_FAMILIES:
        return ENCODER_FAMILIES[card.architecture]
    name = card.architecture
    for suffix in (
        "ForCausalLM",
        "ForConditionalGeneration",
        "ForSequenceClassification",
        "LMHeadModel",
        "Model",
    ):
        name = name.removesuffix(suffix)
    return name.lower() or card.architecture.lower()


def model_details(card: ModelCard, on_gpus: bool) -> OllamaModelDetails:
    """The `details` of a listing entry; `on_gpus`: the model runs (or would run) on GPUs."""
    family = model_family(card)
    return OllamaModelDetails(
        format="gguf" if card.from_gguf else "safetensors",
        family=family,
        families=[family],
        parameter_size=human_parameter_count(_parameter_count(card)),
        quantization_level=quantization_level(card, on_gpus),
    )


def bytes_on_disk(directory: Path) -> int:
    """Bytes of the files under `directory` (symbolic links followed, as a checkout may
    link into a cache), hidden entries (`.git`, `.cache`, exo's markers) left out."""
    total = 0
    for root, directories, files in os.walk(directory, followlinks=True):
        directories[:] = [name for name in directories if not name.startswith(".")]
        for name in files:
            if name.startswith("."):
                continue
            try:
                total += (Path(root) / name).stat().st_size
            except OSError:  # a dangling link, a file removed meanwhile
                continue
    return total


def resident_bytes(card: ModelCard, statuses: Iterable[RunnerStatus | None], on_gpus: bool) -> int:
    """Bytes the loaded weights of an instance of `card` take: the sum its runners
    reported once loaded (`RunnerReady.weight_bytes`, kept while running; None: a runner
    with no status yet), or, while one has not reported, what the engine holds of the
    whole model (`resident_weight_bytes` in its format: int4 on CPU, float32 on GPUs).
    Activations and the KV cache are not counted."""
    reported = [
        status.weight_bytes if isinstance(status, RunnerReady | RunnerRunning) else 0
        for status in statuses
    ]
    if reported and all(reported):
        return sum(reported)
    return resident_weight_bytes(card, "float32" if on_gpus else ENGINE_CPU_WEIGHT_FORMAT)


def tag_model(
    card: ModelCard, modified_at: str, on_gpus: bool, size: int | None = None
) -> OllamaTagModel:
    """One `/api/tags` entry; `size`: the bytes of its files on disk (None: the card's
    storage size, for a model this node holds no copy of)."""
    return OllamaTagModel(
        name=card.model_id,
        model=card.model_id,
        modified_at=modified_at,
        size=card.storage_size_bytes if size is None else size,
        digest=model_digest(card.model_id),
        details=model_details(card, on_gpus),
        capabilities=model_capabilities(card, ""),
    )


def process_model(
    card: ModelCard,
    size: int,
    on_gpus: bool,
    expires_at: str = NEVER_EXPIRES,
    context_length: int | None = None,
) -> OllamaProcessModel:
    """One `/api/ps` entry for a placed model: `size` the bytes its loaded weights take
    (`resident_bytes`), all of them in `size_vram` on GPUs, none on CPU; `expires_at`
    (RFC 3339) is when it is unloaded if unused until then (far in the future: kept until
    deleted); `context_length` the most tokens one request may hold as loaded (Ollama's is
    the runner's `num_ctx`, not the model's trained context: here the model's context or
    less where the instances' KV-cache budget is smaller; None: the card's context)."""
    return OllamaProcessModel(
        name=card.model_id,
        model=card.model_id,
        size=size,
        digest=model_digest(card.model_id),
        details=model_details(card, on_gpus),
        expires_at=expires_at,
        size_vram=size if on_gpus else 0,
        context_length=card.context_length if context_length is None else context_length,
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
    card: ModelCard, template: str, modified_at: str, on_gpus: bool
) -> OllamaShowResponse:
    """The `/api/show` body for a model: a generated Modelfile, the card's sampling
    defaults as `parameters`, `template` (the chat template, "" when unknown on this node)
    and GGUF-style `model_info` keys built from the card (a MoE model's `expert_count`,
    `expert_used_count` and `expert_feed_forward_length` too, and exo's `exo.draft_model`,
    the card's draft model for speculative decoding, where it names one)."""
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
    if card.moe is not None:  # as Ollama's GGUF keys name a MoE model's routing
        model_info[f"{family}.expert_count"] = card.moe.experts
        model_info[f"{family}.expert_used_count"] = card.moe.experts_per_token
        model_info[f"{family}.expert_feed_forward_length"] = card.moe.expert_intermediate_size
    if card.draft_model is not None:
        model_info["exo.draft_model"] = card.draft_model
    return OllamaShowResponse(
        modelfile="\n".join(modelfile_lines) + "\n",
        parameters=parameters,
        template=template,
        details=model_details(card, on_gpus),
        model_info=model_info,
        capabilities=model_capabilities(card, template),
        modified_at=modified_at,
    )
