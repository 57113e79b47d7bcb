"""GGUF Q5_0 blocks held as 5-bit lanes: the integers against `gguf`'s own dequantizer, the
lanes' layout, the decode kernel and the integer GEMM against the held weight (rows of whole
and of padded groups), widening to int8 blocks, and fusion with 5-bit and int8-block
neighbours."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from exo.worker.engines.torch.model.fusion import fuse_linears
from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear, block_values
from exo.worker.engines.torch.quant.int5_blocks import (
    Int5BlockPart,
    Int5Linear,
    int5_lanes,
    int5_row_bytes,
    int5_values,
    lane_values,
    q5_0_blocks,
)
from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    built_int4_kernel,
    rounded_activations,
)

pytestmark = pytest.mark.skipif(
    built_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)

ROWS, COLUMNS = 80, 640  # 20 blocks per row (Gemma 3 270M's width)
BF16_RELATIVE = 2.0**-8


def q5_0(rows: int = ROWS, seed: int = 0, columns: int = COLUMNS) -> np.ndarray:
    """Raw Q5_0 blocks of Gaussian weights with outliers, quantized by `gguf`."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((rows, columns)).astype(np.float32) * 0.02
    weights[rng.random(weights.shape) < 0.002] *= 10.0
    return quantize(weights, GGMLQuantizationType.Q5_0)


def linear_of(raw: np.ndarray, bias: torch.Tensor | None = None) -> Int5Linear:
    packed, scales = q5_0_blocks(raw)
    return Int5Linear(torch.from_numpy(packed), torch.from_numpy(scales), bias)


def test_held_blocks_are_gguf_values_up_to_the_bfloat16_scales() -> None:
    raw = q5_0()
    expected = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q5_0).reshape(ROWS, -1))
    packed, scales = q5_0_blocks(raw)
    assert packed.shape == (ROWS, COLUMNS // 32 * 20) and scales.shape == (ROWS, COLUMNS // 32)
    values = int5_values(torch.from_numpy(packed))
    # The integers are int4_planes' (GGUF's x - 16), and with float32 scales exactly gguf's.
    reference_values, _, _ = block_values(raw, "Q5_0")
    assert torch.equal(values.to(torch.int16), torch.from_numpy(reference_values))
    assert int(values.min()) == -16 and int(values.max()) == 15
    exact = values.float() * torch.from_numpy(scales).repeat_interleave(32, dim=1)
    assert torch.equal(exact, expected)
    linear = linear_of(raw)
    held = linear.dequantize_float()
    assert bool(((held - expected).abs() <= expected.abs() * BF16_RELATIVE + 1e-9).all())
    assert linear.int5_lanes is not None and linear.int5_lanes.shape == (ROWS, 7 * 64)

    class Slice:  # a tensor-parallel reader's view: whole blocks of the columns
        def get_shape(self) -> list[int]:
            return list(raw.shape)

        def __getitem__(self, key: object) -> torch.Tensor:
            return torch.from_numpy(raw)[key]  # type: ignore[index]

    part = Int5BlockPart(Slice(), "packed")
    assert part.get_shape() == [ROWS, COLUMNS // 32 * 20]
    assert torch.equal(part[4:12, 40:100], torch.from_numpy(packed)[4:12, 40:100])
    assert Int5BlockPart(Slice(), "scales").get_shape() == [ROWS, COLUMNS // 32]
    with pytest.raises(ValueError, match="whole blocks"):
        q5_0_blocks(raw[:, :-2])


def test_lanes_hold_three_5_bit_values_each_in_groups_of_three_blocks() -> None:
    """Lane j of vector h of a group holds inputs 16 (3h + f) + j at bits 5f (u = x + 16);
    a row's last group is zero-padded; `lane_values` inverts `int5_lanes`."""
    values = torch.arange(-16, 16, dtype=torch.int8).repeat(3, 5)[:, :160]  # 5 blocks
    lanes = int5_lanes(values)
    assert lanes.dtype == torch.uint8 and lanes.shape == (3, int5_row_bytes(160)) == (3, 128)
    words = lanes.view(torch.int16).to(torch.int32)  # [3, 64 lanes]
    for j in (0, 7, 15):
        for h in (0, 1):
            for f in range(3):
                field = (int(words[1, 16 * h + j]) >> (5 * f)) & 0x1F
                assert field == int(values[1, 16 * (3 * h + f) + j]) + 16
    assert int(words.max()) < 1 << 15  # bit 15 clear
    # The second group holds blocks 3 and 4; its third block (vectors 4, 5) is padding.
    assert torch.equal(words[:, 32 + 16 : 32 + 32] >> 5, torch.zeros(3, 16, dtype=torch.int32))
    assert torch.equal(lane_values(lanes, 160), values)
    with pytest.raises(ValueError, match=r"\[-16, 15\]"):
        int5_lanes(torch.full((1, 32), 16, dtype=torch.int8))
    with pytest.raises(ValueError, match="whole blocks"):
        int5_lanes(torch.zeros(1, 48, dtype=torch.int8))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 33])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("columns", [COLUMNS, 576, 96 + 32])
def test_the_kernels_compute_the_held_weight_times_the_rounded_rows(
    rows: int, threads: int, columns: int
) -> None:
    """Up to 7 rows the decode kernel, from 8 the integer GEMM: the held weight times the
    activations as the AVX2 kernels round them, plus the bias; 80 outputs leave tiles with
    remainders; rows of 640 end in a group of 2 blocks, of 576 in whole groups, of 128 in a
    group of 1."""
    generator = torch.Generator().manual_seed(rows)
    bias = torch.randn(ROWS, generator=generator)
    linear = linear_of(q5_0(seed=rows, columns=columns), bias)
    x = torch.randn(rows, columns, generator=generator)
    activations = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    expected = activations.double() @ linear.dequantize_float().double().t() + bias
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = linear(x)
    finally:
        torch.set_num_threads(before)
    assert out.shape == (rows, ROWS)
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("rows", [1, 3])
def test_the_decode_kernel_splits_many_outputs_over_threads(rows: int) -> None:
    """2,048 outputs of 640 inputs: several chunks of outputs, run on both threads."""
    generator = torch.Generator().manual_seed(11)
    linear = linear_of(q5_0(2048, seed=11))
    x = torch.randn(rows, COLUMNS, generator=generator)
    activations = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    expected = activations.double() @ linear.dequantize_float().double().t()
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        out = linear(x)
    finally:
        torch.set_num_threads(before)
    atol = 1e-5 * float(expected.abs().max())
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=atol)


