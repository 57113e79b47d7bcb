"""Weight-only quantized linears and the fused RMSNorm against their float32 originals."""

from pathlib import Path

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.fusion import FusedRMSNorm, fuse_rms_norms
from exo.worker.engines.torch.quant.int4_groups import Int4Linear, int4_supported, pack_native_int4
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.native_kernels import (
    NATIVE_INT4_ENV,
    ROUNDS_ACTIVATIONS,
    built_int4_kernel,
    int16_prefill_is_integer,
    rounded_activations,
)
from exo.worker.engines.torch.quant.quantize import quantize_linears
from exo.worker.engines.torch.quant.quantized_linear import QuantizedLinear
from exo.worker.engines.torch.tests.conftest import torch_layout_unpacks
from exo.worker.engines.torch.tests.test_engine import check_stream_shape, request


def random_linear(in_features: int, out_features: int, bias: bool = False) -> nn.Linear:
    torch.manual_seed(in_features * 1000 + out_features)
    linear = nn.Linear(in_features, out_features, bias=bias)
    linear.weight.data.normal_(0.0, 0.02)
    return linear.requires_grad_(False)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual - expected).norm() / expected.norm())


# One row uses the fused kernel; many rows dequantize then matmul.
@pytest.mark.parametrize("rows", [1, 3, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_matches_float32(rows: int, bias: bool) -> None:
    linear = random_linear(576, 1536, bias)
    quantized = Int8Linear(linear)
    x = torch.randn(1, rows, 576)
    with torch.inference_mode():
        actual, expected = quantized(x), linear(x)
    assert actual.shape == expected.shape and actual.dtype == torch.float32
    assert relative_error(actual, expected) < 0.02  # int8 weights + bf16 activations


@pytest.mark.parametrize("rows", [1, 3, 100])
def test_int4_linear_matches_float32(rows: int, int4_layout: str) -> None:
    linear = random_linear(1536, 576)
    quantized = Int4Linear(linear)
    assert quantized.native == (int4_layout == "native")
    x = torch.randn(rows, 1536)
    with torch.inference_mode():
        actual, expected = quantized(x), linear(x)
    assert actual.shape == expected.shape
    # Gaussian weights in 4 bits per group of 32: ~8% error per output.
    assert relative_error(actual, expected) < 0.12


def test_int4_fused_and_dequantized_paths_agree(int4_layout: str) -> None:
    quantized = Int4Linear(random_linear(576, 192))
    if int4_layout == "torch" and not torch_layout_unpacks():
        assert not quantized._unpack_ok  # every call takes torch's kernel: nothing to compare
        pytest.skip("torch's int4 layout on this CPU is not the AVX512 one prefill unpacks")
    assert quantized.native or quantized._unpack_ok
    x = torch.randn(4, 576).to(torch.bfloat16)
    with torch.inference_mode():
        fused = quantized._fused(x).float()
        dequantized = (x @ quantized.dequantize().t()).float()
    assert relative_error(fused, dequantized) < 0.01


# Rows 1-7 run the kernel's 4-row and remainder paths (and 2- and 4-output-row tiles); 40
# the dequantized matmul. Groups of 64 put two blocks of 32 under one (scale, zero); 320
# outputs split over the threads leave tiles with remainders.
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 40])
@pytest.mark.parametrize("group_size", [32, 64])
def test_native_int4_kernel_computes_its_documented_product(
    rows: int, group_size: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    quantized = Int4Linear(random_linear(640, 320), group_size=group_size)
    assert quantized.native
    values = quantized._unpack().double()  # [out, in], 0..15
    scale_zero = quantized.scales_and_zeros.double()  # [out, groups, 2]
    out = values.shape[0]
    groups = 640 // group_size
    weight = (values.reshape(out, groups, group_size) - 8) * scale_zero[..., :1]
    weight = (weight + scale_zero[..., 1:]).reshape(out, 640)
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 640, generator=generator)
    with torch.inference_mode():
        actual = quantized.matmul(x)
    assert actual.dtype == torch.float32 and actual.shape == (rows, out)
    exact = x.double() @ weight.t()
    if ROUNDS_ACTIVATIONS:  # the kernel (up to 16 rows) or the matmul computing its sum
        expected = rounded_activations(x).double() @ weight.t()
        # Rounding the activations to int16 moves the product by ~2e-5 of its norm ...
        assert 0 < relative_error(actual.double(), exact) < 1e-4
    else:  # the portable kernel: the exact product
        expected = exact
    # ... and otherwise only float32 summation differs from float64.
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-4)


