"""GGUF weights repacked for the engine with integer operations on the raw block bytes.

`convert_gguf` writes an HF-format directory (config.json, tokenizer, generation config,
safetensors files of about `SHARD_BYTES`) whose weights are the GGUF's own quantized values,
never dequantized to float32 and quantized again. A MoE GGUF's stacked expert tensors become
one weight per expert, each repacked as below (`gguf_experts`); a split GGUF
(`-0000i-of-0000N`) is read as one (`gguf_tensors.read_gguf_model`).

- **Q4_0, Q4_1, Q4_K** become the engine's int4 groups of 32 (`INT4_GROUP_SIZE`, the layout of
  `int4_groups.Int4Linear`: `w = (q - 8) * scale + zero` per group). The 4-bit values are moved
  by shifts and masks; only the per-group scale and zero are computed, in float32 from the
  block's fp16 fields (exact up to float32 rounding of one product and one sum), and stored
  in float32, so a float32 load gives the GGUF's values; the int4 kernel holds them in
  bfloat16, the one loss of the int4 path. Q4_0 (`x = (q - 8) d`): scale d, zero 0.
  Q4_1 (`x = q d + m`): scale d, zero m + 8d. Q4_K (super-blocks of 256 with eight 6-bit
  sub-block scales and mins, `x = d sc q - dmin m`): one group per sub-block of 32, scale
  d·sc, zero 8 d·sc - dmin·m.
  Stored as `<name>.int4_packed` (uint8 `[out, in / 2]`, column 2j in the low nibble of byte j,
  2j + 1 in the high one), and for Q4_0 / Q4_1 `<name>.int4_scales` and `<name>.int4_zeros`
  (float32 `[out, in / 32]`, 1/4 byte per weight): plain row-major, so a tensor-parallel
  rank reads its rows or columns like any weight's. Q4_K keeps its super-blocks' scale
  fields instead, `<name>.int4_q4k_scales` (uint8 `[out, in / 256 * 20]`: per super-block
  fp16 d and dmin, then the eight 6-bit scales and eight mins each widened to a byte;
  `q4k_compact_scales`), from which the engine derives the earlier form's bfloat16 pairs
  bit for bit, or which it holds as they are with `EXO_Q4K_COMPACT=1` (4.625 bits per
  weight with the nibbles, against 5; `exo.worker.engines.torch.quant.q4k_scales`).
  Directories converted before (Q4_K with `.int4_scales` / `.int4_zeros`) still load.
- **Every other quantized type** (Q5_0, Q5_1, Q6_K, Q8_0, ...) is stored as its raw GGUF
  blocks, `<name>.gguf_<TYPE>` (uint8 `[out, bytes per row]`), the smallest lossless form, and
  dequantized by `gguf`'s own dequantizer when loaded
  (`exo.worker.engines.torch.quant.gguf_weights`).
- **F32, F16, BF16** tensors are stored as they are.

Block layouts are GGML's (`ggml-quants.c`, `gguf.quants`); tensor names and the per-family
corrections (llama.cpp permutes the rows of llama Q/K projections; Gemma norms are stored
plus one) come from transformers' GGUF loader (`TENSOR_PROCESSORS`, `get_gguf_hf_weights_map`),
whose corrections are row permutations for quantized weights and so apply to packed rows,
raw blocks and scales alike.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from exo.download.gguf_configs import DEEPSEEK2, METADATA_CONFIGS, metadata_config
from exo.download.gguf_experts import (
    GGUF_EXPERT_LAYOUTS,
    StackedExperts,
    check_experts,
    configure_experts,
    expert_slices,
    stacked_kind,
)
from exo.download.gguf_gptoss import (
    ARCHITECTURES as GPT_OSS_ARCHITECTURES,
)
from exo.download.gguf_gptoss import (
    OLLAMA_GPTOSS,
    gptoss_config,
    gptoss_tokenizer,
    harmony_stop_ids,
    ollama_first_names,
    ollama_first_row_splits,
    repack_mxfp4,
    repack_ollama_mxfp4,
)
from exo.download.gguf_mla import with_joined_kv_b
from exo.download.gguf_tensors import (
    OLLAMA_MXFP4,
    GgufDirectory,
    GgufTensor,
    decoder_tensors,
    read_gguf_model,
)
from exo.download.gguf_tokenizers import load_gguf_tokenizer
from exo.shared.models.tensor_names import INT4_PACKED, INT4_Q4K_SCALES, INT4_SCALES, INT4_ZEROS
from exo.shared.models.weight_formats import INT4_GROUP_SIZE

GGUF_BLOCKS = ".gguf_"
REPACK_FORMAT = "exo-gguf-repack-1"  # safetensors metadata value of "format_exo"

# GGML block sizes and bytes per block (ggml-common.h).
_Q4_0_BYTES = 18  # fp16 d, 16 bytes of nibbles
_Q4_1_BYTES = 20  # fp16 d, fp16 m, 16 bytes of nibbles
_Q4_K_BYTES = 144  # fp16 d, fp16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles
_Q4_K_ELEMENTS = 256
INT4_TYPES = ("Q4_0", "Q4_1", "Q4_K")
# Float GGML types, stored as they are (BF16 read as int16 bits, viewed as bfloat16 later).
_FLOATS: dict[str, np.dtype[Any]] = {
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(np.int16),
}


class GgufRepackError(ValueError):
    """A GGUF tensor that cannot be repacked (named, with the reason)."""


@dataclass(frozen=True, slots=True)
class Int4Groups:
    """One weight in the engine's int4 form, shapes for `[out, in]`.

    packed: uint8 `[out, in / 2]` (column 2j low nibble, 2j + 1 high), values q in 0..15.
    scales, zeros: float32 `[out, in / 32]`; `w = (q - 8) * scale + zero`.
    """

    packed: np.ndarray
    scales: np.ndarray
    zeros: np.ndarray


def _fp16(raw: np.ndarray) -> np.ndarray:
    """Bytes `[..., 2]` (little-endian fp16) as float32 `[...]`."""
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _pack_pairs(values: np.ndarray, rows: int) -> np.ndarray:
    """uint8 values 0..15 `[rows, ..., even]` → bytes `[rows, n / 2]`, pairs in one byte."""
    flat = values.reshape(rows, -1)
    packed: np.ndarray = flat[:, 0::2] | (flat[:, 1::2] << 4)
    return packed


def _blocks(data: np.ndarray, rows: int, block_bytes: int, what: str) -> np.ndarray:
    """Raw tensor bytes `[rows, row bytes]` as `[rows, blocks, block_bytes]`."""
    data = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if data.shape[1] % block_bytes:
        raise GgufRepackError(f"{what}: {data.shape[1]} bytes per row is no whole block count")
    return data.reshape(rows, -1, block_bytes)


def repack_q4_0(data: np.ndarray, rows: int) -> Int4Groups:
    """Q4_0 blocks (32 values: fp16 d, then byte j holds values j (low) and j + 16 (high);
    `x = (q - 8) d`) of a `[rows, in]` weight → int4 groups with scale d, zero 0."""
    blocks = _blocks(data, rows, _Q4_0_BYTES, "Q4_0")
    nibbles = blocks[..., 2:]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [rows, blocks, 32]
    scales = _fp16(blocks[..., 0:2])
    return Int4Groups(_pack_pairs(values, rows), scales, np.zeros_like(scales))


def repack_q4_1(data: np.ndarray, rows: int) -> Int4Groups:
    """Q4_1 blocks (fp16 d, fp16 m, nibbles as Q4_0; `x = q d + m`) → scale d, zero m + 8d."""
    blocks = _blocks(data, rows, _Q4_1_BYTES, "Q4_1")
    nibbles = blocks[..., 4:]
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)
    scales = _fp16(blocks[..., 0:2])
    return Int4Groups(_pack_pairs(values, rows), scales, _fp16(blocks[..., 2:4]) + 8.0 * scales)


def _q4_k_scales_and_mins(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 12 bytes of 6-bit scales and mins of Q4_K super-blocks `[..., 12]` → two uint8
    arrays `[..., 8]` (ggml's `get_scale_min_k4`): sub-blocks 0-3 keep the low 6 bits of
    bytes 0-3 (scales) and 4-7 (mins); sub-blocks 4-7 take 4 bits from bytes 8-11 and their
    top 2 bits from the top of bytes 0-3 (scales) and 4-7 (mins)."""
    low, high, extra = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = np.concatenate([low & 63, (extra & 15) | ((low >> 6) << 4)], axis=-1)
    mins = np.concatenate([high & 63, (extra >> 4) | ((high >> 6) << 4)], axis=-1)
    return scales, mins