def test_widening_keeps_the_product() -> None:
    linear = linear_of(q5_0(seed=3))
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(3))
    before, weight = linear(x), linear.dequantize_float()
    linear.widen()
    assert linear.widened and linear.values.dtype == torch.int8
    assert torch.equal(linear.dequantize_float(), weight)
    torch.testing.assert_close(linear(x), before, rtol=0, atol=1e-6)


def test_fusion_keeps_5_bit_blocks_or_widens_beside_int8_blocks() -> None:
    x = torch.randn(2, COLUMNS, generator=torch.Generator().manual_seed(7))
    gate, up = linear_of(q5_0(64, seed=1)), linear_of(q5_0(64, seed=2))
    separately = torch.cat([gate(x), up(x)], dim=-1)
    fused = fuse_linears([gate, up])
    assert isinstance(fused, Int5Linear) and not fused.widened
    torch.testing.assert_close(fused(x), separately, rtol=0, atol=1e-6)
    assert up.int5_lanes is not None and fused.int5_lanes is not None
    assert up.int5_lanes.data_ptr() == fused.int5_lanes[64:].data_ptr()  # held once
    # Q5_0 q / k beside a Q8_0 v (Gemma's Q4_K_M): all three as int8 blocks, one call.
    q, k = linear_of(q5_0(64, seed=4)), linear_of(q5_0(64, seed=5))
    rng = np.random.default_rng(6)
    v_raw = quantize(
        rng.standard_normal((64, COLUMNS)).astype(np.float32), GGMLQuantizationType.Q8_0
    )
    values, scales, offsets = (torch.from_numpy(a) for a in block_values(v_raw, "Q8_0"))
    v = SplitInt4Linear(values, scales, offsets, None)
    separately = torch.cat([q(x), k(x), v(x)], dim=-1)
    fused_qkv = fuse_linears([q, k, v])
    assert type(fused_qkv) is SplitInt4Linear and q.widened and k.widened
    torch.testing.assert_close(fused_qkv(x), separately, rtol=0, atol=1e-5)
    torch.testing.assert_close(k(x), separately[:, 64:128], rtol=0, atol=1e-5)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="do not fit"):
        Int5Linear(torch.zeros(4, 41, dtype=torch.uint8), torch.ones(4, 2), None)
    x = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="5-bit lanes"):
        torch.ops.exo_native.int5_gemv(
            x, torch.zeros(4, 41, dtype=torch.uint8), torch.ones(4, 2, dtype=torch.bfloat16)
        )
    with pytest.raises(RuntimeError, match="5-bit lanes"):
        torch.ops.exo_native.block_matmul(
            torch.zeros(9, 64), torch.zeros(4, 40, dtype=torch.uint8),
            torch.ones(4, 2, dtype=torch.bfloat16),
        )  # fmt: skip


