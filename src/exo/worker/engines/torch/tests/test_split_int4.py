"""GGUF Q8_0 / Q5_0 / Q5_1 blocks as two int4 planes: the block integers against `gguf`'s own
dequantizer, the planes exact up to the bfloat16 rounding of scales, the module's kernels,
fusion, and a tiny GGUF loaded whole and tensor parallel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from exo.download.gguf_repack import convert_gguf
from exo.shared.types.shards import ShardMetadata
from exo.testing.random_gguf import RandomGgufShape, write_random_gguf
from exo.worker.engines.torch.model.fusion import fuse_linears
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.int4_planes import BlockPart, SplitInt4Linear, block_values
from exo.worker.engines.torch.quant.native_kernels import (
    ROUNDS_ACTIVATIONS,
    built_int8_block_kernel,
    rounded_activations,
)
from exo.worker.engines.torch.tests.conftest import torch_layout_unpacks

ROWS, COLUMNS = 128, 256
TYPES = ["Q8_0", "Q5_0", "Q5_1"]


def blocks_of(type_name: str, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(raw blocks `[ROWS, bytes]`, gguf's dequantization `[ROWS, COLUMNS]`) of Gaussian
    weights with outliers, offset so that Q5_1's minimum is not symmetric."""
    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32) * 0.02 + 0.003
    weights[rng.random(weights.shape) < 0.002] *= 10.0
    qtype = GGMLQuantizationType[type_name]
    raw = quantize(weights, qtype)
    return raw, dequantize(raw, qtype).reshape(ROWS, COLUMNS)


def plane_values(linear: SplitInt4Linear) -> torch.Tensor:
    """The float32 weight `[out, in]` the two planes hold: `(q - 8) * scale + zero` per
    group of each plane (bfloat16 scales and zeros as held), the planes added."""
    if linear._native:  # the block integers as they are, with (scale, offset) pairs
        pairs = linear.scale_zero.float()
        blocks = linear.values.float().reshape(linear.out_features, -1, 32)
        weight = (blocks - 8.0) * pairs[..., :1] + pairs[..., 1:]
        return weight.reshape(linear.out_features, linear.in_features)
    planes = linear.planes
    q = planes._unpack().float()  # [out, 2 in]
    scale_zero = planes.scale_zero_by_output().float()  # [out, groups, 2]
    scales = scale_zero[..., 0].repeat_interleave(planes.group_size, dim=1)
    zeros = scale_zero[..., 1].repeat_interleave(planes.group_size, dim=1)
    both = (q - 8.0) * scales + zeros
    return both[:, : linear.in_features] + both[:, linear.in_features :]