def repack_q4_k(data: np.ndarray, rows: int) -> Int4Groups:
    """Q4_K super-blocks (256 values: fp16 d, fp16 dmin, 12 bytes of scales/mins, 128 bytes:
    per 64 values 32 bytes, low nibbles the first sub-block of 32, high the second;
    `x = d sc q - dmin m`) → one group per sub-block: scale d sc, zero 8 d sc - dmin m."""
    blocks = _blocks(data, rows, _Q4_K_BYTES, "Q4_K")
    d = _fp16(blocks[..., 0:2])[..., None]
    dmin = _fp16(blocks[..., 2:4])[..., None]
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    nibbles = blocks[..., 16:].reshape(rows, -1, 4, 1, 32)
    values = np.concatenate([nibbles & 15, nibbles >> 4], axis=3)  # [rows, sb, 4, 2, 32]
    scales = (d * sub_scales.astype(np.float32)).reshape(rows, -1)
    mins = (dmin * sub_mins.astype(np.float32)).reshape(rows, -1)
    return Int4Groups(_pack_pairs(values, rows), scales, 8.0 * scales - mins)


def q4k_compact_scales(data: np.ndarray, rows: int) -> np.ndarray:
    """The compact scales of a `[rows, in]` Q4_K weight's super-blocks: per super-block its
    fp16 d and dmin bytes as they are, then the 8 sub-block scales and the 8 mins as uint8
    (`_q4_k_scales_and_mins`), 20 bytes; uint8 `[rows, in / 256 * 20]` (the layout of
    `exo.worker.engines.torch.quant.q4k_scales`)."""
    blocks = _blocks(data, rows, _Q4_K_BYTES, "Q4_K")
    sub_scales, sub_mins = _q4_k_scales_and_mins(blocks[..., 4:16])
    compact: np.ndarray = np.concatenate([blocks[..., 0:4], sub_scales, sub_mins], axis=-1)
    return compact.reshape(rows, -1)


