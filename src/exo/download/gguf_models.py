"""GGUF files people already have, as models: a `.gguf` path, or a model in Ollama's store.

Ollama's store (`OLLAMA_MODELS`, default `~/.ollama/models`) holds
`manifests/<registry>/<namespace>/<name>/<tag>` (JSON: `layers`, each with `mediaType`,
`digest`, `size`) and `blobs/sha256-<hex>`; the layer of media type
`application/vnd.ollama.image.model` is the GGUF weights. A model of the default registry
and namespace (`registry.ollama.ai/library`) is called `<name>:<tag>`, others
`<namespace>/<name>:<tag>` or `<registry>/<namespace>/<name>:<tag>`, as Ollama names them.

A card is read from the GGUF's own metadata (no tensor is read); the weights are converted
once, when the model is first prepared, into a writable models directory
(`pypi_gguf.prepare_model`; quantized blocks are repacked, not dequantized:
`exo.download.gguf_repack`).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exo.shared.types.common import ModelId
from exo.shared.types.models import GgufFileSource, GgufWeightTypes, ModelCard

if TYPE_CHECKING:
    from exo.download.gguf_tensors import GgufDirectory

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
OLLAMA_MODEL_MEDIA_TYPE = "application/vnd.ollama.image.model"
DEFAULT_REGISTRY = "registry.ollama.ai"
DEFAULT_NAMESPACE = "library"
# GGUF's `general.architecture` -> the transformers class the engine's family files know.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",  # experts read by `exo.download.gguf_experts`
    "gpt-oss": "GptOssForCausalLM",  # config, MXFP4 experts: `exo.download.gguf_gptoss`
    "gptoss": "GptOssForCausalLM",  # Ollama's first gpt-oss blobs (`gguf_gptoss`)
    # config from the metadata: `exo.download.gguf_configs`
    "deepseek2": "DeepseekV3ForCausalLM",  # DeepSeek-V3 / V3.1 / R1, Kimi-K2
    "glm4moe": "Glm4MoeForCausalLM",  # GLM-4.5 to 4.7
}


# `general.file_type` (llama.cpp's `llama_ftype`) -> the name Ollama reports it as
# (`quantization_level`; Ollama's fs/ggml FileType names). 4 is Ollama's own gpt-oss blobs'
# MXFP4; 38 is llama.cpp's MOSTLY_MXFP4_MOE (gpt-oss converted by llama.cpp), which Ollama
# has no name for: its experts are MXFP4, so it is named so here.
GGUF_FILE_TYPE_NAMES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 4: "MXFP4", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 21: "Q2_K_S", 32: "BF16", 38: "MXFP4",
}  # fmt: skip


class GgufModelError(ValueError):
    """A GGUF file that is no model this engine can use (named)."""


# Where Ollama's Linux service (the `ollama` user of its install script) keeps its store.
LINUX_SERVICE_STORE = Path("/usr/share/ollama/.ollama/models")
# Manifests read from one store at most (a store holds one per pulled model and tag).
MAX_OLLAMA_MANIFESTS = 2000


def ollama_store(
    environment: Mapping[str, str] | None = None, service_store: Path = LINUX_SERVICE_STORE
) -> Path:
    """`OLLAMA_MODELS`, else `~/.ollama/models`, else (when only it exists) the Linux
    service's `/usr/share/ollama/.ollama/models`."""
    env = os.environ if environment is None else environment
    configured = env.get("OLLAMA_MODELS")
    if configured:
        return Path(configured).expanduser()
    own = Path.home() / ".ollama" / "models"
    if not own.is_dir() and service_store.is_dir():
        return service_store
    return own


def _manifest_files(manifests: Path) -> list[Path]:
    """`<registry>/<namespace>/<name>/<tag>` files under `manifests`, depth 4 exactly, no
    symbolic link followed, at most `MAX_OLLAMA_MANIFESTS`."""
    level = [manifests]
    for depth in range(4):
        following: list[Path] = []
        for directory in level:
            try:
                with os.scandir(directory) as entries:
                    for entry in entries:
                        if len(following) >= MAX_OLLAMA_MANIFESTS:
                            break
                        wanted = (
                            entry.is_file(follow_symlinks=False)
                            if depth == 3
                            else entry.is_dir(follow_symlinks=False)
                        )
                        if wanted:
                            following.append(Path(entry.path))
            except OSError:
                continue
        level = following
    return sorted(level)


@dataclass(frozen=True, slots=True)
class OllamaStoreModel:
    """One model of the store: its Ollama name and its GGUF weights blob."""

    name: str
    gguf_path: Path
    sha256: str