_FLOAT_PATH_SCRIPT = """
import json, sys, torch
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel, rounded_activations
from exo.worker.engines.torch.quant.int5_blocks import int5_lanes
assert built_int4_kernel() is not None
g = torch.Generator().manual_seed(0)
x = torch.randn(9, 640, generator=g)
errors = {}
values = torch.randint(-16, 16, (40, 640), generator=g, dtype=torch.int8)
scales = (torch.rand(40, 20, generator=g) * 0.01).to(torch.bfloat16)
weight = values.double() * scales.double().repeat_interleave(32, dim=1)
cases = {"int5": (int5_lanes(values), scales, weight)}
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
nibbles = torch.randint(0, 16, (40, 640), generator=g, dtype=torch.uint8)
pairs = (torch.randn(40, 10, 2, generator=g) * 0.1).to(torch.bfloat16)  # groups of 64
w = (nibbles.double().reshape(40, 10, 64) - 8) * pairs[..., :1].double() + pairs[..., 1:].double()
cases["int4"] = (pack_native_int4(nibbles), pairs, w.reshape(40, 640))
odd = torch.randint(0, 16, (40, 96), generator=g, dtype=torch.uint8)  # an odd last block
op = (torch.randn(40, 3, 2, generator=g) * 0.1).to(torch.bfloat16)
w = (odd.double().reshape(40, 3, 32) - 8) * op[..., :1].double() + op[..., 1:].double()
cases["int4 odd"] = (pack_native_int4(odd), op, w.reshape(40, 96))
signed = torch.randint(-128, 128, (40, 640), generator=g, dtype=torch.int8)
pairs = (torch.randn(40, 20, 2, generator=g) * 0.01).to(torch.bfloat16)
w = (signed.double().reshape(40, 20, 32) - 8) * pairs[..., :1].double() + pairs[..., 1:].double()
cases["int8 pairs"] = (signed, pairs, w.reshape(40, 640))
for block in (16, 32):
    values = torch.randint(-128, 128, (40, 640), generator=g, dtype=torch.int8)
    sc = (torch.rand(40, 640 // block, generator=g) * 0.01).to(torch.bfloat16)
    w = values.double() * sc.double().repeat_interleave(block, 1)
    cases[f"scaled{block}"] = (values, sc, w)
for name, (held, sc, w) in cases.items():
    rows = x[:, : w.shape[1]].contiguous()
    expected = rounded_activations(rows).double() @ w.t()
    got = torch.ops.exo_native.block_matmul(rows, held, sc).double()
    errors[name] = float((got - expected).abs().max() / expected.abs().max())
print(json.dumps(errors))
"""


@pytest.mark.parametrize("integer_gemm", ["1", "0"])
def test_both_prefill_paths_compute_the_held_weights(integer_gemm: str) -> None:
    """`block_matmul` for 5-bit, int4 (groups of 64; an odd last block), int8 blocks with
    (scale, zero) pairs and symmetric int8 blocks through the integer GEMM and, with
    `EXO_NATIVE_INT_GEMM=0` (read once per process: a child process), through the weight
    dequantized to float32 slab by slab."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "EXO_NATIVE_INT_GEMM": integer_gemm}
    done = subprocess.run(
        [sys.executable, "-c", _FLOAT_PATH_SCRIPT],
        capture_output=True, text=True, timeout=300, env=env, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    errors = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(errors) == {"int5", "int4", "int4 odd", "int8 pairs", "scaled16", "scaled32"}
    assert all(error < 1e-5 for error in errors.values()), errors