_REPACKERS = {"Q4_0": repack_q4_0, "Q4_1": repack_q4_1, "Q4_K": repack_q4_k}


def repack_int4(type_name: str, data: np.ndarray, rows: int) -> Int4Groups:
    """Repack a `[rows, in]` weight's raw blocks of GGML type `type_name` (one of
    `INT4_TYPES`) into int4 groups of `INT4_GROUP_SIZE`.

    Raises:
        GgufRepackError: another type, or bytes that are no whole blocks.
    """
    repacker = _REPACKERS.get(type_name)
    if repacker is None:
        raise GgufRepackError(f"{type_name} has no int4 repacking; supported: {INT4_TYPES}")
    groups = repacker(data, rows)
    assert groups.scales.shape[1] * INT4_GROUP_SIZE == groups.packed.shape[1] * 2
    return groups


def dequantize_int4(groups: Int4Groups) -> np.ndarray:
    """The float32 `[out, in]` weight of `groups`: `(q - 8) * scale + zero` per group."""
    rows = groups.packed.shape[0]
    values = np.stack([groups.packed & 15, groups.packed >> 4], axis=-1).reshape(
        rows, -1, INT4_GROUP_SIZE
    )
    weight = (values.astype(np.float32) - 8.0) * groups.scales[..., None] + groups.zeros[..., None]
    result: np.ndarray = weight.reshape(rows, -1)
    return result


