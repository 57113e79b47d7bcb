"""Tiny Hub-style checkouts whose weight files are cut by decoder layers, as large
checkpoints are, so a test can see which files one pipeline shard fetches."""

from __future__ import annotations

import json
import re
from pathlib import Path

from exo.testing.tiny_models import save_tiny_checkout

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def save_layered_checkout(directory: Path, n_layers: int = 6, layers_per_file: int = 2) -> Path:
    """A tiny Llama checkout (`save_tiny_checkout`) whose weights are split into
    `model-00001-of-N.safetensors` holding the embedding, then one file per
    `layers_per_file` decoder layers (the last also holding the final norm), with
    `model.safetensors.index.json`.

    Returns:
        `directory`.
    """
    from safetensors.torch import load_file, save_file

    save_tiny_checkout(directory, "llama", n_layers=n_layers)
    tensors = load_file(str(directory / "model.safetensors"))
    (directory / "model.safetensors").unlink()
    groups: dict[int, dict[str, object]] = {}
    n_groups = -(-n_layers // layers_per_file)
    for name, tensor in tensors.items():
        match = _LAYER.match(name)
        if match is not None:
            group = 1 + int(match.group(1)) // layers_per_file
        elif "embed_tokens" in name:
            group = 0
        else:
            group = n_groups
        groups.setdefault(group, {})[name] = tensor
    count = len(groups)
    weight_map: dict[str, str] = {}
    for position, group in enumerate(sorted(groups)):
        file_name = f"model-{position + 1:05d}-of-{count:05d}.safetensors"
        save_file(groups[group], str(directory / file_name), metadata={"format": "pt"})  # type: ignore[arg-type]
        weight_map.update(dict.fromkeys(groups[group], file_name))
    total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return directory
