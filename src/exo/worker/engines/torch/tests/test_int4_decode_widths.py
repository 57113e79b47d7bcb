"""The int4 decode kernel's multi-row products (a decode step over many requests) on both
of its widths: the 256-bit (AVX2) kernel and, where the library is built with AVX512BW, the
512-bit one (`EXO_NATIVE_AVX512=0` forces the 256-bit kernel; read once per process, so
each width runs in a child process)."""

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

# (outputs, inputs, group size): the 512-bit kernel's 128-input chunks and a last pair of
# blocks; a last pair and an odd block; whole chunks with groups of two blocks.
SHAPES = ((70, 576, 32), (21, 608, 32), (19, 640, 64))
# Tiles of 1-8 activation rows, two tiles, past the GEMM's bound in decode_layer.cpp.
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 12, 17)

_PRODUCTS_SCRIPT = """
import json, sys, torch
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
kernel = built_int4_kernel()
g = torch.Generator().manual_seed(5)
shapes, counts = json.loads(sys.argv[2])
cases = []
for outputs, inputs, group in shapes:
    values = torch.randint(0, 16, (outputs, inputs), generator=g, dtype=torch.uint8)
    scale_zero = (torch.randn(outputs, inputs // group, 2, generator=g) * 0.1).to(torch.bfloat16)
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
torch.save(cases, sys.argv[1])
print(torch.ops.exo_native.int4_decode_bits())
"""


def _products(tmp_path: Path, avx512: str) -> tuple[int, list]:
    path = tmp_path / f"{avx512}.pt"
    done = subprocess.run(
        [sys.executable, "-c", _PRODUCTS_SCRIPT, str(path), json.dumps([SHAPES, ROWS])],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "EXO_NATIVE_AVX512": avx512},
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return int(done.stdout.strip().splitlines()[-1]), torch.load(path)


def test_multi_row_products_equal_single_rows_on_both_widths(tmp_path: Path) -> None:
    """For 1-17 activation rows on one and two threads (70 outputs: tiles of 4 and 2 output
    rows, then single ones), each width's product is the
    documented one (the rounded activations times the dequantized weight, to float32
    summation) and each row of a multi-row call equals that row's single-row call within
    float32 rounding; the 512-bit kernel equals the 256-bit one to the same tolerance."""
    if built_int4_kernel() is None or not ROUNDS_ACTIVATIONS:
        pytest.skip("no AVX2 int4 kernel on this machine")
    wide_bits, wide = _products(tmp_path, "1")
    narrow_bits, narrow = _products(tmp_path, "0")
    assert narrow_bits == 256
    widths = [narrow] + ([wide] if wide_bits == 512 else [])
    for cases in widths:
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