@dataclass(frozen=True, slots=True)
class GgufConversion:
    """What `convert_gguf` did: seconds, the process's peak RSS afterwards (bytes; the
    process-lifetime maximum, `getrusage`), bytes written, tensors per stored form."""

    seconds: float
    peak_rss_bytes: int
    bytes_on_disk: int
    int4_tensors: int
    gguf_block_tensors: int
    float_tensors: int


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def gguf_name_map(architecture: str, checkpoint_names: list[str], layers: int) -> dict[str, str]:
    """GGUF tensor name → checkpoint name for the names a model of `architecture` (GGUF's
    `general.architecture`) has, by gguf-py's `TensorNameMap` (what transformers'
    `get_gguf_hf_weights_map` uses, built once here instead of once per module)."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == architecture), None)
    if arch is None:
        raise GgufRepackError(f"gguf-py knows no architecture {architecture!r}")
    name_map = get_tensor_name_map(arch, layers)
    mapping: dict[str, str] = {}
    for name in checkpoint_names:
        base, dot, suffix = name.rpartition(".")
        if suffix not in ("weight", "bias"):
            base, dot, suffix = name, "", ""
        gguf_name = name_map.get_name(base)
        if gguf_name is None and not dot and base.endswith("_bias"):
            # llama.cpp renames `e_score_correction_bias` to `e_score_correction.bias`
            gguf_name = name_map.get_name(base.removesuffix("_bias"))
            dot, suffix = (".", "bias") if gguf_name is not None else ("", "")
        if gguf_name is not None:
            mapping.setdefault(f"{gguf_name}{dot}{suffix}", name)
            if not dot:  # a bare parameter (gpt-oss's sinks): llama.cpp appends ".weight"
                mapping.setdefault(f"{gguf_name}.weight", name)
    return mapping


def _processed(processor: Any, array: np.ndarray, gguf_name: str) -> np.ndarray:
    """`array` after the family's correction for tensor `gguf_name` (for a quantized weight
    a row permutation, checked: the shape must stay)."""
    result: np.ndarray = processor.process(weights=array, name=gguf_name).weights
    if result.shape != array.shape:
        raise GgufRepackError(
            f"{gguf_name}: transformers' correction changes its shape {array.shape}; "
            "it cannot be applied to packed rows"
        )
    return np.ascontiguousarray(result)


def _store(
    stored: dict[str, torch.Tensor],
    counts: dict[str, int],
    name: str,
    gguf_name: str,
    type_name: str,
    shape: tuple[int, ...],
    data: np.ndarray,
    processor: Any,
) -> None:
    """Put weight `name` (GGUF tensor `gguf_name`, `[out, in]` `shape`, raw bytes `data`) into
    `stored` in its stored form (the module docstring), after the family's correction
    (`processor`; None: none)."""

    def corrected(array: np.ndarray) -> np.ndarray:
        return array if processor is None else _processed(processor, array, gguf_name)

    if type_name in _FLOATS:
        values = data.view(_FLOATS[type_name]).reshape(shape)
        if processor is not None:
            values = processor.process(weights=values, name=gguf_name).weights
        processed = np.array(values)
        if processed.shape != shape:
            raise GgufRepackError(f"{gguf_name}: a correction changed its shape")
        stored[name] = torch.from_numpy(processed)
        if type_name == "BF16":
            stored[name] = stored[name].view(torch.bfloat16)
        counts["float"] += 1
        return
    if len(shape) != 2:
        raise GgufRepackError(f"{gguf_name}: a quantized tensor of shape {shape}")
    rows = shape[0]
    data = data.reshape(rows, -1)
    if type_name in INT4_TYPES and shape[1] % INT4_GROUP_SIZE == 0:
        groups = repack_int4(type_name, data, rows)
        stored[name + INT4_PACKED] = torch.from_numpy(corrected(groups.packed))
        if type_name == "Q4_K":
            stored[name + INT4_Q4K_SCALES] = torch.from_numpy(
                corrected(q4k_compact_scales(data, rows))
            )
        else:
            for suffix, part in ((INT4_SCALES, groups.scales), (INT4_ZEROS, groups.zeros)):
                stored[name + suffix] = torch.from_numpy(corrected(part))
        counts["int4"] += 1
    else:
        stored[f"{name}{GGUF_BLOCKS}{type_name}"] = torch.from_numpy(
            np.array(corrected(data), copy=True)
        )
        counts["gguf_blocks"] += 1


def repacked_tensor_groups(
    tensors: Iterable[GgufTensor],
    processor: Any,
    name_map: Mapping[str, str],
    experts: StackedExperts | None = None,
    counts: dict[str, int] | None = None,
    row_splits: Mapping[str, Sequence[tuple[str, int, int]]] | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Every mapped tensor of the GGUF in its stored form (the module docstring), one GGUF
    tensor at a time; a stacked expert tensor (`experts`' kinds) as one weight per expert
    (`gguf_experts.expert_slices`), uncorrected.

    Args:
        tensors: the file's tensors (`gguf_tensors.read_gguf_model`), read once.
        processor: transformers' tensor processor for the file's architecture.
        name_map: GGUF tensor name → checkpoint name (tensors not in it are skipped).
        experts: the architecture's stacked expert layout, None for a dense one.
        counts: incremented per stored form ("int4", "gguf_blocks", "float").
        row_splits: a GGUF tensor holding several checkpoint tensors' rows (Ollama's first
            gpt-oss blobs' `attn_qkv`) → (checkpoint name, first row, end row) of each,
            stored uncorrected.

    Yields:
        The stored tensors of one GGUF tensor, by stored name.

    Raises:
        GgufRepackError: a quantized tensor that is not 2-D (nor a stacked expert tensor).
    """
    counts = {"int4": 0, "gguf_blocks": 0, "float": 0} if counts is None else counts
    for tensor in tensors:
        stored: dict[str, torch.Tensor] = {}
        if experts is not None and stacked_kind(tensor.name, experts) is not None:
            for expert_name, data, shape in expert_slices(tensor, experts):
                if tensor.type_name in _MXFP4_TYPES:  # exo's MXFP4 (`Mxfp4Linear`)
                    blocks, scales = _MXFP4_TYPES[tensor.type_name](data, shape[0])
                    linear = expert_name.removesuffix(".weight")
                    stored[f"{linear}.blocks"] = torch.from_numpy(blocks)
                    stored[f"{linear}.scales"] = torch.from_numpy(scales)
                    counts["gguf_blocks"] += 1
                    continue
                _store(
                    stored, counts, expert_name, tensor.name, tensor.type_name, shape, data, None
                )
            yield stored
            continue
        if row_splits is not None and tensor.name in row_splits:
            shape = tuple(reversed(tensor.shape))  # [out, in] or [out]
            rows = tensor.data.reshape(shape[0], -1)
            for part_name, start, end in row_splits[tensor.name]:
                part_shape = (end - start, *shape[1:])
                part = np.ascontiguousarray(rows[start:end]).reshape(-1)
                type_name = tensor.type_name
                _store(stored, counts, part_name, tensor.name, type_name, part_shape, part, None)
            yield stored
            continue
        name = name_map.get(tensor.name)
        if name is None:
            continue
        shape = tuple(reversed(tensor.shape))  # [out, in]
        _store(stored, counts, name, tensor.name, tensor.type_name, shape, tensor.data, processor)
        yield stored


