"""The int4 and int8-block decode kernels' multi-row products (a decode step over many
requests) on both of their widths: the 256-bit (AVX2) tiles and, where the library is built
with AVX512BW, the 512-bit ones (`EXO_NATIVE_AVX512=0` forces the 256-bit tiles; read once
per process, so each width runs in one child process, which computes every case)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    built_int4_kernel,
    rounded_activations,
)
from exo.worker.engines.torch.tests.test_int4_decode_int8 import rounded_int8

# (outputs, inputs, group size). Under 1,024 inputs the 512-bit kernel takes 16 output
# rows a tile with outputs in the lanes (int4_lanes.h): 4 whole tiles and a partial one;
# an odd last block; groups of two and of four blocks; one pair of blocks and an odd one,
# two whole tiles. From 1,024 inputs its earlier tiles: 128-input chunks, then a last pair
# of blocks and an odd block.
SHAPES = (
    (70, 576, 32),
    (21, 608, 32),
    (19, 640, 64),
    (17, 512, 128),
    (32, 96, 32),
    (20, 1120, 32),
)
# Tiles of 1-8 activation rows, two tiles, past the GEMM's bound in decode_layer.cpp.
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 17)

_PRODUCTS_SCRIPT = """
import json, sys, torch
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
kernel = built_int4_kernel()
g = torch.Generator().manual_seed(5)
shapes, counts = json.loads(sys.argv[2])
def int4_cases(shapes):
    # Random int4 weights per shape; the kernel's products for every row count and each
    # row alone, on one and two threads.
    cases = []
    for outputs, inputs, group in shapes:
        values = torch.randint(0, 16, (outputs, inputs), generator=g, dtype=torch.uint8)
        scales = torch.randn(outputs, inputs // group, 2, generator=g) * 0.1
        scale_zero = scales.to(torch.bfloat16)
        x = torch.randn(max(counts), inputs, generator=g)
        qweight = pack_native_int4(values)
        products = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in counts:
                products[threads, rows] = kernel(x[:rows].contiguous(), qweight, scale_zero)
            products[threads, "single"] = torch.cat(
                [kernel(x[row:row + 1].contiguous(), qweight, scale_zero) for row in range(len(x))]
            )
        cases.append((values, scale_zero, group, x, products))
    return cases
cases = int4_cases(shapes)
int8_cases = []
for outputs, inputs, block, kind in json.loads(sys.argv[3]):
    values = torch.randint(-128, 128, (outputs, inputs), generator=g, dtype=torch.int8)
    if kind == "scaled":
        scales = (torch.rand(outputs, inputs // block, generator=g) * 0.02).to(torch.bfloat16)
        op = torch.ops.exo_native.int8_scaled_gemv
    else:
        scales = (torch.randn(outputs, inputs // 32, 2, generator=g) * 0.02).to(torch.bfloat16)
        op = torch.ops.exo_native.int8_block_gemv
    x = torch.randn(max(counts), inputs, generator=g)
    products = {}
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for rows in counts:
            products[threads, rows] = op(x[:rows].contiguous(), values, scales)
        products[threads, "single"] = torch.cat(
            [op(x[row:row + 1].contiguous(), values, scales) for row in range(len(x))]
        )
    int8_cases.append((kind, block, values, scales, x, products))
# int4 weights with the activations rounded to int8 (--decode-activations int8), also with an
# odd last block after no whole chunk.
from exo.worker.engines.torch.quant.native_kernels import set_decode_activations
set_decode_activations("int8")
act8_cases = int4_cases(shapes + [[9, 96, 32]])
set_decode_activations("int16")
torch.save((cases, int8_cases, act8_cases), sys.argv[1])
print(torch.ops.exo_native.int4_decode_bits())
"""

# int8 block weights (outputs, inputs, inputs per scale, "scaled": symmetric blocks as
# int8_scaled_gemv, "pairs": (scale, zero) pairs as int8_block_gemv): whole pairs of blocks
# (the 512-bit tile), a lone last block (the 256-bit tile at every row count), odd output
# counts (tiles of 2 output rows, then one).
INT8_SHAPES = (
    (37, 576, 32, "scaled"),
    (23, 640, 16, "scaled"),
    (19, 608, 32, "scaled"),
    (29, 576, 32, "pairs"),
    (13, 96, 32, "pairs"),
)
# Every row count of the 512-bit tiles' groups of 8 and their remainders, up to two groups.
INT8_ROWS = tuple(range(1, 18))


def _products(directory: Path, avx512: str) -> tuple[int, tuple[list, list, list]]:
    path = directory / f"{avx512}.pt"
    done = subprocess.run(
        [sys.executable, "-c", _PRODUCTS_SCRIPT, str(path), json.dumps([SHAPES, ROWS]),
         json.dumps(list(INT8_SHAPES))],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "EXO_NATIVE_AVX512": avx512},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1]), torch.load(path)


Widths = tuple[int, tuple[list, list, list], tuple[list, list, list]]


@pytest.fixture(scope="module")
def widths(tmp_path_factory: pytest.TempPathFactory) -> Widths:
    """(the default width's bits, its int4, int8-block and int8-activation cases, the 256-bit
    width's cases)."""
    if built_int4_kernel() is None or not ROUNDS_ACTIVATIONS:
        pytest.skip("no AVX2 kernels on this machine")
    directory = tmp_path_factory.mktemp("widths")
    wide_bits, wide = _products(directory, "1")
    narrow_bits, narrow = _products(directory, "0")
    assert narrow_bits == 256
    return wide_bits, wide, narrow


def test_multi_row_products_equal_single_rows_on_both_widths(widths: Widths) -> None:
    """For 1-17 activation rows on one and two threads (70 outputs: tiles of 4 and 2 output
    rows, then single ones, or 16 a tile and a partial one), each width's product is the
    documented one (the rounded activations times the dequantized weight, to float32
    summation) and each row of a multi-row call equals that row's single-row call within
    float32 rounding; the 512-bit kernel equals the 256-bit one to the same tolerance."""
    wide_bits, (wide, _, _), (narrow, _, _) = widths
    sides = [narrow] + ([wide] if wide_bits == 512 else [])
    for cases in sides:
        for values, scale_zero, group, x, products in cases:
            outputs, inputs = values.shape
            weight = (values.double().reshape(outputs, -1, group) - 8) * scale_zero[..., :1]
            weight = (weight + scale_zero[..., 1:].double()).reshape(outputs, inputs)
            expected = rounded_activations(x).double() @ weight.t()
            for (threads, rows), product in products.items():
                if rows == "single":
                    continue
                assert product.shape == (rows, outputs)
                where = f"{rows} rows, {threads} threads, {outputs}x{inputs}, groups of {group}"
                torch.testing.assert_close(
                    product.double(), expected[:rows], rtol=1e-5, atol=1e-4,
                    msg=f"{where}: differs from the documented product",
                )  # fmt: skip
                torch.testing.assert_close(
                    product, products[threads, "single"][:rows], rtol=1e-5, atol=1e-4,
                    msg=f"{where}: differs from the rows' single-row products",
                )  # fmt: skip
    if wide_bits != 512:
        pytest.skip(f"no 512-bit int4 decode kernel here ({wide_bits} bits)")
    for wide_case, narrow_case in zip(wide, narrow, strict=True):
        for key, product in wide_case[4].items():
            torch.testing.assert_close(product, narrow_case[4][key], rtol=1e-5, atol=1e-4)


def test_int8_block_products_on_both_widths(widths: Widths) -> None:
    """int8_scaled_gemv (symmetric blocks, a scale per 16 or 32 inputs) and int8_block_gemv
    ((scale, zero) pairs per 32) for every row count 1-17 on one and two threads: each
    width's product is the documented one (the rounded activations times the exact
    dequantized weight, to float32 summation: block sums exact in int32, scaled in float32),
    and the 512-bit tiles (groups of 8 activation rows, whole pairs of blocks) equal the
    256-bit ones to the same tolerance. A broken lane-to-scale mapping (a block's sums
    scaled by its neighbour's scale) or a dropped remainder row fails both."""
    wide_bits, (_, wide, _), (_, narrow, _) = widths
    sides = [narrow] + ([wide] if wide_bits == 512 else [])
    for cases in sides:
        for kind, block, values, scales, x, products in cases:
            outputs, inputs = values.shape
            if kind == "scaled":
                weight = values.double() * scales.double().repeat_interleave(block, dim=1)
            else:
                pairs = scales.double()
                shaped = values.double().reshape(outputs, -1, 32) - 8
                weight = (shaped * pairs[..., :1] + pairs[..., 1:]).reshape(outputs, inputs)
            expected = rounded_activations(x).double() @ weight.t()
            for (threads, rows), product in products.items():
                if rows == "single":
                    continue
                assert product.shape == (rows, outputs)
                torch.testing.assert_close(
                    product.double(), expected[:rows], rtol=1e-5, atol=1e-4,
                    msg=f"{kind} {outputs}x{inputs} per {block}, {rows} rows, {threads} threads",
                )  # fmt: skip
    if wide_bits != 512:
        pytest.skip(f"no 512-bit decode tiles here ({wide_bits} bits)")
    for wide_case, narrow_case in zip(wide, narrow, strict=True):
        for key, product in wide_case[5].items():
            torch.testing.assert_close(product, narrow_case[5][key], rtol=1e-5, atol=1e-4)


def test_each_row_is_the_same_bits_whatever_the_row_count(widths: Widths) -> None:
    """On each width, every row of a multi-row call is bit for bit its single-row call,
    int4 and int8 blocks alike: a speculative step's verified rows are then its plain
    decode steps' rows (issue 43's exactness), and a request's logits do not depend on the
    batch beside it. (On AVX512 machines one row took the 256-bit tiles and several the
    512-bit ones, whose float32 sums run in another order: a verify step's logits differed
    from decoding's in the last bits.)"""
    wide_bits, (wide, wide_int8, wide_act8), (narrow, narrow_int8, narrow_act8) = widths
    sides = [(narrow, narrow_int8, narrow_act8)]
    sides += [(wide, wide_int8, wide_act8)] if wide_bits == 512 else []
    failures = []
    for width, (int4_cases, int8_cases, act8_cases) in zip((256, 512), sides, strict=False):
        named = [(f"int4 {case[0].shape}", case[4]) for case in int4_cases]
        named += [(f"int8 {case[0]} {tuple(case[2].shape)}", case[5]) for case in int8_cases]
        named += [(f"int4, int8 activations {case[0].shape}", case[4]) for case in act8_cases]
        for name, products in named:
            for (threads, rows), product in products.items():
                single = products[threads, "single"][: product.shape[0]]
                if rows != "single" and not torch.equal(product, single):
                    failures.append(f"{width} bits, {name}: {rows} rows, {threads} threads")
    assert not failures, "\n".join(failures)


def test_int8_activation_products_on_both_widths(widths: Widths) -> None:
    """int4 weights times activations rounded to int8 per block of 32
    (`--decode-activations int8`, int4_decode_int8.cpp) for 1-17 rows on one and two threads:
    each width's product (the 256-bit `vpmaddubsw` tiles; the 512-bit `vpdpbusd` ones where
    built) is the documented one, the int8-rounded activations times the dequantized weight
    to float32 summation, through whole 128-input chunks, a last pair of blocks and an odd
    last block; and the two widths agree to the same tolerance. A block's sums scaled by a
    neighbour's scale, or a chunk's activations in another order than its weight's, fail."""
    wide_bits, (_, _, wide), (_, _, narrow) = widths
    sides = [narrow] + ([wide] if wide_bits == 512 else [])
    for cases in sides:
        for values, scale_zero, group, x, products in cases:
            outputs, inputs = values.shape
            weight = (values.double().reshape(outputs, -1, group) - 8) * scale_zero[..., :1]
            weight = (weight + scale_zero[..., 1:].double()).reshape(outputs, inputs)
            expected = rounded_int8(x) @ weight.t()
            for (threads, rows), product in products.items():
                if rows == "single":
                    continue
                torch.testing.assert_close(
                    product.double(), expected[:rows], rtol=1e-5, atol=1e-4,
                    msg=f"{outputs}x{inputs} per {group}, {rows} rows, {threads} threads",
                )  # fmt: skip
    if wide_bits != 512:
        pytest.skip(f"no 512-bit decode tiles here ({wide_bits} bits)")
    for wide_case, narrow_case in zip(wide, narrow, strict=True):
        for key, product in wide_case[4].items():
            torch.testing.assert_close(product, narrow_case[4][key], rtol=1e-5, atol=1e-4)