def ollama_store_models(store: Path) -> list[OllamaStoreModel]:
    """Every model in the store whose manifest names a weights blob that is there, by name.
    Unreadable manifests are skipped."""
    manifests = store / "manifests"
    if not manifests.is_dir():
        return []
    found: list[OllamaStoreModel] = []
    for manifest in _manifest_files(manifests):
        registry, namespace, name, tag = manifest.relative_to(manifests).parts
        try:
            content = json.loads(manifest.read_text())
        except (OSError, ValueError):
            continue
        layers = content.get("layers") if isinstance(content, dict) else None
        model_layers = [
            layer
            for layer in layers or ()
            if isinstance(layer, dict) and layer.get("mediaType") == OLLAMA_MODEL_MEDIA_TYPE
        ]
        digest = str(model_layers[0].get("digest", "")) if len(model_layers) == 1 else ""
        sha256 = digest.removeprefix("sha256:")
        if not digest.startswith("sha256:") or _SHA256.match(sha256) is None:
            continue  # also keeps a crafted digest (`../`) from naming a path
        blob = store / "blobs" / f"sha256-{sha256}"
        if blob.is_symlink() or not blob.is_file():
            continue  # a link could lead out of the store
        found.append(OllamaStoreModel(_ollama_name(registry, namespace, name, tag), blob, sha256))
    return found


def find_ollama_model(store: Path, name: str) -> OllamaStoreModel | None:
    """The store's model called `name` as Ollama names it (`mytiny:latest`; without a tag,
    `:latest`), or None."""
    wanted = name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"
    for model in ollama_store_models(store):
        if model.name == wanted:
            return model
    return None


def _ollama_name(registry: str, namespace: str, name: str, tag: str) -> str:
    if registry == DEFAULT_REGISTRY and namespace == DEFAULT_NAMESPACE:
        return f"{name}:{tag}"
    if registry == DEFAULT_REGISTRY:
        return f"{namespace}/{name}:{tag}"
    return f"{registry}/{namespace}/{name}:{tag}"


def gguf_weight_types(directory: GgufDirectory) -> GgufWeightTypes | None:
    """The types a GGUF stores its decoder-layer linears (2-d weights and 3-d stacked experts
    under `blk.`; not the stacked experts' 2-d biases) and LM head (`output.weight`, else the
    tied `token_embd.weight`) in, and its file type's name (`GGUF_FILE_TYPE_NAMES`); None
    without linears or head."""
    layer_weights: dict[str, int] = {}
    by_name = {tensor.name: tensor for tensor in directory.tensors}
    for tensor in directory.tensors:
        if (
            tensor.name.startswith("blk.")
            and tensor.name.endswith(".weight")
            and len(tensor.shape) in (2, 3)  # 3: stacked experts
        ):
            count = layer_weights.get(tensor.type_name, 0)
            layer_weights[tensor.type_name] = count + math.prod(tensor.shape)
    head = by_name.get("output.weight") or by_name.get("token_embd.weight")
    if not layer_weights or head is None:
        return None
    file_type = directory.metadata.get("general.file_type")
    return GgufWeightTypes(
        layer_weights=tuple(sorted(layer_weights.items())),
        output_type=head.type_name,
        file_type=GGUF_FILE_TYPE_NAMES.get(file_type) if isinstance(file_type, int) else None,
    )


