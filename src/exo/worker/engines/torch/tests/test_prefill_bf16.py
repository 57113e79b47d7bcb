"""Prefill with bfloat16 activations (`block_matmul(..., bf16=True)`, native/prefill_bf16.cpp,
behind `--prefill-activations bf16`): on CPUs with AMX-BF16, every block weight kind
(int4 in groups of 32 / 64 / 96 with an odd last block, int8 (scale, zero) pairs, symmetric
int8 blocks of 16 and 32, 5-bit blocks) times the activations, against the exact float64
product within the rounding the path documents; output counts that leave a part slab, row
counts past the micro-kernel's row blocks, one and two threads; a step's leading decode
rows exactly as an int16 call, and a call with decode rows and fewer prompt rows than the
path's minimum entirely int16. Elsewhere the option falls back to int16, exactly. The default by CPU
flags."""

from __future__ import annotations

import pytest
import torch

from exo.shared.models.weight_formats import default_prefill_activations
from exo.utils.cpu_features import AMX_BF16_FLAGS
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
from exo.worker.engines.torch.quant.int5_blocks import int5_lanes
from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    bf16_prefill_available,
    built_int4_kernel,
)

native = pytest.mark.skipif(
    built_int4_kernel() is None or not ROUNDS_ACTIVATIONS,
    reason="exo's AVX2 kernels cannot be built here",
)
amx = pytest.mark.skipif(
    not (built_int4_kernel() is not None and bf16_prefill_available()),
    reason="no AMX-BF16 product on this CPU",
)

# How each term may move: x and w each rounded to bfloat16 (relative 2^-9 each), the
# product of two bfloat16 exact in float32, then float32 sums (Higham 3.1: (k + 2) 2^-24).
ROUNDING = 2.0**-8 + 2.0**-18


