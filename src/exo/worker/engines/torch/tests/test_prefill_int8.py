"""Prefill with int8 activations (`block_matmul(..., activation_bits=8)`, native/
prefill_int8.cpp, behind `--prefill-activations int8`): int4, 5-bit and 6-bit (Q6_K's, in
int8 blocks of 16) weights times the activations rounded to int8 per block of 32, against the
held weight times the same rounding in float64 (odd block counts, padded tiles, row groups of
1-4, one and two threads, and the extremes that fill the int16 partial sums); int8 weights
per slab of outputs where their values fit; the option reaching every linear the lean
forward runs, fused ones included, through the engine and the node's command line."""

from __future__ import annotations

import contextvars
from pathlib import Path

import pytest
import torch

from exo.node_options import parse_args
from exo.shared.models.weight_formats import default_prefill_activations
from exo.shared.types.models import ModelCard
from exo.testing.builders import make_shard
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.direct_forward_parts import Projection
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
from exo.worker.engines.torch.quant.int5_blocks import int5_lanes
from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    built_int4_kernel,
    int16_prefill_is_integer,
)
from exo.worker.engines.torch.quant.quantize import set_prefill_activations
from exo.worker.engines.torch.tests.test_engine import check_stream_shape, request

native = pytest.mark.skipif(
    built_int4_kernel() is None or not ROUNDS_ACTIVATIONS,
    reason="exo's AVX2 kernels cannot be built here",
)


def int8_rounded(rows: torch.Tensor) -> torch.Tensor:
    """float32 rows `[n, in]` as prefill_int8.cpp rounds them, in float64: per block of 32,
    round-to-nearest-even of x * (127 / largest |x|) (float32), times largest / 127."""
    blocks = rows.reshape(rows.shape[0], -1, 32)
    largest = blocks.abs().amax(dim=-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros(()))
    values = (blocks * inverse).round()
    return (values.double() * (largest / 127.0).double()).reshape(rows.shape)