# block_matmul (prefill) on shapes that leave every remainder: rows not a multiple of the
# 4-row tile, outputs not a multiple of the 16-output tile or of a slab, an odd last int4
# block, groups of two blocks, int8 blocks with negative values; one and two threads.
@pytest.mark.parametrize(
    ("kind", "rows", "outputs", "inputs", "group_size"),
    [
        ("int4", 8, 70, 96, 32),
        ("int4", 17, 333, 640, 64),
        ("int4", 130, 48, 160, 32),
        ("int8", 9, 70, 96, 32),
        ("int8", 33, 129, 640, 32),
    ],
)
@pytest.mark.parametrize("threads", [1, 2])
def test_block_matmul_computes_the_decode_kernels_product(
    kind: str, rows: int, outputs: int, inputs: int, group_size: int, threads: int
) -> None:
    assert built_int4_kernel() is not None
    generator = torch.Generator().manual_seed(rows * outputs + threads)
    if kind == "int4":
        values = torch.randint(0, 16, (outputs, inputs), generator=generator, dtype=torch.uint8)
        held = pack_native_int4(values)
    else:
        values = torch.randint(-128, 128, (outputs, inputs), generator=generator).to(torch.int8)
        held = values
    groups = inputs // group_size
    scale_zero = (torch.randn(outputs, groups, 2, generator=generator) * 0.1).to(torch.bfloat16)
    weight = values.double().reshape(outputs, groups, group_size) - 8
    weight = weight * scale_zero[..., :1].double() + scale_zero[..., 1:].double()
    x = torch.randn(rows, inputs, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = torch.ops.exo_native.block_matmul(x, held, scale_zero).double()
    finally:
        torch.set_num_threads(before)
    activations = rounded_activations(x).double() if ROUNDS_ACTIVATIONS else x.double()
    weight = weight.reshape(outputs, inputs)
    expected = activations @ weight.t()
    if int16_prefill_is_integer():  # exact integer sums, scaled in float32
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
    else:  # float32 products and sums: within the bound of recursive summation (Higham, 3.1)
        bound = (inputs + 2) * 2.0**-24 * (activations.abs() @ weight.abs().t())
        assert ((actual - expected).abs() <= bound).all()


def test_block_matmul_rounds_activations_as_documented() -> None:
    """Through an identity weight (symmetric int8 blocks of 32, scales 1) `block_matmul`
    returns its rounded activations exactly: they equal `rounded_activations` bit for bit
    (ties to even, all-zero blocks, a block of one tiny value, signs), on both prefill paths."""
    assert built_int4_kernel() is not None
    inputs = 96
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(7, inputs, generator=generator) * torch.logspace(-20, 20, 7).unsqueeze(1)
    x[0, :32] = 0.0  # an all-zero block
    x[1, :32] = torch.tensor([32767.0, 2.5, 3.5, -4.5, -0.5, 0.5, 1.5] + [0.0] * 25)  # ties
    x[2, 32:64] = 0.0
    x[2, 40] = -1e-30  # one tiny value
    identity = torch.eye(inputs, dtype=torch.int8)
    scales = torch.ones(inputs, inputs // 32, dtype=torch.bfloat16)
    rounded = torch.ops.exo_native.block_matmul(x, identity, scales)
    expected = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    assert torch.equal(rounded, expected)
    assert rounded[1, :7].tolist() == [32767.0, 2.0, 4.0, -4.0, -0.0, 0.0, 2.0]


_TILE_PRODUCTS_SCRIPT = """
import sys, torch
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.int5_blocks import int5_lanes
from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
assert built_int4_kernel() is not None
print(torch.ops.exo_native.int16_tile_bits())
g = torch.Generator().manual_seed(0)
def int4(outputs, inputs, group):
    values = torch.randint(0, 16, (outputs, inputs), generator=g, dtype=torch.uint8)
    pairs = (torch.randn(outputs, inputs // group, 2, generator=g) * 0.1).to(torch.bfloat16)
    return pack_native_int4(values), pairs
def int8(outputs, inputs, block):
    values = torch.randint(-128, 128, (outputs, inputs), generator=g, dtype=torch.int8)
    if block == 0:  # (scale, zero) pairs per 32 inputs
        pairs = torch.randn(outputs, inputs // 32, 2, generator=g) * 0.01
        return values, pairs.to(torch.bfloat16)
    return values, (torch.rand(outputs, inputs // block, generator=g) * 0.01).to(torch.bfloat16)
def int5(outputs, inputs):
    values = torch.randint(-16, 16, (outputs, inputs), generator=g, dtype=torch.int8)
    scales = torch.rand(outputs, inputs // 32, generator=g) * 0.01
    return int5_lanes(values), scales.to(torch.bfloat16)
weights = [int4(70, 640, 32), int4(48, 960, 96), int4(333, 96, 32), int4(16, 2048, 64),
           int8(70, 640, 0), int8(40, 640, 16), int8(36, 640, 32), int5(70, 640)]
products = []
for rows in (1, 5, 6, 7, 13, 40):
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for held, scales in weights:
            inputs = held.shape[1] * (2 if held.dtype == torch.uint8 and scales.dim() == 3 else 1)
            if scales.dim() == 2 and held.dtype == torch.uint8:
                inputs = scales.shape[1] * 32
            x = torch.randn(rows, inputs, generator=g)
            products.append(torch.ops.exo_native.block_matmul(x, held, scales))
            products.append(torch.ops.exo_native.block_matmul(x, held, scales, 8, 2))
torch.save(products, sys.argv[1])
"""


def test_512_bit_int16_tiles_compute_the_256_bit_tiles_product(tmp_path: Path) -> None:
    """Where the kernels are built with 512-bit int16 tiles (AVX512-VNNI + AVX512BW),
    `block_matmul` equals, bit for bit, its product with the 256-bit tiles
    (`EXO_NATIVE_INT_GEMM=256`; read once per process: child processes) for int4 (groups of
    32, 64 and 96: groups across the tiles' passes of 8 blocks; an odd last block), int8
    pairs, symmetric int8 blocks of 16 and 32, and 5-bit blocks; rows around the 6-row tile,
    output counts that leave a last tile of 16, one and two threads; int16 calls and int8
    calls' two int16 rows."""
    import os
    import subprocess
    import sys

    results = {}
    for forced in ("1", "256"):
        path = tmp_path / f"{forced}.pt"
        env = {**os.environ, "EXO_NATIVE_INT_GEMM": forced}
        done = subprocess.run(
            [sys.executable, "-c", _TILE_PRODUCTS_SCRIPT, str(path)],
            capture_output=True, text=True, timeout=300, env=env, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        bits = int(done.stdout.strip().splitlines()[-1])
        if forced == "1" and bits != 512:
            pytest.skip(f"the kernels here have {bits}-bit int16 tiles only")
        assert forced == "1" or bits == 256
        results[forced] = torch.load(path)
    assert len(results["1"]) == len(results["256"]) == 6 * 2 * 8 * 2
    for wide, narrow in zip(results["1"], results["256"], strict=True):
        assert torch.equal(wide, narrow)


@pytest.mark.parametrize("threads", [1, 2])
def test_native_int4_kernel_takes_any_output_count(threads: int) -> None:
    """70 outputs: tiles of four output rows, then single rows, on one or two threads; 96
    inputs: a pair of blocks, then an odd block."""
    kernel = built_int4_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(threads)
    values = torch.randint(0, 16, (70, 96), generator=generator, dtype=torch.uint8)
    qweight = pack_native_int4(values)
    scale_zero = (torch.randn(70, 3, 2, generator=generator) * 0.1).to(torch.bfloat16)
    weight = (values.double().reshape(70, 3, 32) - 8) * scale_zero[..., :1].double()
    weight = (weight + scale_zero[..., 1:].double()).reshape(70, 96)
    x = torch.randn(3, 96, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = kernel(x, qweight, scale_zero).double()
    finally:
        torch.set_num_threads(before)
    activations = rounded_activations(x).double() if ROUNDS_ACTIVATIONS else x.double()
    expected = activations @ weight.t()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_int8_channel_kernel_computes_its_documented_product(
    rows: int, threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Int8Linear on exo's kernel: the int8 weight times its per-output scale times the
    activations rounded to int16 blocks (70 outputs: tiles of four, then single rows)."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    quantized = Int8Linear(random_linear(96, 70))
    assert quantized.native
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.inference_mode():
            actual = quantized(x)
    finally:
        torch.set_num_threads(before)
    assert actual.dtype == torch.float32 and actual.shape == (rows, 70)
    weight = quantized.weight.double() * quantized.scales.double()[:, None]
    activations = rounded_activations(x).double() if ROUNDS_ACTIVATIONS else x.double()
    torch.testing.assert_close(actual.double(), activations @ weight.t(), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [1, 5, 20])
def test_bf16_linear_on_native_kernels_is_exact_in_float32(
    rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight held in bfloat16 (GGUF Q6_K) where exo's kernels run: float32 rows times the
    bfloat16 weight in float32 (exo's kernel up to 16 rows, torch's float32 matmul above;
    70 outputs: tiles of four, then single rows; 100 inputs: a tail after 8-wide steps)."""
    from exo.worker.engines.torch.quant.gguf_weights import Bf16Linear

    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    generator = torch.Generator().manual_seed(rows)
    linear = Bf16Linear(torch.randn(70, 100, generator=generator), torch.randn(70))
    assert linear.native
    x = torch.randn(rows, 100, generator=generator)
    with torch.inference_mode():
        actual = linear(x)
    assert actual.dtype == torch.float32 and actual.shape == (rows, 70)
    assert linear.bias is not None
    expected = x.double() @ linear.weight.double().t() + linear.bias.double()
    torch.testing.assert_close(actual.double(), expected, rtol=1e-5, atol=1e-5)


def test_native_int4_kernel_refuses_bad_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = built_int4_kernel()
    assert kernel is not None
    qweight = torch.zeros(64, 32, dtype=torch.uint8)
    scale_zero = torch.zeros(64, 2, 2, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="inputs"):
        kernel(torch.zeros(1, 32), qweight, scale_zero)
    with pytest.raises(RuntimeError, match="float32"):
        kernel(torch.zeros(1, 64, dtype=torch.bfloat16), qweight, scale_zero)
    with pytest.raises(RuntimeError, match="multiples of 32"):
        kernel(torch.zeros(1, 64), qweight, torch.zeros(64, 4, 2, dtype=torch.bfloat16))


def test_int4_unsupported_shape_falls_back_to_int8() -> None:
    first, second = random_linear(64, 100), random_linear(100, 64)
    assert not int4_supported(first) and not int4_supported(second)
    model = nn.Sequential(first, second)
    assert quantize_linears(model, "int4") == 2
    assert all(type(module) is Int8Linear for module in model)


def test_quantize_linears_float32_is_a_no_op_and_unknown_dtype_fails() -> None:
    model = nn.Sequential(random_linear(64, 64))
    assert quantize_linears(model, "float32") == 0
    assert type(model[0]) is nn.Linear
    with pytest.raises(ValueError, match="unknown weight dtype"):
        quantize_linears(model, "int3")  # type: ignore[arg-type]


def test_fused_rms_norm_matches_llama_rms_norm() -> None:
    # Its own seeded generator: the global one's state depends on the tests run before.
    generator = torch.Generator().manual_seed(0)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data.uniform_(0.5, 1.5, generator=generator)
    holder = nn.ModuleDict({"norm": norm})
    assert fuse_rms_norms(holder, (LlamaRMSNorm,)) == 1
    assert isinstance(holder["norm"], FusedRMSNorm)
    x = torch.randn(2, 7, 576, generator=generator)
    torch.testing.assert_close(holder["norm"](x), norm(x))


def test_tiny_int4_engine_keeps_lm_head_int8_and_generates(
    tiny_card: ModelCard, tiny_model_dir: Path
) -> None:
    shard = ShardMetadata(
        sharding="pipeline", model_card=tiny_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=tiny_card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(tiny_model_dir, shard, weight_dtype="int4")
    assert engine.weight_dtype == "int4"
    assert type(engine.model.get_output_embeddings()) is Int8Linear
    linears = [module for module in engine.model.modules() if isinstance(module, nn.Linear)]
    assert linears == []
    assert any(isinstance(module, Int4Linear) for module in engine.model.modules())
    pieces = list(engine.generate(request("Hello there", temperature=0.0, max_tokens=6)))
    check_stream_shape(pieces)


def test_quantized_engine_rejects_non_cpu_device(
    tiny_card: ModelCard, tiny_model_dir: Path
) -> None:
    shard = ShardMetadata(
        sharding="pipeline", model_card=tiny_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=tiny_card.n_layers,
    )  # fmt: skip
    with pytest.raises(ValueError, match="only supported on CPU"):
        TorchEngine.load(tiny_model_dir, shard, device="meta", weight_dtype="int8")


@pytest.mark.parametrize("weight_dtype", ["float32", "int8"])
def test_real_other_weight_dtypes_answer_paris(
    real_card: ModelCard, real_model_dir: Path, weight_dtype: str
) -> None:
    shard = ShardMetadata(
        sharding="pipeline", model_card=real_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=real_card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(real_model_dir, shard, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    assert engine.weight_dtype == weight_dtype
    params = request("What is the capital of France?", temperature=0.0, max_tokens=30)
    assert "Paris" in "".join(piece.text for piece in engine.generate(params))


def test_real_default_engine_is_int4(real_engine: TorchEngine) -> None:
    # The Paris test in test_engine.py runs on this engine: the default format answers it.
    assert real_engine.weight_dtype == "int4"
    assert any(isinstance(module, QuantizedLinear) for module in real_engine.model.modules())


def test_a_kernel_that_does_not_build_leaves_torch_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed build (here: a source that does not compile, as a missing compiler would
    fail) logs the cause and returns None; int4 layers then hold torch's layout."""
    from loguru import logger

    from exo.worker.engines.torch.quant import native_kernels

    broken = tmp_path / "int4_gemv.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(native_kernels, "_SOURCES", (broken, *native_kernels._SOURCES[1:]))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    warnings: list[str] = []
    sink = logger.add(lambda message: warnings.append(str(message)), level="WARNING")
    native_kernels.built_int4_kernel.cache_clear()
    try:
        assert native_kernels.built_int4_kernel() is None
        assert native_kernels.native_int4_kernel() is None
        assert not Int4Linear(random_linear(64, 64)).native
    finally:
        logger.remove(sink)
        native_kernels.built_int4_kernel.cache_clear()  # the next test loads the real one
    assert any("could not be built" in line for line in warnings)
    assert not list((tmp_path / "cache").glob("*.so"))  # nothing half-built left in place