@pytest.mark.parametrize("type_name", TYPES)
def test_block_values_are_what_gguf_dequantizes(type_name: str) -> None:
    raw, expected = blocks_of(type_name)
    values, scales, offsets = block_values(raw, type_name)
    assert values.shape == (ROWS, COLUMNS) and scales.shape == (ROWS, COLUMNS // 32)
    low, high = {"Q8_0": (-128, 127), "Q5_0": (-16, 15), "Q5_1": (0, 31)}[type_name]
    assert values.min() >= low and values.max() <= high
    assert values.min() < low + 4 and values.max() > high - 4  # the whole range is used
    assert (offsets != 0).any() == (type_name == "Q5_1")
    ours = values * np.repeat(scales, 32, axis=1) + np.repeat(offsets, 32, axis=1)
    np.testing.assert_allclose(ours, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("type_name", TYPES)
def test_the_planes_hold_the_blocks_up_to_bf16_scales(type_name: str, int4_layout: str) -> None:
    if int4_layout == "torch" and not torch_layout_unpacks():
        pytest.skip("torch's int4 layout on this CPU is not the AVX512 one the test unpacks")
    raw, expected = blocks_of(type_name)
    values, scales, offsets = (torch.from_numpy(part) for part in block_values(raw, type_name))
    linear = SplitInt4Linear(values, scales, offsets, None)
    held = plane_values(linear)
    rounded_scales = scales.to(torch.bfloat16).float().repeat_interleave(32, dim=1)
    if type_name == "Q5_1":
        # The low plane's zero 8d + m is rounded as one bfloat16: at most 2^-9 of it.
        zeros = (8 * scales + offsets).repeat_interleave(32, dim=1)
        bound = (values.abs() + 8).float() * rounded_scales.abs() * 2.0**-8
        bound += zeros.abs() * 2.0**-8 + 1e-7
        assert torch.all((held - torch.from_numpy(expected)).abs() <= bound)
    else:
        # Scales 16d and zero 8d are d's bfloat16 rounding times a power of two: the planes
        # add up to value x bf16(d) exactly.
        assert torch.equal(held, values.float() * rounded_scales)
    relative = (held - torch.from_numpy(expected)).norm() / np.linalg.norm(expected)
    assert relative < 2.0**-8


@pytest.mark.parametrize("type_name", TYPES)
def test_decode_and_prefill_products_match_the_weight(type_name: str, int4_layout: str) -> None:
    raw, expected = blocks_of(type_name, seed=1)
    values, scales, offsets = (torch.from_numpy(part) for part in block_values(raw, type_name))
    bias = torch.linspace(-1, 1, ROWS)
    linear = SplitInt4Linear(values, scales, offsets, bias)
    if int4_layout == "torch" and not torch_layout_unpacks():
        pytest.skip("torch's int4 layout on this CPU is not the AVX512 one prefill unpacks")
    assert linear.native or linear.planes._unpack_ok
    generator = torch.Generator().manual_seed(0)
    weight = torch.from_numpy(expected)
    for rows in (1, 3, linear.fused_max_rows + 16):  # fused kernel, then dequantize + matmul
        x = torch.randn(rows, COLUMNS, generator=generator)
        reference = x.to(torch.bfloat16).double() @ weight.double().t() + bias.double()
        got = linear(x).double()
        assert got.shape == (rows, ROWS)
        error = (got - reference).norm() / reference.norm()
        assert error < 1e-2, f"{rows} rows: relative error {error:.4f}"
    # Prefill's bfloat16 weight: `d * v + m` rounded to bfloat16 once (Q5_1's offset once
    # more): within bfloat16's relative step of the value and of the offset.
    held = plane_values(linear)
    step = (held.abs() + offsets.abs().repeat_interleave(32, dim=1)) * 2.0**-8
    assert torch.all((linear.dequantize().float() - held).abs() <= step + 1e-9)


def test_split_linears_fuse_along_outputs(int4_layout: str) -> None:
    parts = []
    for seed, type_name in enumerate(["Q5_0", "Q8_0", "Q5_0"]):
        raw, _ = blocks_of(type_name, seed=seed)
        values, scales, offsets = (torch.from_numpy(p) for p in block_values(raw, type_name))
        parts.append(SplitInt4Linear(values, scales, offsets, None))
    x = torch.randn(2, COLUMNS, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    separately = [part.matmul(x) for part in parts]
    fused = fuse_linears(parts)
    assert isinstance(fused, SplitInt4Linear) and fused.out_features == 3 * ROWS
    assert torch.equal(fused.matmul(x), torch.cat(separately, dim=1))
    # The parts now read their rows of the fused planes and still compute the same.
    for part, alone in zip(parts, separately, strict=True):
        assert torch.equal(part.matmul(x), alone)


def test_a_block_part_reads_rows_and_columns_of_one_part() -> None:
    raw, _ = blocks_of("Q5_1")
    values, scales, offsets = block_values(raw, "Q5_1")

    class Slice:  # safetensors' get_slice: a shape and row indexing
        def get_shape(self) -> list[int]:
            return list(raw.shape)

        def __getitem__(self, key: Any) -> torch.Tensor:
            return torch.from_numpy(raw)[key]

    part = BlockPart(Slice(), "Q5_1", "values")
    assert part.get_shape() == [ROWS, COLUMNS]
    assert torch.equal(part[8:24, 64:128], torch.from_numpy(values)[8:24, 64:128])
    scale_part = BlockPart(Slice(), "Q5_1", "scales")
    assert scale_part.get_shape() == [ROWS, COLUMNS // 32]
    assert torch.equal(scale_part[:, 2:4], torch.from_numpy(scales)[:, 2:4])
    assert torch.equal(BlockPart(Slice(), "Q5_1", "offsets")[5:6], torch.from_numpy(offsets)[5:6])


def test_block_values_refuse_other_types_and_partial_blocks() -> None:
    raw, _ = blocks_of("Q8_0")
    with pytest.raises(ValueError, match="Q6_K"):
        block_values(raw, "Q6_K")
    with pytest.raises(ValueError, match="whole blocks"):
        block_values(raw[:, :-1], "Q8_0")
    with pytest.raises(ValueError, match="-128, 127"):
        SplitInt4Linear(torch.full((64, 32), 200), torch.ones(64, 1), torch.zeros(64, 1), None)


SHAPE = RandomGgufShape(
    architecture="llama", hidden_size=128, n_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=320,
)  # fmt: skip
TOKENS = torch.tensor([[5, 17, 99, 200, 3, 44, 8, 250, 31, 7]])


@pytest.fixture(scope="module", params=["Q8_0", "Q5_0"])
def repacked(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny llama GGUF whose linears are Q8_0 or Q5_0, repacked for the engine."""
    root = tmp_path_factory.mktemp(f"split-{request.param}")
    gguf_path = write_random_gguf(root / "tiny.gguf", SHAPE, tensor_type=request.param, seed=5)
    (root / "repacked").mkdir()
    convert_gguf(gguf_path, root / "repacked")
    return root / "repacked"


def _load(directory: Path, weight_dtype: str, rank: int = 0, world_size: int = 1) -> Any:
    from exo.shared.models.cards import card_from_local_directory

    card = card_from_local_directory(directory)
    shard: Any
    if world_size == 1:
        shard = ShardMetadata(
            sharding="pipeline",
            model_card=card,
            device_rank=0,
            world_size=1,
            start_layer=0,
            end_layer=card.n_layers,
        )
    else:
        shard = ShardMetadata(
            sharding="tensor",
            model_card=card,
            device_rank=rank,
            world_size=world_size,
            start_layer=0,
            end_layer=card.n_layers,
        )
    return load_model(directory, shard, torch.device("cpu"), weight_dtype)  # type: ignore[arg-type]


def test_a_repacked_gguf_loads_its_blocks_as_split_planes(repacked: Path) -> None:
    exact = _load(repacked, "float32")  # gguf's dequantization, float32 throughout
    split = _load(repacked, "int4")
    layer = split.model.layers[0]
    for module in (layer.self_attn.q_proj, layer.self_attn.o_proj, layer.mlp.down_proj):
        assert isinstance(module, SplitInt4Linear)
    torch.testing.assert_close(
        layer.mlp.up_proj.dequantize().float(),
        exact.model.layers[0].mlp.up_proj.weight.float(),
        rtol=2.0**-7,
        atol=1e-6,
    )
    with torch.no_grad():
        reference = exact(TOKENS).logits.float()
        got = split(TOKENS).logits.float()
    assert (got - reference).abs().max() < 0.02 * reference.abs().max()


def test_tensor_parallel_ranks_split_the_planes(repacked: Path) -> None:
    whole = _load(repacked, "int4").model.layers[0]
    for rank in range(2):
        layer = _load(repacked, "int4", rank=rank, world_size=2).model.layers[0]
        rows = slice(rank * 64, (rank + 1) * 64)  # column parallel: this rank's outputs
        assert isinstance(layer.self_attn.q_proj, SplitInt4Linear)
        assert torch.equal(
            layer.self_attn.q_proj.dequantize(), whole.self_attn.q_proj.dequantize()[rows]
        )
        columns = slice(rank * 128, (rank + 1) * 128)  # row parallel: its inputs, all-reduced
        local = layer.mlp.down_proj.local
        assert isinstance(local, SplitInt4Linear)
        assert torch.equal(local.dequantize(), whole.mlp.down_proj.dequantize()[:, columns])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("threads", [1, 2])
def test_native_block_kernel_computes_its_documented_product(rows: int, threads: int) -> None:
    """exo's int8 block kernel: `(v - 8) * scale + zero` per block of 32 times the
    activations as the kernel rounds them; 70 outputs leave tiles with remainders."""
    kernel = built_int8_block_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(rows * 10 + threads)
    values = torch.randint(-128, 128, (70, 96), generator=generator, dtype=torch.int8)
    scale_zero = (torch.randn(70, 3, 2, generator=generator) * 0.01).to(torch.bfloat16)
    pairs = scale_zero.double()
    weight = (values.double().reshape(70, 3, 32) - 8) * pairs[..., :1] + pairs[..., 1:]
    x = torch.randn(rows, 96, generator=generator)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        actual = kernel(x, values, scale_zero).double()
    finally:
        torch.set_num_threads(before)
    activations = rounded_activations(x).double() if ROUNDS_ACTIVATIONS else x.double()
    expected = activations @ weight.reshape(70, 96).t()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-4)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernel(torch.zeros(1, 80), torch.zeros(70, 80, dtype=torch.int8), scale_zero)