def card_for_gguf(path: Path, model_id: str, sha256: str | None = None) -> ModelCard:
    """A card from the GGUF's metadata: architecture, shapes, context length, whether it
    has a chat template and the capabilities and tool-call format it shows
    (`custom_cards.template_traits`, as for a Hugging Face directory), attention biases
    (`blk.0.attn_q.bias`, or a fused `attn_qkv.bias`), a MoE model's experts, an MLA
    model's ranks (layers, KV heads and head width as the converted config states them for
    `gguf_configs`' architectures: MTP layers left out, MLA's heads not llama.cpp's MQA);
    `storage_size_bytes` is the file's size (of
    every part, for a split model whose first part `path` is: `gguf_tensors.gguf_parts`),
    `parameter_count` the elements of its tensors, `gguf_weight_types` the types of its
    layers and head.

    Raises:
        GgufModelError: not a GGUF file, an architecture the engine has no family for, or
            metadata it lacks (named).
    """
    from exo.download.custom_cards import template_traits
    from exo.download.gguf_configs import METADATA_CONFIGS
    from exo.download.gguf_experts import gguf_moe_fields
    from exo.download.gguf_tensors import GgufArray, gguf_parts, read_gguf_model
    from exo.shared.models.latent_attention import latent_attention_of_config
    from exo.shared.models.moe import moe_geometry_of_config

    try:
        directory = read_gguf_model(path)
        storage_size = sum(part.stat().st_size for part in gguf_parts(path))
    except (OSError, ValueError) as error:
        raise GgufModelError(f"{path} is not a readable GGUF file: {error}") from None

    def value(key: str) -> Any:
        return directory.metadata.get(key)

    architecture = value("general.architecture")
    if architecture not in GGUF_ARCHITECTURES:
        raise GgufModelError(
            f"{path} is a {architecture!r} GGUF; supported: {', '.join(GGUF_ARCHITECTURES)}"
        )

    def required(key: str) -> int:
        found = value(f"{architecture}.{key}")
        if found is None:
            raise GgufModelError(f"{path} has no {architecture}.{key} in its metadata")
        return int(found)

    heads = required("attention.head_count")
    tokens = value("tokenizer.ggml.tokens")
    if not isinstance(tokens, GgufArray) or not tokens.count:
        raise GgufModelError(f"{path} has no tokenizer.ggml.tokens (no tokenizer)")
    head_dim = value(f"{architecture}.attention.key_length")
    hidden_size = required("embedding_length")
    layers = required("block_count")
    key_value_heads = int(value(f"{architecture}.attention.head_count_kv") or heads)
    tensor_names = {tensor.name for tensor in directory.tensors}
    try:
        # a config built from the metadata says what the converted model's will
        fields = (
            METADATA_CONFIGS[architecture](directory) if architecture in METADATA_CONFIGS else {}
        )
        moe_fields = gguf_moe_fields(directory)
        moe = moe_geometry_of_config(moe_fields)
        latent_attention = latent_attention_of_config(fields)
    except ValueError as error:
        raise GgufModelError(f"{path}: {error}") from None
    if fields:
        layers, head_dim = fields["num_hidden_layers"], fields["head_dim"]
        key_value_heads = fields["num_key_value_heads"]
    try:
        check_tensor_index(directory, hidden_size, layers, moe_fields)
    except ValueError as error:
        raise GgufModelError(f"{path}: {error}") from None
    template = value("tokenizer.chat_template")
    capabilities, tool_call_format = template_traits(template if isinstance(template, str) else "")
    return ModelCard(
        model_id=ModelId(model_id),
        source=GgufFileSource(path=str(path), sha256=sha256),
        architecture=GGUF_ARCHITECTURES[architecture],
        n_layers=layers,
        hidden_size=hidden_size,
        num_attention_heads=heads,
        num_key_value_heads=key_value_heads,
        intermediate_size=required("feed_forward_length"),
        vocab_size=tokens.count,
        storage_size_bytes=storage_size,
        context_length=required("context_length"),
        has_chat_template=template is not None,
        capabilities=capabilities,
        tool_call_format=tool_call_format,
        attention_bias=bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & tensor_names),
        head_dim=int(head_dim) if head_dim and int(head_dim) != hidden_size // heads else None,
        tie_word_embeddings="output.weight" not in tensor_names,
        parameter_count=sum(math.prod(tensor.shape) for tensor in directory.tensors) or None,
        gguf_weight_types=gguf_weight_types(directory),
        moe=moe,
        latent_attention=latent_attention,
    )


def check_tensor_index(
    directory: GgufDirectory, hidden_size: int, layers: int, moe_fields: Mapping[str, Any]
) -> None:
    """Check, from the file's tensor index alone (no weight read), that it has what the
    conversion (`gguf_repack.convert_gguf`) reads before it reaches a layer: the token
    embedding, a tensor in each of the `layers` decoder layers, and for a MoE
    architecture every sparse layer's expert tensors at their shapes
    (`gguf_experts.check_experts`; `moe_fields` from `gguf_moe_fields`, empty for a dense
    model). So a file missing one is refused when it is added, not when its first request
    converts it.

    Raises:
        GgufExpertsError: naming the first missing or mis-shaped tensor.
    """
    from types import SimpleNamespace

    from exo.download.gguf_experts import GGUF_EXPERT_LAYOUTS, GgufExpertsError, check_experts

    names = {tensor.name for tensor in directory.tensors}
    if "token_embd.weight" not in names:
        raise GgufExpertsError("the GGUF has no token_embd.weight (the token embedding)")
    holding = {name.split(".")[1] for name in names if name.startswith("blk.")}
    for layer in range(layers):
        if str(layer) not in holding:
            raise GgufExpertsError(f"the GGUF has no blk.{layer}.* tensor (decoder layer {layer})")
    layout = GGUF_EXPERT_LAYOUTS.get(directory.architecture)
    if layout is None or not moe_fields:
        return
    fields = {"hidden_size": hidden_size, **moe_fields}
    fields.setdefault(layout.count_field, moe_fields.get("num_experts"))
    fields["num_hidden_layers"] = layers
    for needed in (layout.width_field, layout.count_field):
        if fields.get(needed) is None:
            raise GgufExpertsError(f"the GGUF's metadata gives no {needed} for its experts")
    check_experts(directory, layout, SimpleNamespace(**fields))


def ollama_store_cards(
    store: Path, catalog: Mapping[ModelId, ModelCard]
) -> tuple[list[ModelCard], list[str]]:
    """Cards of the store's models, by their Ollama names, leaving out a model whose name a
    catalog model answers to (the catalog's keeps it).

    Returns:
        The cards, and one line per model left out, saying why.
    """
    from exo.shared.models.names import resolve_model_name

    cards: list[ModelCard] = []
    skipped: list[str] = []
    for model in ollama_store_models(store):
        taken = resolve_model_name(model.name, catalog)
        if taken is not None:
            skipped.append(f"{model.name}: the catalog model {taken} has that name")
            continue
        try:
            cards.append(card_for_gguf(model.gguf_path, model.name, model.sha256))
        except GgufModelError as error:
            skipped.append(f"{model.name}: {error}")
    return cards, skipped
