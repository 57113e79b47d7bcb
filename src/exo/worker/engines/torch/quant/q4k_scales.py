"""Compact Q4_K scales: an int4 weight converted from GGUF Q4_K keeps its super-blocks' scale
fields instead of a bfloat16 (scale, zero) pair per group of 32.

Per output row and super-block of 256 inputs, 20 bytes (`Q4K_SCALE_BYTES`): fp16 d, fp16
dmin (little-endian), the 8 sub-blocks' scales sc, then their 8 mins m, each a uint8 (Q4_K's
6-bit fields, unpacked at conversion so that a kernel widens them with one vector
instruction). Held as uint8 `[out, in / 256, 20]` (`Int4Linear.scales_and_zeros` in place
of the pairs), stored by the GGUF conversion as `<name>.int4_q4k_scales`, uint8
`[out, in / 256 * 20]` (2-d and row-major, so a family's row permutation applies as to the
packed nibbles). 4.625 bits per weight with the nibbles, against 5.0 with pairs.

Group g of a super-block has scale `d sc[g]` and zero `8 d sc[g] - dmin m[g]` in float32
(`gguf_repack.repack_q4_k`'s operations: both products are exact, the difference rounded
once); its weights are GGUF's `d sc q - dmin m` (q: 0..15). exo's decode kernels (up to
`NATIVE_BLOCK_MAX_ROWS` rows: decode and speculative verification) read the compact form and
use these values unrounded (`native/block_rows.h` `unpack_q4k_scales`: scale `d sc`, zero
term `-dmin m`, both exact), closer to the checkpoint than the old form's bfloat16 pairs.
The paths that read pairs round both to bfloat16 (nearest, ties to even) as the old form's
load does, so they compute bit for bit what they compute from an old conversion: prefill's
`block_matmul` and the portable loop expand per call (`native/q4k_scales.cpp`); torch's int4
layout (no native kernels) takes the pairs at load.

exo's layout holds the compact form only with `EXO_Q4K_COMPACT=1`; by default it too
expands to the pairs at load (the old form's products everywhere, 5.0 bits per weight): on
a contended 2-core Zen 4 the compact decode product was no faster from memory at one row
(an expert's gate/up and down together 0.996-1.019 times the pairs' time, 2026-12-06;
figures: docs/benchmarks/2026-12-06-compact-q4k-scales.md).
"""

from __future__ import annotations

import os
from typing import Any

import torch

# "1": hold compact scales as they are (exo's kernels); else (default) expand them to the
# bfloat16 pairs at load, the old form's products.
COMPACT_Q4K_ENV = "EXO_Q4K_COMPACT"
Q4K_SUPER_BLOCK = 256  # inputs per super-block
Q4K_GROUPS = 8  # groups of 32 inputs per super-block
Q4K_SCALE_BYTES = 20  # per output row and super-block: d, dmin (fp16), 8 sc, 8 m (uint8)


def is_q4k_scales(scales: torch.Tensor) -> bool:
    """Whether an int4 weight's held scales are the compact Q4_K form (else bf16 pairs)."""
    return scales.dtype == torch.uint8 and scales.dim() == 3 and scales.shape[2] == Q4K_SCALE_BYTES


def compact_scales_held() -> bool:
    """Whether exo's layout holds compact Q4_K scales as they are (`EXO_Q4K_COMPACT=1`);
    otherwise (the default) as the pairs they stand for, as torch's layout always does."""
    return os.environ.get(COMPACT_Q4K_ENV, "0") == "1"


def q4k_scales_and_zeros(compact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales and zeros `[out, in / 32]` of compact scales `[out, in / 256, 20]`,
    exactly the values `gguf_repack.repack_q4_k` computes (and old conversions stored)."""
    out_features = compact.shape[0]
    halves = compact[..., 0:4].contiguous().view(torch.float16).float()  # [out, sb, 2]
    d, dmin = halves[..., 0:1], halves[..., 1:2]
    scales = d * compact[..., 4:12].float()  # exact (11 + 6 significant bits)
    mins = dmin * compact[..., 12:20].float()
    zeros = 8.0 * scales - mins
    return scales.reshape(out_features, -1), zeros.reshape(out_features, -1)


def q4k_scale_pairs(compact: torch.Tensor) -> torch.Tensor:
    """The bfloat16 (scale, zero) pairs `[out, in / 32, 2]` the old form loads to."""
    scales, zeros = q4k_scales_and_zeros(compact)
    return torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)


def compact_from_stored(stored: torch.Tensor) -> torch.Tensor:
    """The stored 2-d form `[out, in / 256 * 20]` as held, `[out, in / 256, 20]`."""
    return stored.reshape(stored.shape[0], -1, Q4K_SCALE_BYTES)


class Q4kScalesPart:
    """A safetensors slice of stored compact scales `[out, in / 256 * 20]` seen as an
    `[out, in]` tensor for a tensor-parallel reader: rows as stored, columns (input indices,
    whole super-blocks only) mapped to their super-blocks. Returns `[rows, blocks, 20]`."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        rows, row_bytes = raw.get_shape()
        self._shape = [rows, row_bytes // Q4K_SCALE_BYTES * Q4K_SUPER_BLOCK]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        held = compact_from_stored(self._raw[rows])
        start, stop, step = columns.indices(self._shape[1])
        if step != 1 or start % Q4K_SUPER_BLOCK or stop % Q4K_SUPER_BLOCK:
            raise ValueError(f"columns {start}:{stop} cut a Q4_K super-block")
        return held[:, start // Q4K_SUPER_BLOCK : stop // Q4K_SUPER_BLOCK].contiguous()


class Q4kGroupPart:
    """A safetensors slice of stored compact scales seen as the old form's scales or zeros
    (`part`), float32 `[out, in / 32]`: for the routes that take groups (a tensor-parallel
    split that cuts a super-block, a dequantized weight)."""

    def __init__(self, raw: Any, part: str) -> None:
        self._raw, self._part = raw, part
        rows, row_bytes = raw.get_shape()
        self._shape = [rows, row_bytes // Q4K_SCALE_BYTES * Q4K_GROUPS]

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def __getitem__(self, key: Any) -> torch.Tensor:
        rows, columns = (key, slice(None)) if not isinstance(key, tuple) else key
        scales, zeros = q4k_scales_and_zeros(compact_from_stored(self._raw[rows]))
        return (scales if self._part == "scales" else zeros)[:, columns]