def repacked_tensors(
    tensors: Sequence[GgufTensor], processor: Any, name_map: Mapping[str, str]
) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
    """`repacked_tensor_groups` of a dense GGUF gathered into one dict, with the counts."""
    counts = {"int4": 0, "gguf_blocks": 0, "float": 0}
    stored: dict[str, torch.Tensor] = {}
    for group in repacked_tensor_groups(tensors, processor, name_map, None, counts):
        stored.update(group)
    return stored, counts


# GGUF MXFP4 types → their repacking into exo's MXFP4 blocks and scales (`gguf_gptoss`).
_MXFP4_TYPES = {"MXFP4": repack_mxfp4, OLLAMA_MXFP4: repack_ollama_mxfp4}

# Bytes of repacked tensors per safetensors file written: bounds the conversion's memory to
# about this plus one GGUF tensor (a 30B MoE GGUF is ~17 GB).
SHARD_BYTES = 1 << 30


def _write_shards(groups: Iterator[dict[str, torch.Tensor]], output_dir: Path) -> None:
    """Write the tensors `groups` yields into `model-0000i.safetensors` files of about
    `SHARD_BYTES` each (one file: `model.safetensors`)."""
    from safetensors.torch import save_file

    metadata = {"format": "pt", "format_exo": REPACK_FORMAT}
    written: list[Path] = []
    pending: dict[str, torch.Tensor] = {}
    pending_bytes = 0

    def flush() -> None:
        nonlocal pending, pending_bytes
        path = output_dir / f"model-{len(written) + 1:05d}.safetensors"
        save_file(pending, str(path), metadata=metadata)
        written.append(path)
        pending, pending_bytes = {}, 0

    for group in groups:
        pending.update(group)
        pending_bytes += sum(tensor.nbytes for tensor in group.values())
        if pending_bytes >= SHARD_BYTES:
            flush()
    if pending or not written:
        flush()
    if len(written) == 1:
        written[0].rename(output_dir / "model.safetensors")


