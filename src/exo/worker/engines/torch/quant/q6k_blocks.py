"""An LM head held as GGUF Q6_K blocks, byte for byte as the file stores them (`Q6KLinear`).

llama.cpp's Q4_K_M files keep `output.weight` in Q6_K: 210 bytes per 256 weights (6.5625
bits a weight: 6-bit values, an int8 scale per 16 weights, an fp16 `d` per 256). The
engine otherwise requantizes that head to int8 per output row (`Int8Linear`, 8 bits a
weight plus a scale a row): Qwen3-30B-A3B's 151,936 x 2,048 head reads 311 MB per decoded
token that way against 255 MB as Q6_K. Held as the blocks, nothing is rounded: the weights
are exactly llama.cpp's.

The product is exo's `q6k_gemv` (`native/q6k_blocks.cpp`): the activations rounded to int8
per block of 256 (as llama.cpp rounds them for its own Q6_K product), each block's sum
exact in int32, 512 bits wide with AVX512BW + VNNI (8 activation rows per weight read),
256 bits with AVX2 (`EXO_NATIVE_AVX512=0` forces that path where both are built), a
portable loop elsewhere. Any row count takes it (the head computes only logit rows).

Only used where exo's kernels are built (`built_int4_kernel`) and `Q6K_HEAD_ENV` is not
"0"; elsewhere a Q6_K head stays the engine's int8 head. Checkpoints from safetensors keep
the int8 head: requantizing a float head to 6 bits would lose accuracy that a Q6_K file has
already paid for, and would be a new quantizer to validate (see
docs/benchmarks/2026-12-07-q6k-lm-head.md for the figures behind the default).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch

from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear

# "0": a Q6_K LM head is requantized to the engine's int8 head as before; else (unset or
# "1") it is held as its blocks where exo's kernels are built.
Q6K_HEAD_ENV = "EXO_Q6K_HEAD"

Q6K_BLOCK_WEIGHTS = 256
Q6K_BLOCK_BYTES = 210


def q6k_head_wanted() -> bool:
    """Whether a Q6_K LM head is held as its blocks here: exo's kernels are built and
    `Q6K_HEAD_ENV` is not "0"."""
    return os.environ.get(Q6K_HEAD_ENV) != "0" and built_int4_kernel() is not None


class Q6KLinear(QuantizedLinear):
    """A weight `[out, in]` held as GGUF Q6_K blocks: uint8 `[out, in / 256 * 210]`, each
    row its blocks in the file's order and layout. Takes and gives float32 rows
    (`native` True).

    Args:
        blocks: uint8 `[out, in / 256 * 210]` (copied to a contiguous tensor if needed).
        bias: `[out]` or None.

    Raises:
        ValueError: not a uint8 matrix of whole Q6_K blocks, or exo's kernels are not built.
    """

    native = True

    def __init__(self, blocks: torch.Tensor, bias: torch.Tensor | None) -> None:
        if blocks.dim() != 2 or blocks.dtype != torch.uint8:
            raise ValueError(f"Q6_K blocks are a uint8 matrix, not {blocks.dtype} {blocks.dim()}-D")
        out_features, row_bytes = blocks.shape
        if row_bytes == 0 or row_bytes % Q6K_BLOCK_BYTES:
            raise ValueError(
                f"a Q6_K row of {row_bytes} bytes is not whole blocks of {Q6K_BLOCK_BYTES}"
            )
        if built_int4_kernel() is None:
            raise ValueError("Q6_K blocks need exo's native kernels")
        super().__init__(row_bytes // Q6K_BLOCK_BYTES * Q6K_BLOCK_WEIGHTS, out_features, bias)
        self.blocks: torch.Tensor
        self.register_buffer("blocks", blocks.contiguous())

    def rows(self, kept: slice, bias: torch.Tensor | None) -> Q6KLinear:
        """A module holding output rows `kept` (copies), with `bias`."""
        return Q6KLinear(self.blocks[kept].clone(), bias)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """`[rows, in]` → `[rows, out]` in the rows' dtype (exo's `q6k_gemv`, any row count)."""
        out: torch.Tensor = torch.ops.exo_native.q6k_gemv(rows.float().contiguous(), self.blocks)
        return out.to(rows.dtype)

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x)

    def dequantize_float(self) -> torch.Tensor:
        """The weight as `[out, in]` float32, exact (`gguf`'s own dequantizer)."""
        return torch.from_numpy(q6k_dequantized(self.blocks.numpy()))

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_float().to(torch.bfloat16)


def q6k_dequantized(raw: np.ndarray) -> np.ndarray:
    """float32 `[rows, in]` of uint8 Q6_K blocks `[rows, in / 256 * 210]` (`gguf`'s
    dequantizer, row blocks at a time to bound its temporaries)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    rows, row_bytes = raw.shape
    out = np.empty((rows, row_bytes // Q6K_BLOCK_BYTES * Q6K_BLOCK_WEIGHTS), np.float32)
    step = 4096
    for start in range(0, rows, step):
        chunk = np.ascontiguousarray(raw[start : start + step])
        out[start : start + step] = dequantize(chunk, GGMLQuantizationType.Q6_K).reshape(
            chunk.shape[0], -1
        )
    return out


def q6k_head(raw: Any, out_features: int, in_features: int) -> Q6KLinear | None:
    """A head of `out_features` x `in_features` from a safetensors slice of its raw Q6_K
    blocks (uint8 `[out, in / 256 * 210]`); None where the stored shape is not that."""
    rows, row_bytes = raw.get_shape()
    if rows != out_features or row_bytes * Q6K_BLOCK_WEIGHTS != in_features * Q6K_BLOCK_BYTES:
        return None
    blocks = torch.empty(rows, row_bytes, dtype=torch.uint8)
    step = 8192
    for start in range(0, rows, step):
        blocks[start : start + step] = raw[start : start + step]
    return Q6KLinear(blocks, None)
