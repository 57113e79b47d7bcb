"""A `deepseek2` GGUF's split MLA up-projection (`attn_k_b` / `attn_v_b`) joined back into
the checkpoint's `kv_b_proj`.

DeepSeek's `kv_b_proj.weight` is `[heads * (nope + v), kv_lora_rank]`, each head's rows its
`qk_nope_head_dim` key rows then its `v_head_dim` value rows. llama.cpp's converter
(`convert_hf_to_gguf.py`, `DeepseekV2Model.modify_tensors`, for its absorbed MLA) views it
as `[heads, nope + v, kv_lora_rank]`, splits the middle dimension into the key part and the
value part, and transposes the key part's last two dimensions:

- `attn_k_b.weight`: row-major `[heads, kv_lora_rank, nope]` (GGUF shape
  `[nope, kv_lora_rank, heads]`): `k_b[h, c, i] = kv_b[h * (nope + v) + i, c]`;
- `attn_v_b.weight`: row-major `[heads, v, kv_lora_rank]` (GGUF shape
  `[kv_lora_rank, v, heads]`): `v_b[h, j, c] = kv_b[h * (nope + v) + nope + j, c]`.

The key part's quantized rows run along `nope`, across the rows `kv_b_proj` has, so the
join dequantizes both parts (gguf's own dequantizer) and stores `kv_b_proj` as float32:
one float copy of a small tensor (DeepSeek-V3: 128 heads × 256 × 512 per layer, 4.1 GB
over 61 layers beside ~400 GB of Q4_K experts). Files from before the split keep one
`attn_kv_b` in the checkpoint's layout, mapped by name like any weight.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from exo.download.gguf_tensors import GgufTensor

_SPLIT = re.compile(r"^blk\.(?P<layer>\d+)\.attn_(?P<part>k|v)_b\.weight$")


class GgufMlaError(ValueError):
    """A split MLA tensor that is missing its other half or mis-shaped (named)."""


def _float_rows(tensor: GgufTensor) -> np.ndarray:
    """The tensor's values float32, row-major (`reversed(tensor.shape)`)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    values = dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.type_name])
    return np.asarray(values, np.float32).reshape(tuple(reversed(tensor.shape)))


def joined_kv_b(key: GgufTensor, value: GgufTensor, config: Any) -> GgufTensor:
    """`blk.N.attn_kv_b.weight` (F32, GGUF shape `[kv_lora_rank, heads * (nope + v)]`) from
    the layer's `attn_k_b` and `attn_v_b` (module docstring).

    Raises:
        GgufMlaError: a part whose shape is not the config's (named).
    """
    heads, latent = int(config.num_attention_heads), int(config.kv_lora_rank)
    nope, width = int(config.qk_nope_head_dim), int(config.v_head_dim)
    for tensor, expected in ((key, (nope, latent, heads)), (value, (latent, width, heads))):
        if tensor.shape != expected:
            raise GgufMlaError(
                f"{tensor.name} has shape {tensor.shape}, expected {expected} (GGUF order)"
            )
    key_rows = _float_rows(key).transpose(0, 2, 1)  # [heads, nope, latent]
    joined = np.concatenate([key_rows, _float_rows(value)], axis=1)  # [heads, nope + v, latent]
    rows = np.ascontiguousarray(joined.reshape(heads * (nope + width), latent))
    name = key.name.replace("attn_k_b", "attn_kv_b")
    return GgufTensor(name, "F32", (latent, heads * (nope + width)), rows.view(np.uint8).ravel())


def with_joined_kv_b(tensors: Iterable[GgufTensor], config: Any) -> Iterator[GgufTensor]:
    """`tensors` with each layer's `attn_k_b` / `attn_v_b` pair replaced by their
    `attn_kv_b` (`joined_kv_b`), yielded where the pair's second half is (a layer's parts
    may lie in different files of a split model); the rest unchanged, in order.

    Raises:
        GgufMlaError: a half without the other, a layer with `attn_kv_b` and a split pair,
            or a mis-shaped half (named).
    """
    waiting: dict[str, GgufTensor] = {}  # layer → the half seen first
    joint_layers: set[str] = set()
    split_layers: set[str] = set()
    for tensor in tensors:
        match = _SPLIT.match(tensor.name)
        if match is None:
            joint = re.match(r"^blk\.(\d+)\.attn_kv_b\.weight$", tensor.name)
            if joint is not None:
                joint_layers.add(joint.group(1))
            yield tensor
            continue
        layer = match.group("layer")
        split_layers.add(layer)
        other = waiting.pop(layer, None)
        if other is None:
            waiting[layer] = tensor
            continue
        key, value = (tensor, other) if match.group("part") == "k" else (other, tensor)
        yield joined_kv_b(key, value, config)
    if waiting:
        half = next(iter(waiting.values()))
        missing = (
            half.name.replace("_k_b", "_v_b")
            if "_k_b" in half.name
            else (half.name.replace("_v_b", "_k_b"))
        )
        raise GgufMlaError(f"the GGUF has {half.name} but no {missing}")
    both = sorted(joint_layers & split_layers, key=int)
    if both:
        raise GgufMlaError(
            f"blk.{both[0]} has attn_kv_b and attn_k_b / attn_v_b: one layout per layer"
        )