def convert_gguf(gguf_path: Path, output_dir: Path) -> GgufConversion:
    """Write the GGUF at `gguf_path` (a single file, or the first part of a split one:
    `gguf_tensors.gguf_parts`) into `output_dir` (which must exist) as config.json,
    generation_config.json, tokenizer files (with chat template) and safetensors files of
    repacked weights (`model.safetensors`, or `model-0000i.safetensors` of about
    `SHARD_BYTES` each), read by `exo.worker.engines.torch.model.loading.load_model`. A MoE
    architecture's stacked experts become one weight per expert (`gguf_experts`); the
    `deepseek2` and `glm4moe` configs are built from the metadata (`gguf_configs`).

    Raises:
        GgufRepackError: a tensor that cannot be repacked.
        GgufExpertsError: a MoE GGUF's expert tensor missing or mis-shaped, or its metadata
            lacking a key its layout needs (named).
        GgufConfigError: a `deepseek2` / `glm4moe` GGUF whose metadata lacks a key or
            states a router the family does not compute (`gguf_configs`, named).
        GgufMlaError: a `deepseek2` GGUF's `attn_k_b` / `attn_v_b` unpaired or mis-shaped.
        ValueError / OSError: from transformers or gguf for a file they cannot read
            (not GGUF, an architecture transformers has no GGUF support for).
    """
    from transformers import AutoConfig, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    from exo.shared.models.skeleton import empty_model

    started = time.perf_counter()
    gguf_dir, gguf_name = str(gguf_path.parent), gguf_path.name
    directory = read_gguf_model(gguf_path)
    architecture = directory.architecture
    experts = GGUF_EXPERT_LAYOUTS.get(architecture)
    if architecture in GPT_OSS_ARCHITECTURES:  # transformers' GGUF config reader fails
        config = gptoss_config(directory, _mxfp4_experts(directory, experts))
    elif architecture in METADATA_CONFIGS:  # transformers' GGUF reader lacks them
        config = metadata_config(directory)
    else:  # the metadata (and tokenizer) are in the first part of a split model
        config = AutoConfig.from_pretrained(gguf_dir, gguf_file=gguf_name)
    text_config = config.get_text_config()
    # transformers decides from the first part's tensors alone.
    text_config.tie_word_embeddings = all(t.name != "output.weight" for t in directory.tensors)
    if experts is not None:
        configure_experts(text_config, directory, experts)
        check_experts(directory, experts, text_config)
    skeleton = empty_model(config)
    checkpoint_names = list(skeleton.state_dict())
    del skeleton
    layers = text_config.num_hidden_layers
    row_splits = None
    if architecture == OLLAMA_GPTOSS:  # gguf-py has no names for it
        name_map = ollama_first_names(layers)
        row_splits = ollama_first_row_splits(text_config)
    else:
        name_map = gguf_name_map(architecture, checkpoint_names, layers)
    heads = {
        "num_attention_heads": text_config.num_attention_heads,
        "num_key_value_heads": text_config.num_key_value_heads,
    }
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=heads)
    counts = {"int4": 0, "gguf_blocks": 0, "float": 0}
    tensors: Iterable[GgufTensor] = decoder_tensors(directory.tensors, layers)
    if architecture == DEEPSEEK2:
        tensors = with_joined_kv_b(tensors, text_config)
    groups = repacked_tensor_groups(tensors, processor, name_map, experts, counts, row_splits)
    _write_shards(groups, output_dir)
    pre_tokenizer = directory.metadata.get("tokenizer.ggml.pre")
    del directory
    config.architectures = [_architecture_name(config)]
    config.dtype = torch.float32
    config.save_pretrained(output_dir)
    generation = GenerationConfig.from_model_config(config)
    if architecture in GPT_OSS_ARCHITECTURES:
        tokenizer = gptoss_tokenizer(gguf_path, pre_tokenizer)
        generation.eos_token_id = harmony_stop_ids(
            tokenizer, config.eos_token_id, config.vocab_size
        )
    else:  # AutoTokenizer would read the config first, which fails for METADATA_CONFIGS
        read_config = architecture not in METADATA_CONFIGS
        tokenizer = load_gguf_tokenizer(gguf_path, pre_tokenizer, read_config)
    generation.save_pretrained(output_dir)
    tokenizer.save_pretrained(output_dir)
    written = sum(path.stat().st_size for path in output_dir.iterdir() if path.is_file())
    return GgufConversion(
        seconds=time.perf_counter() - started,
        peak_rss_bytes=_peak_rss_bytes(),
        bytes_on_disk=written,
        int4_tensors=counts["int4"],
        gguf_block_tensors=counts["gguf_blocks"],
        float_tensors=counts["float"],
    )


def _mxfp4_experts(directory: GgufDirectory, experts: StackedExperts | None) -> bool:
    """Whether the stacked expert weights are MXFP4 (all of them; False: none is).

    Raises:
        GgufRepackError: some are MXFP4 and some not (the engine holds one format).
    """
    types = {
        tensor.type_name
        for tensor in directory.tensors
        if experts is not None
        and tensor.name.endswith(".weight")
        and stacked_kind(tensor.name, experts) is not None
    }
    mxfp4 = types & set(_MXFP4_TYPES)
    if mxfp4 and types - mxfp4:
        raise GgufRepackError(f"expert weights in MXFP4 and {sorted(types - mxfp4)} mixed")
    return bool(mxfp4)


def _architecture_name(config: Any) -> str:
    from transformers import AutoModelForCausalLM

    mapping: Any = AutoModelForCausalLM._model_mapping
    return str(mapping[type(config)].__name__)
