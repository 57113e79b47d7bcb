"""FP8 block-quantized weights (DeepSeek-V3 / V3.1, Kimi-K2, MiniMax-M2 checkpoints:
`quantization_config.quant_method = "fp8"`), widened to float32 while loading.

The format (DeepSeek-V3's release; transformers' `FineGrainedFP8Config`, vLLM's and
sglang's block FP8): a linear's `weight` is float8 (E4M3, `[out, in]`, or `[..., out, in]`
for stacked experts) and its `weight_scale_inv` float32 `[..., ceil(out / rows),
ceil(in / columns)]` with `(rows, columns)` the config's `weight_block_size` (128 x 128 in
every released checkpoint). The real weight is `weight.float() * weight_scale_inv[i // rows,
j // columns]`: one scale per block, the last block of a row or column partial where the
size is no multiple of the block (DeepSeek-V3's `kv_a_proj_with_mqa` `[576, 7168]` has a
`[5, 56]` grid). Despite its name the scale multiplies; it is the inverse of the factor
used to quantize.

The engine has no FP8 kernels: each weight is widened here, then quantized to the node's
format (int4 groups on CPU) like any float checkpoint's. A rank reads only the blocks that
cover its slice (`Fp8BlockSlice`).
"""

from __future__ import annotations

from typing import Any

import torch

# safetensors' dtype names of the FP8 formats a block checkpoint may store.
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
SCALE_SUFFIX = "_scale_inv"
BlockSize = tuple[int, int]


def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def scale_grid(shape: tuple[int, ...] | list[int], block: BlockSize) -> tuple[int, ...]:
    """The shape of the `weight_scale_inv` of an FP8 weight of `shape` (`[..., out, in]`)."""
    *leading, rows, columns = shape
    return (*leading, _ceil_div(rows, block[0]), _ceil_div(columns, block[1]))


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: BlockSize
) -> torch.Tensor:
    """The real weight of an FP8 block-quantized tensor, in float32.

    Args:
        weight: float8 `[..., out, in]` (a slice starting on a block boundary).
        scale_inv: its blocks' scales `[..., ceil(out / block[0]), ceil(in / block[1])]`.
        block: (rows, columns) of a block, the config's `weight_block_size`.

    Returns:
        float32 `[..., out, in]`: every block's values times its scale.

    Raises:
        ValueError: `scale_inv`'s shape is not the block grid of `weight`'s.
    """
    expected = scale_grid(tuple(weight.shape), block)
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scales of shape {tuple(scale_inv.shape)} for an FP8 weight of shape "
            f"{tuple(weight.shape)} in blocks of {block}: expected {expected}"
        )
    rows, columns = weight.shape[-2:]
    result = weight.to(torch.float32)
    # Each block row's scales widened to the weight's columns ([..., grid rows, in]: 1 /
    # block[0] of the weight), then one broadcast product over the whole block rows and
    # one over a partial last one (a loop over block rows was 10x slower).
    scales = scale_inv.to(torch.float32).repeat_interleave(block[1], dim=-1)[..., :columns]
    whole = rows // block[0]
    if whole:
        body = result[..., : whole * block[0], :].unflatten(-2, (whole, block[0]))
        body.mul_(scales[..., :whole, None, :])
    if whole * block[0] < rows:
        result[..., whole * block[0] :, :].mul_(scales[..., whole : whole + 1, :])
    return result