def int4_weight(values: torch.Tensor, scale_zero: torch.Tensor, group_size: int) -> torch.Tensor:
    """`[out, in]` float64: (q - 8) * scale + zero per group."""
    outputs, inputs = values.shape
    grouped = values.double().reshape(outputs, inputs // group_size, group_size) - 8
    weight = grouped * scale_zero[..., :1].double() + scale_zero[..., 1:].double()
    return weight.reshape(outputs, inputs)


def assert_int16_product(actual: torch.Tensor, int16: torch.Tensor) -> None:
    """The int16 part of an int8 call (integer GEMM) against an int16 call: equal where int16
    calls take the integer GEMM too, else (AVX512 builds without AVX512-VNNI + AVX512BW: the
    dequantized float32 path) the same product to float32 rounding."""
    if int16_prefill_is_integer():
        assert torch.equal(actual, int16)
    else:
        scale = float(int16.abs().max()) if int16.numel() else 0.0
        torch.testing.assert_close(actual, int16, rtol=0, atol=1e-4 * scale)


def product(
    x: torch.Tensor, held: torch.Tensor, scales: torch.Tensor, threads: int
) -> torch.Tensor:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return torch.ops.exo_native.block_matmul(x, held, scales, 8).double()
    finally:
        torch.set_num_threads(before)


@native
@pytest.mark.parametrize(
    ("rows", "outputs", "inputs", "group_size"),
    [(8, 70, 96, 32), (17, 333, 640, 64), (130, 48, 160, 32), (11, 40, 512, 128), (5, 16, 64, 64)],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_int4_weights_times_int8_rounded_rows(
    rows: int, outputs: int, inputs: int, group_size: int, threads: int
) -> None:
    generator = torch.Generator().manual_seed(rows * outputs + threads)
    values = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
    groups = inputs // group_size
    scale_zero = (torch.randn(outputs, groups, 2, generator=generator) * 0.1).to(torch.bfloat16)
    x = torch.randn(rows, inputs, generator=generator) * 3
    x[0, :32] = 0.0  # an all-zero block
    actual = product(x, pack_native_int4(values), scale_zero, threads)
    expected = int8_rounded(x) @ int4_weight(values, scale_zero, group_size).t()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
    # Not the int16 rounding: the option changes the product.
    assert not torch.allclose(
        actual, torch.ops.exo_native.block_matmul(x, pack_native_int4(values), scale_zero).double()
    )


@native
@pytest.mark.parametrize(
    ("rows", "outputs", "inputs"), [(9, 70, 640), (13, 33, 288), (130, 20, 96)]
)
@pytest.mark.parametrize("threads", [1, 2])
def test_5_bit_weights_times_int8_rounded_rows(
    rows: int, outputs: int, inputs: int, threads: int
) -> None:
    generator = torch.Generator().manual_seed(rows + outputs + threads)
    values = torch.randint(-16, 16, (outputs, inputs), generator=generator, dtype=torch.int8)
    scales = (torch.rand(outputs, inputs // 32, generator=generator) * 0.01).to(torch.bfloat16)
    weight = values.double() * scales.double().repeat_interleave(32, dim=1)
    x = torch.randn(rows, inputs, generator=generator)
    actual = product(x, int5_lanes(values), scales, threads)
    torch.testing.assert_close(actual, int8_rounded(x) @ weight.t(), rtol=1e-5, atol=1e-5)


@native
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_the_largest_products_fit_the_int16_partial_sums(sign: float) -> None:
    """Every weight at its largest magnitude and every activation at +-127: int4's 8, the
    5-bit blocks' 4 and the 6-bit values' 2 summed `vpmaddubsw` results reach 30480, 31496
    and 32004 (a longer run in int16 would saturate)."""
    rows, outputs, inputs = 6, 24, 256
    x = torch.full((rows, inputs), 2.5 * sign)
    int4_values = torch.full((outputs, inputs), 15, dtype=torch.uint8)
    scale_zero = torch.tensor([0.5, 0.25], dtype=torch.bfloat16).expand(outputs, 8, 2).contiguous()
    actual = product(x, pack_native_int4(int4_values), scale_zero, 1)
    expected = int8_rounded(x) @ int4_weight(int4_values, scale_zero, 32).t()
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    for value in (15, -16):  # stored as u = value + 16: 31 and 0
        int5_values = torch.full((outputs, inputs), value, dtype=torch.int8)
        scales = torch.full((outputs, inputs // 32), 0.125, dtype=torch.bfloat16)
        actual = product(x, int5_lanes(int5_values), scales, 1)
        expected = int8_rounded(x) @ (int5_values.double() * 0.125).t()
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)
    for value in (31, -32):  # 6-bit values in int8 blocks of 16, u = value + 32: 63 and 0
        six_bit = torch.full((outputs, inputs), value, dtype=torch.int8)
        scales = torch.full((outputs, inputs // 16), 0.125, dtype=torch.bfloat16)
        actual = product(x, six_bit, scales, 1)
        expected = int8_rounded(x) @ (six_bit.double() * 0.125).t()
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


@native
@pytest.mark.parametrize(("rows", "outputs", "inputs"), [(9, 40, 640), (13, 70, 2048), (5, 17, 96)])
@pytest.mark.parametrize("threads", [1, 2])
def test_6_bit_values_in_int8_blocks_of_16_times_int8_rounded_rows(
    rows: int, outputs: int, inputs: int, threads: int
) -> None:
    """GGUF Q6_K's values (-32..31) held as symmetric int8 blocks of 16: each half block of
    the activations' block of 32 scaled on its own."""
    generator = torch.Generator().manual_seed(rows + outputs + threads)
    values = torch.randint(-32, 32, (outputs, inputs), generator=generator, dtype=torch.int8)
    scales = (torch.rand(outputs, inputs // 16, generator=generator) * 0.01).to(torch.bfloat16)
    weight = values.double() * scales.double().repeat_interleave(16, dim=1)
    x = torch.randn(rows, inputs, generator=generator)
    actual = product(x, values, scales, threads)
    torch.testing.assert_close(actual, int8_rounded(x) @ weight.t(), rtol=1e-5, atol=1e-5)


@native
def test_int8_weights_take_int8_activations_per_slab_where_their_values_fit() -> None:
    """(scale, zero) pairs (GGUF Q5_0 widened, Q8_0, Q5_1 beside them) and symmetric blocks of
    16: a slab of outputs (96 here: 128 KiB of int16) whose values all lie in [-32, 31]
    multiplies int8-rounded rows, a slab with one value outside multiplies int16-rounded
    ones; symmetric blocks of 32 (Q8_0's) always int16."""
    generator = torch.Generator().manual_seed(3)
    outputs, inputs = 200, 640  # slabs [0, 96), [96, 192), [192, 200)
    values = torch.randint(-32, 32, (outputs, inputs), generator=generator).to(torch.int8)
    values[100, 601] = -33  # slab 1 does not fit
    x = torch.randn(12, inputs, generator=generator)
    pairs = (torch.rand(outputs, 20, 2, generator=generator) * 0.01).to(torch.bfloat16)
    pair_weight = (values.double().reshape(outputs, 20, 32) - 8) * pairs[..., :1].double()
    pair_weight = (pair_weight + pairs[..., 1:].double()).reshape(outputs, inputs)
    halves = (torch.rand(outputs, 40, generator=generator) * 0.01).to(torch.bfloat16)
    half_weight = values.double() * halves.double().repeat_interleave(16, dim=1)
    for held_scales, weight in ((pairs, pair_weight), (halves, half_weight)):
        actual = product(x, values, held_scales, 2)
        int16 = torch.ops.exo_native.block_matmul(x, values, held_scales).double()
        expected = int8_rounded(x) @ weight.t()
        fits = torch.ones(outputs, dtype=torch.bool)
        fits[96:192] = False
        torch.testing.assert_close(actual[:, fits], expected[:, fits], rtol=1e-5, atol=1e-5)
        assert_int16_product(actual[:, ~fits], int16[:, ~fits])
    scaled32 = (torch.rand(outputs, 20, generator=generator) * 0.01).to(torch.bfloat16)
    small = values.clone()
    small[100, 601] = 0
    int16 = torch.ops.exo_native.block_matmul(x, small, scaled32)
    assert torch.equal(torch.ops.exo_native.block_matmul(x, small, scaled32, 8), int16)


@native
def test_other_activation_bits_are_refused() -> None:
    values = pack_native_int4(torch.zeros(16, 64, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="activation_bits must be 16 or 8, not 12"):
        torch.ops.exo_native.block_matmul(
            torch.zeros(9, 64), values, torch.ones(16, 2, 2, dtype=torch.bfloat16), 12
        )
    with pytest.raises(ValueError, match="int16, int8, bf16, not 'int4'"):
        set_prefill_activations(torch.nn.Linear(2, 2), "int4")  # type: ignore[arg-type]


def _roundings(projection: Projection) -> set[str]:
    if projection.parts:
        return set().union(*(_roundings(part) for part in projection.parts))
    assert projection.quantized is not None
    return {projection.quantized.prefill_activations}


@pytest.mark.parametrize("activations", ["int16", "int8", "bf16"])
def test_the_engine_option_reaches_every_linear_of_the_lean_forward(
    tiny_card: ModelCard, tiny_model_dir: Path, activations: str
) -> None:
    """Q/K/V and gate/up are fused into new modules after loading: they take the option too;
    a prompt longer than the decode kernels' rows runs the GEMM and the engine generates."""
    shard = make_shard(tiny_card)
    engine = TorchEngine.load(
        tiny_model_dir,
        shard,
        weight_dtype="int4",
        prefill_activations=activations,  # type: ignore[arg-type]
    )
    lean = lean_step_of(engine.model)
    assert lean is not None
    for layer in lean.layers:  # type: ignore[attr-defined]
        for projection in (layer.qkv, layer.output, layer.gate_up, layer.down):
            assert _roundings(projection) == {activations}
    prompt = "Count slowly from one to twenty, one number per line, please."
    pieces = list(engine.generate(request(prompt, temperature=0.0, max_tokens=5)))
    check_stream_shape(pieces)


@native
def test_the_log_says_where_int8_prefill_applies_or_that_it_has_no_effect(
    tiny_card: ModelCard, tiny_model_dir: Path
) -> None:
    from loguru import logger

    shard = make_shard(tiny_card)
    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    try:
        TorchEngine.load(tiny_model_dir, shard, weight_dtype="int4", prefill_activations="int8")
        TorchEngine.load(tiny_model_dir, shard, weight_dtype="float32", prefill_activations="int8")
        TorchEngine.load(tiny_model_dir, shard, weight_dtype="int4", prefill_activations="int16")
    finally:
        logger.remove(sink)
    said = [line for line in logged if "int8" in line]
    assert len(said) == 2, said
    assert "prefill rounds activations to int8 in 14 linears" in said[0]
    assert "--prefill-activations int8 has no effect here" in said[1]


def test_the_node_flag_sets_the_option() -> None:
    # The default depends on the CPU: bf16 where AMX-BF16 runs it, else int16.
    assert parse_args([]).prefill_activations == default_prefill_activations()
    for rounding in ("int16", "int8", "bf16"):
        assert parse_args(["--prefill-activations", rounding]).prefill_activations == rounding
    with pytest.raises(SystemExit):
        parse_args(["--prefill-activations", "int4"])


@native
@pytest.mark.parametrize("kind", ["int4", "int5", "int8 pairs"])
def test_leading_int16_rows_equal_an_int16_call_and_the_rest_an_int8_call(kind: str) -> None:
    """`int16_rows` (a step's decode tokens, first): those rows as with int16 activations
    (`assert_int16_product`), the others exactly as with int8 (each row's sums do not
    depend on the rows beside it); an int8 slab that does not fit keeps every row int16."""
    generator = torch.Generator().manual_seed(11)
    outputs, inputs, rows = 200, 640, 13
    if kind == "int4":
        held = pack_native_int4(
            torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
        )
        scales = (torch.randn(outputs, 20, 2, generator=generator) * 0.1).to(torch.bfloat16)
    elif kind == "int5":
        held = int5_lanes(
            torch.randint(-16, 16, (outputs, inputs), generator=generator, dtype=torch.int8)
        )
        scales = (torch.rand(outputs, 20, generator=generator) * 0.01).to(torch.bfloat16)
    else:
        held = torch.randint(-32, 32, (outputs, inputs), generator=generator).to(torch.int8)
        held[150, 3] = 100  # the last full slab keeps int16 for every row
        scales = (torch.rand(outputs, 20, 2, generator=generator) * 0.01).to(torch.bfloat16)
    x = torch.randn(rows, inputs, generator=generator)
    int16 = torch.ops.exo_native.block_matmul(x, held, scales)
    int8 = torch.ops.exo_native.block_matmul(x, held, scales, 8)
    for decode_rows in (0, 1, 5, rows, rows + 3):
        mixed = torch.ops.exo_native.block_matmul(x, held, scales, 8, decode_rows)
        assert_int16_product(mixed[:decode_rows], int16[:decode_rows])
        assert torch.equal(mixed[decode_rows:], int8[decode_rows:])
    with pytest.raises(RuntimeError, match="int16_rows must be >= 0"):
        torch.ops.exo_native.block_matmul(x, held, scales, 8, -1)


def _decode_beside_a_prefill(engine: TorchEngine) -> float:
    """Request A's greedy logprobs alone against beside B, whose long prompt is prefilled
    in chunks next to A's decode steps: the largest change over A's tokens."""
    from exo.shared.types.common import ModelId
    from exo.shared.types.text_generation import TextGenerationTaskParams
    from exo.worker.engines.torch.batching.chunk_sizer import FixedChunkSizer

    def params(prompt: str, tokens: int) -> TextGenerationTaskParams:
        return TextGenerationTaskParams(
            model=ModelId("m"), prompt=prompt, max_tokens=tokens, temperature=0.0,
            logprobs=True, logit_bias={token: -100.0 for token in engine.eos_token_ids},
        )  # fmt: skip

    # Chunks of a fixed size: the measured sizer's choice follows the machine's load, and
    # with it which of B's prompt rows share a step with A's decode rows.
    engine.scheduler.chunk_sizer = FixedChunkSizer(8)

    def run(beside: bool) -> list[tuple[int, float]]:
        engine.clear_prefix_cache()
        engine.submit(params("Once upon a time, a dragon", 12), request_id="A")
        got: list[tuple[int, float]] = []
        submitted = False
        for _ in range(500):
            if not engine.has_work:
                break
            for request_id, piece in engine.step():
                assert not isinstance(piece, Exception), piece
                if request_id == "A":
                    got.extend(
                        (token, entry.logprob)
                        for token, entry in zip(piece.token_ids, piece.logprobs, strict=True)
                    )
            if beside and not submitted and len(got) >= 2:
                engine.submit(params("word " * 120, 2), request_id="B")
                submitted = True
        return got

    alone, beside = run(False), run(True)
    assert [token for token, _ in alone] == [token for token, _ in beside]
    return max(abs(a - b) for (_, a), (_, b) in zip(alone, beside, strict=True))


@native
def test_a_decoding_stream_keeps_int16_beside_an_int8_prefill(
    tiny_card: ModelCard, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A mixed step (decode tokens first, then a chunk of another prompt) rounds its decode
    rows to int16: a stream's logprobs do not depend on a prompt prefilled beside it any
    more than with int16 prefill; treating the decode rows as prompt rows changes them."""
    import exo.worker.engines.torch.quant.quantized_linear as quantize

    shard = make_shard(tiny_card)
    int16 = TorchEngine.load(
        tiny_model_dir, shard, weight_dtype="int4", prefill_activations="int16"
    )
    int8 = TorchEngine.load(tiny_model_dir, shard, weight_dtype="int4", prefill_activations="int8")
    baseline = _decode_beside_a_prefill(int16)
    kept = _decode_beside_a_prefill(int8)
    assert kept <= 2 * baseline + 1e-4, (kept, baseline)
    monkeypatch.setattr(quantize, "DECODE_ROWS", contextvars.ContextVar("unset", default=0))
    assert _decode_beside_a_prefill(int8) > 10 * (baseline + 1e-5)
