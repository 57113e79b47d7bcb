"""Build a transformers model for a shard: a meta-device skeleton, then the shard's tensors
assigned straight from safetensors (no random init, no second copy of the weights)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata

LayerProgressCallback = Callable[[int, int], None]
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class ShardNotSupportedError(ValueError):
    """The shard needs a feature this engine does not have yet (e.g. world size > 1)."""


def check_shard_supported(shard: ShardMetadata) -> None:
    """Only whole-model shards (world size 1) are supported for now.

    Raises:
        ShardNotSupportedError: for a multi-rank shard or a partial layer range.
    """
    match shard:
        case PipelineShardMetadata():
            if shard.world_size != 1 or (shard.start_layer, shard.end_layer) != (
                0,
                shard.model_card.n_layers,
            ):
                raise ShardNotSupportedError(
                    f"pipeline shard [{shard.start_layer}, {shard.end_layer}) of "
                    f"{shard.model_card.n_layers} layers with world size {shard.world_size}: "
                    "only a single rank holding every layer is supported so far"
                )
        case TensorShardMetadata():
            if shard.world_size != 1:
                raise ShardNotSupportedError(
                    f"tensor shard with world size {shard.world_size}: only world size 1 "
                    "is supported so far"
                )


def _empty_model(config: PretrainedConfig) -> PreTrainedModel:
    """The model with every parameter on the meta device; buffers (e.g. rotary inverse
    frequencies, computed at construction, not stored in checkpoints) are real."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        model: PreTrainedModel = AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation="sdpa"
        )
    return model


def _group_tensor_names_by_layer(model_dir: Path) -> dict[int | None, list[tuple[Path, str]]]:
    """Tensor names per decoder layer index (None: embeddings, final norm, LM head)."""
    groups: dict[int | None, list[tuple[Path, str]]] = defaultdict(list)
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                match = _LAYER_INDEX.search(name)
                groups[int(match.group(1)) if match else None].append((path, name))
    return groups


def _assign_tensor(model: torch.nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Put `tensor` in place of the parameter or persistent buffer `name`; False if the model
    has no such entry."""
    module_path, _, attribute = name.rpartition(".")
    try:
        module = model.get_submodule(module_path)
    except AttributeError:
        return False
    if attribute in module._parameters:
        current = module._parameters[attribute]
        if current is not None and current.shape != tensor.shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(tensor.shape)}, "
                f"the model expects {tuple(current.shape)}"
            )
        module._parameters[attribute] = torch.nn.Parameter(tensor, requires_grad=False)
        return True
    if attribute in module._buffers:
        module._buffers[attribute] = tensor
        return True
    return False


def load_model(
    model_dir: Path,
    shard: ShardMetadata,
    device: torch.device,
    on_layer_loaded: LayerProgressCallback | None = None,
) -> PreTrainedModel:
    """Load the shard's weights from `model_dir` into a transformers model, fp32 on `device`.

    Args:
        model_dir: HF-format directory (config.json + *.safetensors).
        shard: which part of the model to hold (world size 1 only, for now).
        device: target device.
        on_layer_loaded: called as (decoder layers loaded, decoder layers in the shard),
            first with 0 and then after each layer.

    Returns:
        The model in eval mode with gradients off.

    Raises:
        ShardNotSupportedError: multi-rank shards.
        ValueError: a tensor is missing from the files or has the wrong shape.
    """
    check_shard_supported(shard)
    config = AutoConfig.from_pretrained(model_dir)
    model = _empty_model(config)
    groups = _group_tensor_names_by_layer(model_dir)
    layer_indices = sorted(index for index in groups if index is not None)
    total_layers = shard.model_card.n_layers
    if on_layer_loaded is not None:
        on_layer_loaded(0, total_layers)
    handles: dict[Path, Any] = {}
    unexpected: list[str] = []
    try:
        for done, index in enumerate([None, *layer_indices]):
            for path, name in groups.get(index, []):
                handle = handles.get(path)
                if handle is None:
                    handle = handles[path] = safe_open(str(path), framework="pt")
                tensor = handle.get_tensor(name)
                tensor = tensor.to(device=device, dtype=torch.float32)
                if not _assign_tensor(model, name, tensor):
                    unexpected.append(name)
            if index is not None and on_layer_loaded is not None:
                on_layer_loaded(done, total_layers)
    finally:
        handles.clear()
    if unexpected:
        logger.warning(
            "ignored {} tensors the model does not have: {}",
            len(unexpected),
            ", ".join(unexpected[:8]),
        )
    _tie_output_embeddings(model)
    missing = [name for name, parameter in model.named_parameters() if parameter.is_meta]
    if missing:
        raise ValueError(
            f"{model_dir} lacks {len(missing)} tensors the model needs, e.g. {missing[:5]}"
        )
    # Non-persistent buffers (rotary frequencies) follow the weights.
    torch.nn.Module.to(model, device)
    model.eval()
    model.requires_grad_(False)
    return model


def _tie_output_embeddings(model: PreTrainedModel) -> None:
    """Checkpoints with tied embeddings store the embedding once; share it with the LM head."""
    text_config = model.config.get_text_config()
    if not getattr(text_config, "tie_word_embeddings", False):
        return
    output_embeddings = model.get_output_embeddings()
    input_embeddings = model.get_input_embeddings()
    if output_embeddings is None or not isinstance(output_embeddings, torch.nn.Module):
        return
    if output_embeddings.weight.is_meta:
        output_embeddings.weight = input_embeddings.weight
