"""Which files of a Hugging Face checkpoint one shard needs (pure).

A node loads only its shard, so it fetches only: the config, tokenizer and image-processor
files, the safetensors index, and the weight files that hold a tensor of its shard. A
sentence-transformers model (a `modules.json` at the top) adds its module list and settings and
each numbered module folder's `config.json` and safetensors (`1_Pooling/config.json`,
EmbeddingGemma's `2_Dense/model.safetensors`, ...): the pooling and projections after the
transformer. Its `onnx/` or `openvino/` exports and bge-m3's `colbert_linear.pt` /
`sparse_linear.pt` are not fetched (exo reads neither ONNX nor pickles). Which tensors a
rank reads is its parallelism's (`Parallelism.reads_tensor`, `exo.shared.parallelism`): a
pipeline rank its decoder layers `[start_layer, end_layer)`, the first rank also the
embedding, the last the final norm and LM head (and the embedding when the head is tied
to it); a tensor rank a slice of every tensor, so every weight file.

A vision tower and its projector (`is_vision_tensor`) run on one rank of an instance of a
card with the "vision" capability (`Parallelism.runs_vision_tower`: the single rank, or
rank 0 of a split), so only that shard fetches their tensors: where a checkpoint keeps the
tower in files of its own, the other ranks skip those files. The image processors'
settings (`preprocessor_config.json`, `processor_config.json`) are a few hundred bytes and
every node's API counts a prompt's image tokens with them (`ImageTokens.of_model`), so
every shard fetches them. Audio towers are never fetched (exo reads no audio).
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping

from exo.shared.parallelism import parallelism
from exo.shared.types.shards import ShardMetadata

INDEX_FILE = "model.safetensors.index.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
# Everything besides weights the engine, the tokenizer and the chat template read.
SMALL_FILE_PATTERNS = (
    "config.json",
    "generation_config.json",
    "tokenizer*",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tiktoken.model",
    # A vision family's image preprocessing (image size, tiling, normalization, soft tokens).
    "preprocessor_config.json",
    "processor_config.json",
    INDEX_FILE,
    # A sentence-transformers model: its module list, the transformer's and the model's settings.
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)
# A sentence-transformers module folder (`1_Pooling`, `2_Dense`) and the files read from it.
_MODULE_FOLDER = re.compile(r"^[0-9]+_[A-Za-z]+/(config\.json|[^/]*\.safetensors)$")
# Tensors of an audio tower: never read.
_NOT_READ = ("audio",)
# Checkpoint tensors of a vision tower or its projector: any name holding "vision" or
# "multi_modal_projector" (Gemma 3, Mistral 3, LLaVA `vision_tower.`, Idefics3 / SmolVLM
# `model.vision_model.`, Llama 4 `vision_model.`, `multi_modal_projector.`), and the towers
# and projectors named otherwise: Idefics3 / SmolVLM `model.connector.`, Qwen2-VL /
# Qwen2.5-VL `visual.` (`model.visual.` in recent transformers).
_VISION_SUBSTRINGS = ("vision", "multi_modal_projector")
_VISION_PREFIX = re.compile(r"^(?:model\.)?(?:connector|visual)\.")


def small_files(repository_files: Iterable[str]) -> tuple[str, ...]:
    """The repository's top-level config, tokenizer and index files, and, when it is a
    sentence-transformers model (has `modules.json`), its module folders' configs and weights."""
    files = list(repository_files)
    modules = "modules.json" in files
    return tuple(
        sorted(
            path
            for path in files
            if (
                "/" not in path
                and any(fnmatch.fnmatchcase(path, pattern) for pattern in SMALL_FILE_PATTERNS)
            )
            or (modules and _MODULE_FOLDER.match(path) is not None)
        )
    )


def is_vision_tensor(name: str) -> bool:
    """Whether checkpoint tensor `name` belongs to a vision tower or its projector."""
    return any(part in name for part in _VISION_SUBSTRINGS) or bool(_VISION_PREFIX.match(name))


def holds_vision_tower(shard: ShardMetadata) -> bool:
    """Whether `shard` loads its model's vision tower: the card has the "vision"
    capability and the shard's rank is the one its parallelism runs the tower on."""
    if "vision" not in shard.model_card.capabilities:
        return False
    return parallelism(shard.sharding).runs_vision_tower(shard.device_rank, shard.world_size)


def tensor_on_shard(name: str, shard: ShardMetadata | None) -> bool:
    """Whether `shard` (None: the whole model, its vision tower included) loads checkpoint
    tensor `name`."""
    if any(part in name for part in _NOT_READ):
        return False
    if is_vision_tensor(name):
        return shard is None or holds_vision_tower(shard)
    if shard is None:
        return True
    return parallelism(shard.sharding).reads_tensor(name, shard)


def weight_files_for_shard(
    repository_files: Iterable[str],
    index: Mapping[str, object] | None,
    shard: ShardMetadata | None,
) -> tuple[str, ...]:
    """The safetensors files `shard` needs.

    Args:
        repository_files: every path in the repository.
        index: the parsed `model.safetensors.index.json` (None: the repository has none,
            so its top-level `*.safetensors` files are all needed).

    Raises:
        ValueError: the index has no `weight_map` object, or names a file the repository
            lacks.
    """
    files = set(repository_files)
    if index is None:
        return tuple(sorted(p for p in files if "/" not in p and p.endswith(".safetensors")))
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, Mapping):
        raise ValueError(f"{INDEX_FILE} has no weight_map object")
    needed = {str(file) for name, file in weight_map.items() if tensor_on_shard(str(name), shard)}
    missing = sorted(needed - files)
    if missing:
        raise ValueError(f"{INDEX_FILE} names files the repository lacks: {', '.join(missing)}")
    return tuple(sorted(needed))