def weight(kind: str, outputs: int, inputs: int, seed: int) -> tuple[torch.Tensor, ...]:
    """(held, scales, the weight as float64 `[outputs, inputs]`) for `kind`."""
    generator = torch.Generator().manual_seed(seed)
    if kind.startswith("int4"):
        group = int(kind.split("/")[1])
        values = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
        pairs = (torch.randn(outputs, inputs // group, 2, generator=generator) * 0.1).to(
            torch.bfloat16
        )
        grouped = values.double().reshape(outputs, -1, group) - 8
        dense = grouped * pairs[..., :1].double() + pairs[..., 1:].double()
        return pack_native_int4(values), pairs, dense.reshape(outputs, inputs)
    if kind == "int5":
        values = torch.randint(-16, 16, (outputs, inputs), generator=generator, dtype=torch.int8)
        scales = (torch.rand(outputs, inputs // 32, generator=generator) * 0.01).to(torch.bfloat16)
        dense = values.double().reshape(outputs, -1, 32) * scales.double().unsqueeze(-1)
        return int5_lanes(values), scales, dense.reshape(outputs, inputs)
    values = torch.randint(-128, 128, (outputs, inputs), generator=generator, dtype=torch.int8)
    if kind == "int8 pairs":  # (scale, zero) per 32 inputs: w = (v - 8) * scale + zero
        pairs = (torch.randn(outputs, inputs // 32, 2, generator=generator) * 0.01).to(
            torch.bfloat16
        )
        grouped = values.double().reshape(outputs, -1, 32) - 8
        dense = grouped * pairs[..., :1].double() + pairs[..., 1:].double()
        return values, pairs, dense.reshape(outputs, inputs)
    block = int(kind.split("/")[1])  # symmetric blocks of 16 or 32
    scales = (torch.rand(outputs, inputs // block, generator=generator) * 0.01).to(torch.bfloat16)
    dense = values.double().reshape(outputs, -1, block) * scales.double().unsqueeze(-1)
    return values, scales, dense.reshape(outputs, inputs)


KINDS = ["int4/32", "int4/64", "int4/96", "int8 pairs", "int8/16", "int8/32", "int5"]


def bf16_call(
    x: torch.Tensor, held: torch.Tensor, scales: torch.Tensor, threads: int
) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.ops.exo_native.block_matmul(x, held, scales, 16, 0, True)
    finally:
        torch.set_num_threads(before)


@amx
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 2])
def test_the_bf16_product_is_the_product_within_its_rounding(kind: str, threads: int) -> None:
    """Every element within the rounding's bound of the exact product (a misplaced weight
    or scale is off by the product's own size, far outside it), and the error as a whole
    that of bfloat16 rounding (RMS ~2e-3 of the product's RMS, not int8's ~5e-3)."""
    inputs = 960 if kind == "int4/96" else 640
    for outputs, rows in ((70, 32), (333, 70), (128, 130)):
        held, scales, dense = weight(kind, outputs, inputs, seed=outputs + rows)
        x = torch.randn(rows, inputs, generator=torch.Generator().manual_seed(rows))
        actual = bf16_call(x, held, scales, threads).double()
        exact = x.double() @ dense.t()
        bound = (ROUNDING + (inputs + 2) * 2.0**-24) * (x.double().abs() @ dense.abs().t())
        assert ((actual - exact).abs() <= bound).all(), kind
        relative = (actual - exact).pow(2).mean().sqrt() / exact.pow(2).mean().sqrt()
        assert 1e-4 < relative < 4e-3, (kind, float(relative))


@amx
def test_each_row_s_product_does_not_depend_on_the_rows_beside_it() -> None:
    """A row's result is the same among the fewest rows bf16 takes and among 130, on one
    and two threads (the micro-kernel's row blocks and the slabs' split over threads
    change no sum)."""
    held, scales, _ = weight("int4/32", 200, 640, seed=3)
    x = torch.randn(130, 640, generator=torch.Generator().manual_seed(4))
    least = int(torch.ops.exo_native.bf16_prefill_min_rows())
    together = bf16_call(x, held, scales, 2)
    for row in (0, 63, 64, 130 - least):
        alone = bf16_call(x[row : row + least], held, scales, 1)
        assert torch.equal(alone[0], together[row])


@native
@pytest.mark.parametrize("kind", ["int4/32", "int8/16", "int5"])
def test_leading_decode_rows_keep_int16(kind: str) -> None:
    """`int16_rows` (a step's decode tokens, first) equal an int16 call bit for bit, the
    other rows a bf16 call of their own; beside decode rows, fewer prompt rows than the
    minimum take int16 too (where bf16 does not run, every row is int16)."""
    held, scales, _ = weight(kind, 200, 640, seed=7)
    least = int(torch.ops.exo_native.bf16_prefill_min_rows())
    rows = least + 5
    x = torch.randn(rows, 640, generator=torch.Generator().manual_seed(8))
    int16 = torch.ops.exo_native.block_matmul(x, held, scales)
    for decode_rows in (0, 1, 5, 6, rows, rows + 3):
        mixed = torch.ops.exo_native.block_matmul(x, held, scales, 16, decode_rows, True)
        assert torch.equal(mixed[:decode_rows], int16[:decode_rows])
        bf16_rows = rows - min(decode_rows, rows)
        takes_bf16 = bf16_prefill_available() and bf16_rows > 0
        takes_bf16 = takes_bf16 and (decode_rows == 0 or bf16_rows >= least)
        if takes_bf16:  # the prompt rows as a bf16 call of their own
            rest = torch.ops.exo_native.block_matmul(x[decode_rows:], held, scales, 16, 0, True)
            assert torch.equal(mixed[decode_rows:], rest)
        assert torch.equal(mixed, int16) == (not takes_bf16), (decode_rows, takes_bf16)
    # Without decode rows any prompt chunk takes bf16, however short (a pipeline rank and a
    # single process chunk a prompt differently and must agree).
    short = torch.ops.exo_native.block_matmul(x[:9], held, scales, 16, 0, True)
    assert torch.equal(short, int16[:9]) != bf16_prefill_available()
    if not bf16_prefill_available():
        assert torch.equal(torch.ops.exo_native.block_matmul(x, held, scales, 16, 0, True), int16)
    with pytest.raises(RuntimeError, match="bf16 activations need activation_bits 16"):
        torch.ops.exo_native.block_matmul(x, held, scales, 8, 0, True)


def test_the_default_is_bf16_only_where_amx_bf16_runs() -> None:
    assert default_prefill_activations(frozenset(AMX_BF16_FLAGS | {"avx2", "fma"})) == "bf16"
    for missing in AMX_BF16_FLAGS:
        assert default_prefill_activations(frozenset(AMX_BF16_FLAGS - {missing})) == "int16"
    assert default_prefill_activations(frozenset()) == "int16"
