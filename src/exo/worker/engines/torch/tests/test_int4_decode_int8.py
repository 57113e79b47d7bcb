"""int4 products with the activations rounded to int8 (`--decode-activations int8`,
native/int4_decode_int8.cpp): the decode kernel's product equals the weight times the
activations rounded per block of 32 to int8 (as prefill_int8.cpp's `round_row_int8` rounds
them), in every row tile, odd last block and group size, on 1 and 2 threads; the integer
GEMM gives a row the same product (so a stream's tokens do not depend on its batch); the
setting is process-wide and an engine load sets it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
from exo.worker.engines.torch.quant.native_kernels import (
    built_int4_kernel,
    set_decode_activations,
)
from exo.worker.engines.torch.tests.test_batching import (
    PROMPTS,
    max_difference,
    request,
    solo_and_batched,
    tiny_llama,
)

# (outputs, inputs, group size): whole pairs of blocks; a last odd block; groups of two
# blocks (several per tile of 4 output rows, and a last output row alone).
SHAPES = ((70, 576, 32), (21, 608, 32), (19, 640, 64), (9, 96, 32))
# Register tiles of 1-4 activation rows, several tiles, and weight spans past one tile.
ROWS = (1, 2, 3, 4, 5, 7, 8, 9, 17)
# The int8 rounding moves a product by ~5e-3 of its scale (int16: ~2e-5); the kernel
# against its own documented sum (float32 sums in another order) stays below 1e-6.
EXACT_TOLERANCE = 1e-5
# Batched against alone on the tiny int4 model: measured 5.7e-6 (int16: 1.7e-5); a row
# rounded to int16 in one and int8 in the other moves its logits by ~2.3e-3.
ROUNDING_TOLERANCE = 2e-4


@pytest.fixture(autouse=True)
def int16_after() -> Iterator[None]:
    """The setting is process-wide: every test leaves the default behind."""
    if built_int4_kernel() is None:
        pytest.skip("exo's native kernels are not built here")
    yield
    set_decode_activations("int16")


def rounded_int8(x: torch.Tensor) -> torch.Tensor:
    """`x` [rows, k] rounded per block of 32 to multiples of largest |x| / 127 (round half
    to even, as `vcvtps2dq`), as float64: the activations the int8 products multiply."""
    rows, k = x.shape
    blocks = x.reshape(rows, k // 32, 32)
    top = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(top > 0, 127.0 / top, torch.zeros_like(top))
    values = torch.round(blocks * inverse)
    return (values.double() * (top.double() / 127.0)).reshape(rows, k)


def random_int4(outputs: int, inputs: int, group: int, seed: int) -> tuple[Any, ...]:
    """Random int4 values and (scale, zero) pairs, packed as exo holds them, and the
    dequantized weight in float64: `(q - 8) * scale + zero`."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
    scale_zero = (torch.randn(outputs, inputs // group, 2, generator=generator) * 0.1).to(
        torch.bfloat16
    )
    pairs = scale_zero.double().repeat_interleave(group, dim=1)  # [outputs, inputs, 2]
    weight = (values.double() - 8.0) * pairs[..., 0] + pairs[..., 1]
    return pack_native_int4(values), scale_zero, weight, generator


@pytest.mark.parametrize("threads", [1, 2])
def test_int8_decode_products_equal_the_int8_rounded_product(threads: int) -> None:
    kernel = built_int4_kernel()
    assert kernel is not None
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for index, (outputs, inputs, group) in enumerate(SHAPES):
            qweight, scale_zero, weight, generator = random_int4(outputs, inputs, group, index)
            x = torch.randn(max(ROWS), inputs, generator=generator)
            for rows in ROWS:
                rows_x = x[:rows].contiguous()
                set_decode_activations("int8")
                int8 = kernel(rows_x, qweight, scale_zero).double()
                set_decode_activations("int16")
                int16 = kernel(rows_x, qweight, scale_zero).double()
                expected = rounded_int8(rows_x) @ weight.T
                scale = float(expected.abs().max())
                case = (outputs, inputs, group, rows, threads)
                assert float((int8 - expected).abs().max()) < EXACT_TOLERANCE * scale, case
                # The int8 path really ran: int16's product is far closer to x's own.
                exact = rows_x.double() @ weight.T
                assert float((int16 - exact).abs().max()) < 1e-3 * scale, case
                assert float((int8 - exact).abs().max()) > 1e-3 * scale, case
    finally:
        torch.set_num_threads(previous)


def test_the_integer_gemm_gives_a_row_the_decode_kernels_product() -> None:
    """Many rows (a prefill or a large batch) go through `block_matmul`'s GEMM, which with
    int8 decode activations rounds every row of an int4 weight to int8 too, whatever
    `--prefill-activations` and the step's decode rows say."""
    kernel = built_int4_kernel()
    assert kernel is not None
    qweight, scale_zero, _weight, generator = random_int4(128, 640, 32, seed=7)
    x = torch.randn(40, 640, generator=generator)
    set_decode_activations("int8")
    one_by_one = torch.cat(
        [kernel(x[row : row + 1].contiguous(), qweight, scale_zero) for row in range(40)]
    )
    for bits, decode_rows in ((16, 0), (16, 5), (8, 5)):
        many = torch.ops.exo_native.block_matmul(x, qweight, scale_zero, bits, decode_rows, False)
        scale = float(one_by_one.abs().max())
        assert float((many - one_by_one).abs().max()) < EXACT_TOLERANCE * scale, (bits, decode_rows)


def test_the_setting_takes_8_or_16_bits() -> None:
    with pytest.raises(RuntimeError, match="8 or 16"):
        torch.ops.exo_native.set_decode_activation_bits(12)
    set_decode_activations("int8")
    assert int(torch.ops.exo_native.decode_activation_bits()) == 8
    set_decode_activations("int16")
    assert int(torch.ops.exo_native.decode_activation_bits()) == 16


def test_an_int8_engine_decodes_the_same_batched_as_alone(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    """Batched equals alone with int8 activations (the batch's decode rows and the joining
    prompts' rows take the same rounding as a request alone), and the engine load set the
    process-wide rounding."""
    engine = tiny_llama(tiny_card, tiny_model_dir, weight_dtype="int4", decode_activations="int8")
    assert int(torch.ops.exo_native.decode_activation_bits()) == 8
    params = [request(prompt, temperature=0.0, max_tokens=6) for prompt in PROMPTS]
    solo, forced, _pieces = solo_and_batched(engine, params, join_at=[0, 1, 1])
    assert max_difference(solo, forced) < ROUNDING_TOLERANCE