def quantize_fp8_blocks(
    weight: torch.Tensor, block: BlockSize
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a float `[..., out, in]` weight to E4M3 per block (each block's largest
    magnitude mapped to E4M3's largest finite value, 448), as block FP8 checkpoints store
    it; for tests and tiny checkpoints.

    Returns:
        (float8_e4m3fn weight `[..., out, in]`, float32 `weight_scale_inv` on the block grid).
    """
    rows, columns = weight.shape[-2:]
    grid = scale_grid(tuple(weight.shape), block)
    padded = torch.zeros(
        (*weight.shape[:-2], grid[-2] * block[0], grid[-1] * block[1]), dtype=torch.float32
    )
    padded[..., :rows, :columns] = weight.float()
    blocks = padded.unflatten(-1, (grid[-1], block[1])).unflatten(-3, (grid[-2], block[0]))
    # [..., grid rows, block rows, grid columns, block columns]
    largest = blocks.abs().amax(dim=(-3, -1))
    scale_inv = torch.where(largest > 0, largest / torch.finfo(torch.float8_e4m3fn).max, 1.0)
    quantized = (blocks / scale_inv[..., :, None, :, None]).to(torch.float8_e4m3fn)
    stored = quantized.flatten(-2).flatten(-3, -2)[..., :rows, :columns].contiguous()
    return stored, scale_inv.contiguous()


class Fp8BlockSlice:
    """A safetensors slice of an FP8 weight that reads as its float32 real weight: indexing
    it (slices of step 1, as the parallel readers cut rows, columns or experts) reads only
    the FP8 blocks and scales covering the requested part and returns that part widened.
    Stands in for `safe_open(...).get_slice(name)` in the loader's tensor readers."""

    def __init__(self, name: str, weight: Any, scale_inv: Any, block: BlockSize) -> None:
        """`weight` and `scale_inv`: safetensors slices of the FP8 tensor `name` and of its
        `name + "_scale_inv"`.

        Raises:
            ValueError: the scales' shape is not the weight's block grid (names both).
        """
        self.name = name
        self._weight = weight
        self._scale_inv = scale_inv
        self.block = block
        self._shape = tuple(int(size) for size in weight.get_shape())
        expected = scale_grid(self._shape, block) if len(self._shape) >= 2 else None
        found = tuple(int(size) for size in scale_inv.get_shape())
        if expected is None or found != expected:
            raise ValueError(
                f"{name}{SCALE_SUFFIX} has shape {list(found)}; FP8 weight {name} of shape "
                f"{list(self._shape)} in blocks of {list(block)} needs {list(expected or ())}"
            )

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return "F32"

    def __getitem__(self, key: Any) -> torch.Tensor:
        keys = key if isinstance(key, tuple) else (key,)
        if len(keys) > len(self._shape) or not all(isinstance(part, slice) for part in keys):
            raise TypeError(f"{self.name}: FP8 weights are read by slices only, not {key!r}")
        keys = (*keys, *(slice(None),) * (len(self._shape) - len(keys)))
        bounds = [part.indices(size) for part, size in zip(keys, self._shape, strict=True)]
        if any(step != 1 for _, _, step in bounds):
            raise TypeError(f"{self.name}: FP8 weights are read by slices of step 1, not {key!r}")
        *leading, (row_start, row_end, _), (column_start, column_end, _) = bounds
        rows, columns = self._shape[-2:]
        first_row, first_column = row_start // self.block[0], column_start // self.block[1]
        end_row = _ceil_div(max(row_end, row_start), self.block[0])
        end_column = _ceil_div(max(column_end, column_start), self.block[1])
        lead = tuple(slice(start, end) for start, end, _ in leading)
        weight = self._weight[
            (
                *lead,
                slice(first_row * self.block[0], min(end_row * self.block[0], rows)),
                slice(first_column * self.block[1], min(end_column * self.block[1], columns)),
            )
        ]
        scale_inv = self._scale_inv[
            (*lead, slice(first_row, end_row), slice(first_column, end_column))
        ]
        widened = dequantize_fp8_blocks(weight, scale_inv, self.block)
        row_offset, column_offset = first_row * self.block[0], first_column * self.block[1]
        part = widened[
            ...,
            row_start - row_offset : row_end - row_offset,
            column_start - column_offset : column_end - column_offset,
        ]
        return part if part.shape == widened.shape else part.contiguous()
