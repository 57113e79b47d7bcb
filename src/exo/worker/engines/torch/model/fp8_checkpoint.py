"""Which tensors of a checkpoint are FP8 blocks and where their scales are, for the loader
(`loading.load_model`): any family's checkpoint with `quantization_config.quant_method =
"fp8"` loads, each FP8 weight widened per block (`quant.fp8_blocks`) and then held in the
node's format like a float checkpoint's.

A tensor is FP8 by its stored dtype (`F8_E4M3`, `F8_E5M2`), so the modules a checkpoint keeps
in bfloat16 (`modules_to_not_convert`, MiniMax's `ignored_layers`: embeddings, norms,
routers, the LM head) need no list here. The `*_scale_inv` tensors are no model tensors: the
planner skips them like any name the model lacks, and each is read with its weight, from
whichever file holds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from exo.worker.engines.torch.model.families import UnsupportedArchitectureError
from exo.worker.engines.torch.quant.fp8_blocks import (
    FP8_DTYPES,
    SCALE_SUFFIX,
    BlockSize,
    Fp8BlockSlice,
)


def _quantization_config(config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict (from the text config or the outer
    one of a wrapped checkpoint), or None."""
    quantization = getattr(config.get_text_config(), "quantization_config", None) or getattr(
        config, "quantization_config", None
    )
    if quantization is None:
        return None
    if isinstance(quantization, dict):
        return quantization
    return dict(quantization.to_dict())  # a transformers QuantizationConfigMixin


def fp8_block_size(config: Any) -> BlockSize | None:
    """The `weight_block_size` of a checkpoint whose `quantization_config.quant_method` is
    "fp8", or None for any other checkpoint.

    Raises:
        UnsupportedArchitectureError: an FP8 checkpoint without a block size of two positive
            integers (per-tensor FP8), or with scales stored other than as floats
            (`scale_fmt = "ue8m0"`, DeepSeek-V4's).
    """
    quantization = _quantization_config(config)
    if quantization is None:
        return None
    method = quantization.get("quant_method")
    if getattr(method, "value", method) != "fp8":
        return None
    block = quantization.get("weight_block_size")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(size, int) and size > 0 for size in block)
    ):
        raise UnsupportedArchitectureError(
            f"quantization_config.weight_block_size={block!r}: FP8 checkpoints load only "
            "block-quantized, with two positive block sizes (e.g. [128, 128])"
        )
    scale_format = quantization.get("scale_fmt", "float")
    if scale_format not in (None, "float"):
        raise UnsupportedArchitectureError(
            f"quantization_config.scale_fmt={scale_format!r}: FP8 block scales load only as "
            "floats (DeepSeek-V3's)"
        )
    return int(block[0]), int(block[1])


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    """A checkpoint's FP8 block format: the block size (None: the config declares no block
    FP8) and the file of every `*_scale_inv` tensor."""

    block: BlockSize | None
    scale_files: dict[str, Path]

    @classmethod
    def of(cls, config: Any, model_dir: Path) -> Fp8Checkpoint:
        """Read the block size from `config` and, for an FP8 checkpoint, the scales'
        locations from the safetensors headers in `model_dir` (no tensor data).

        Raises:
            UnsupportedArchitectureError: see `fp8_block_size`.
        """
        block = fp8_block_size(config)
        scale_files: dict[str, Path] = {}
        if block is not None:
            for path in sorted(model_dir.glob("*.safetensors")):
                with safe_open(str(path), framework="pt") as handle:
                    for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                        if name.endswith(SCALE_SUFFIX):
                            scale_files[name] = path
        return cls(block, scale_files)

    def widen(self, handle_for: Callable[[Path], Any], name: str, stored: Any) -> Any:
        """`stored` (the safetensors slice of checkpoint tensor `name`), or for an FP8
        weight an `Fp8BlockSlice` that reads as its float32 real weight.

        Raises:
            ValueError: an FP8 tensor without its `<name>_scale_inv`, or with scales not on
                its block grid (names the tensor).
            UnsupportedArchitectureError: an FP8 tensor in a checkpoint whose config
                declares no block FP8 (`quantization_config.weight_block_size`).
        """
        dtype = stored.get_dtype()
        if dtype not in FP8_DTYPES:
            return stored
        if self.block is None:
            raise UnsupportedArchitectureError(
                f"tensor {name} is {dtype}, but the config has no FP8 quantization_config "
                "(quant_method 'fp8' with weight_block_size): its scales' blocks are unknown"
            )
        scale_name = f"{name}{SCALE_SUFFIX}"
        path = self.scale_files.get(scale_name)
        if path is None:
            raise ValueError(
                f"FP8 tensor {name} has no {scale_name} in the checkpoint: its real values "
                "are unknown"
            )
        return Fp8BlockSlice(name, stored, handle_for(path).get_slice(scale_name), self.block)
