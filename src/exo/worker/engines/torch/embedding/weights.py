"""Reading an embedding model's files: its safetensors tensors (as float32) and its JSON files.

Encoder checkpoints are small (all-MiniLM-L6-v2 23M weights, nomic-embed-text-v1.5 137M,
bge-m3 568M, EmbeddingGemma 308M), so the whole model is read into memory as float32 (a
bfloat16 or float16 checkpoint is widened); there is no quantized format for them yet.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

INDEX_FILE = "model.safetensors.index.json"


class EmbeddingModelError(ValueError):
    """The model directory cannot be served as an embedding model: a missing file, an
    unsupported option or architecture (the message names it)."""


def read_json(path: Path) -> dict[str, Any]:
    """A JSON object file.

    Raises:
        EmbeddingModelError: the file is missing, is not JSON or not an object.
    """
    try:
        content = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError as error:
        raise EmbeddingModelError(f"{path} is missing") from error
    except (OSError, ValueError) as error:
        raise EmbeddingModelError(f"{path} does not parse: {error}") from error
    if not isinstance(content, dict):
        raise EmbeddingModelError(f"{path} is not a JSON object")
    return content


def read_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint in `directory` (the files its `model.safetensors.index.json`
    names, else its top-level `*.safetensors`), floating point ones as float32.

    Raises:
        EmbeddingModelError: no safetensors file (a `pytorch_model.bin`-only checkpoint is not
            read: unpickling runs code).
    """
    from safetensors import safe_open

    index_path = directory / INDEX_FILE
    if index_path.is_file():
        weight_map = read_json(index_path).get("weight_map")
        if not isinstance(weight_map, Mapping):
            raise EmbeddingModelError(f"{index_path} has no weight_map object")
        files = sorted({directory / str(name) for name in weight_map.values()})
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise EmbeddingModelError(f"{directory} has no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                tensor = handle.get_tensor(name)
                tensors[name] = tensor.float() if tensor.is_floating_point() else tensor
    return tensors


def config_field(config: Mapping[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` present (not None) in `config`, else `default`; the Hugging Face
    name first, then an older or custom-code name (NomicBERT's `n_embd`, ...)."""
    for name in names:
        value = config.get(name)
        if value is not None:
            return value
    return default


def required_field(config: Mapping[str, Any], origin: str, *names: str) -> Any:
    """`config_field` that must be present.

    Raises:
        EmbeddingModelError: none of `names` is in `config` (named with `origin`).
    """
    value = config_field(config, *names)
    if value is None:
        raise EmbeddingModelError(f"{origin} has no {' / '.join(names)} field")
    return value


def take(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """Checkpoint tensor `name`.

    Raises:
        EmbeddingModelError: the checkpoint lacks it.
    """
    tensor = tensors.get(name)
    if tensor is None:
        raise EmbeddingModelError(f"the checkpoint has no tensor {name}")
    return tensor


def weight_prefix(tensors: Mapping[str, torch.Tensor], anchor: str) -> str:
    """The prefix the checkpoint puts before its base model's tensors: "" for a bare model
    (`BertModel`), `bert.` / `roberta.` / `model.` for one saved inside a task head.

    Raises:
        EmbeddingModelError: no tensor ends with `anchor`.
    """
    for name in sorted(tensors, key=len):
        if name == anchor or name.endswith("." + anchor):
            return name[: len(name) - len(anchor)]
    raise EmbeddingModelError(f"the checkpoint has no tensor named like {anchor}")
