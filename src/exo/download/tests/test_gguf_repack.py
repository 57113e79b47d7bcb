"""GGUF blocks repacked for the engine: every supported block type against `gguf`'s own
dequantizer, the int4 module built from the groups, tensor- and pipeline-parallel loading of
the repacked weights, and a tiny GGUF end to end against transformers' dequantizing path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize
from safetensors.torch import load_file

from exo.download.gguf_repack import (
    Int4Groups,
    convert_gguf,
    dequantize_int4,
    repack_int4,
)
from exo.download.pypi_gguf import dequantize_gguf_to_safetensors
from exo.shared.models.weight_formats import INT4_GROUP_SIZE
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.testing.random_gguf import RandomGgufShape, write_random_gguf
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.gguf_weights import (
    Bf16Linear,
    DequantizedBlocks,
    DequantizedGroups,
    int4_linear_from_groups,
)
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
from exo.worker.engines.torch.quant.int8_blocks import ScaledInt8Linear
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel
from exo.worker.engines.torch.quant.quantize import WeightDtype

ROWS, COLUMNS = 64, 512
BF16_RELATIVE = 2.0**-8  # bfloat16 keeps 8 significant bits: rounding moves a value <= 2^-9


def weights(seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32) * 0.02
    values[rng.random(values.shape) < 0.002] *= 10.0  # outliers, as real weights have
    return values


def random_blocks(type_name: str, seed: int = 0) -> np.ndarray:
    """Random bytes in `type_name`'s block layout, its fp16 fields set to finite values
    (for types `gguf.quants.quantize` cannot write)."""
    qtype = GGMLQuantizationType[type_name]
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (ROWS, COLUMNS // block_size, type_size), dtype=np.uint8)
    half_offsets = {"Q4_K": (0, 2), "Q6_K": (208,)}[type_name]
    for offset in half_offsets:
        halves = rng.uniform(1e-4, 1e-2, raw.shape[:2]).astype(np.float16)
        raw[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return raw.reshape(ROWS, -1)


def blocks_of(type_name: str) -> np.ndarray:
    if type_name in ("Q4_K", "Q6_K"):
        return random_blocks(type_name)
    return quantize(weights(), GGMLQuantizationType[type_name])


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q4_K"])
def test_int4_repack_equals_gguf_dequantize(type_name: str) -> None:
    raw = blocks_of(type_name)
    expected = dequantize(raw, GGMLQuantizationType[type_name]).reshape(ROWS, COLUMNS)
    groups = repack_int4(type_name, raw, ROWS)
    assert groups.packed.dtype == np.uint8 and groups.packed.shape == (ROWS, COLUMNS // 2)
    assert groups.scales.shape == (ROWS, COLUMNS // INT4_GROUP_SIZE)
    # With float32 scales and zeros the repacked groups are the same values (float32
    # arithmetic in another order: `(q - 8) s + (m + 8 s)` against `q s + m`).
    exact = dequantize_int4(groups)
    np.testing.assert_allclose(exact, expected, rtol=0, atol=1e-6 * np.abs(expected).max())
    # Stored as bfloat16 (as on disk and in the engine): only their rounding moves a value.
    scales = torch.from_numpy(groups.scales).to(torch.bfloat16).float().numpy()
    zeros = torch.from_numpy(groups.zeros).to(torch.bfloat16).float().numpy()
    rounded = dequantize_int4(Int4Groups(groups.packed, scales, zeros))
    bound = (
        np.repeat(8 * np.abs(groups.scales) + np.abs(groups.zeros), INT4_GROUP_SIZE, axis=1)
        * BF16_RELATIVE
    )
    assert np.all(np.abs(rounded - expected) <= bound + 1e-7)
    assert not np.array_equal(rounded, np.zeros_like(rounded))


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0", "Q6_K"])
def test_other_types_load_as_gguf_dequantizes_them(type_name: str) -> None:
    raw = blocks_of(type_name)
    qtype = GGMLQuantizationType[type_name]
    expected = torch.from_numpy(dequantize(raw, qtype).reshape(ROWS, COLUMNS))

    class Slice:  # what safetensors' get_slice gives: a shape and row/column indexing
        def get_shape(self) -> list[int]:
            return list(raw.shape)

        def __getitem__(self, key: Any) -> torch.Tensor:
            return torch.from_numpy(raw)[key]

    blocks = DequantizedBlocks(Slice(), type_name)
    assert blocks.get_shape() == [ROWS, COLUMNS]
    assert torch.equal(blocks[:], expected)
    assert torch.equal(blocks[8:24], expected[8:24])
    assert torch.equal(blocks[:, 100:300], expected[:, 100:300])
    linear = Bf16Linear(expected, None)
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(0))
    reference = x @ expected.to(torch.bfloat16).float().t()
    torch.testing.assert_close(
        linear(x), reference, rtol=2e-2, atol=2e-2 * float(reference.abs().max())
    )


def test_int4_linear_from_groups_matches_the_groups() -> None:
    groups = repack_int4("Q4_1", blocks_of("Q4_1"), ROWS)
    packed, scales, zeros = (
        torch.from_numpy(groups.packed),
        torch.from_numpy(groups.scales),
        torch.from_numpy(groups.zeros),
    )
    bias = torch.linspace(-1, 1, ROWS)
    module = int4_linear_from_groups(packed, scales, zeros, bias)
    assert isinstance(module, Int4Linear) and module.group_size == INT4_GROUP_SIZE
    bf16 = Int4Groups(
        groups.packed, scales.bfloat16().float().numpy(), zeros.bfloat16().float().numpy()
    )
    weight = torch.from_numpy(dequantize_int4(bf16))
    # The module's own dequantization rounds `zero - 8 scale` to bfloat16 once more.
    torch.testing.assert_close(
        module.dequantize().float(), weight, rtol=0, atol=0.01 * float(weight.abs().max())
    )
    x = torch.randn(2, COLUMNS, generator=torch.Generator().manual_seed(1))
    expected = x @ weight.t() + bias
    for rows in (x, x.repeat(40, 1)):  # the fused kernel and the dequantized matmul
        got = module(rows)[: x.shape[0]]
        torch.testing.assert_close(got, expected, rtol=0, atol=0.02 * float(expected.abs().max()))
    with pytest.raises(ValueError, match="int4 cannot pack"):
        int4_linear_from_groups(packed[:32], scales[:32], zeros[:32], None)


def test_a_column_slice_cutting_groups_reads_the_dequantized_weight() -> None:
    """A row-parallel rank whose columns cut an int4 group (in / world size no multiple of
    32) gets its slice of the dequantized weight."""
    groups = repack_int4("Q4_0", blocks_of("Q4_0"), ROWS)
    parts = (
        torch.from_numpy(groups.packed),
        torch.from_numpy(groups.scales),
        torch.from_numpy(groups.zeros),
    )

    class Slice:
        def __init__(self, tensor: torch.Tensor) -> None:
            self.tensor = tensor

        def get_shape(self) -> list[int]:
            return list(self.tensor.shape)

        def __getitem__(self, key: Any) -> torch.Tensor:
            return self.tensor[key]

    weight = DequantizedGroups(*(Slice(part) for part in parts))
    whole = torch.from_numpy(dequantize_int4(groups))
    assert weight.get_shape() == [ROWS, COLUMNS]
    assert torch.equal(weight[:, 48:112], whole[:, 48:112])
    assert torch.equal(weight[3:9], whole[3:9])


SHAPE = RandomGgufShape(
    architecture="llama", hidden_size=128, n_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=320,
)  # fmt: skip
TOKENS = torch.tensor([[5, 17, 99, 200, 3, 44, 8, 250, 31, 7]])


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny llama GGUF (Q4_0 linears, Q8_0 embedding), converted by repacking and by
    transformers' dequantizing loader."""
    root = tmp_path_factory.mktemp("gguf")
    gguf_path = write_random_gguf(root / "tiny.gguf", SHAPE, tensor_type="Q4_0", seed=3)
    directories = {"repacked": root / "repacked", "dequantized": root / "dequantized"}
    for directory in directories.values():
        directory.mkdir()
    report = convert_gguf(gguf_path, directories["repacked"])
    assert (report.int4_tensors, report.gguf_block_tensors) == (14, 1)
    dequantize_gguf_to_safetensors(gguf_path, directories["dequantized"])
    return {"gguf": gguf_path, **directories}


def card_of(directory: Path) -> ModelCard:
    from exo.shared.models.cards import card_from_local_directory

    return card_from_local_directory(directory)


def logits(directory: Path, weight_dtype: WeightDtype) -> torch.Tensor:
    card = card_of(directory)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    model = load_model(directory, shard, torch.device("cpu"), weight_dtype)
    with torch.no_grad():
        return model(TOKENS).logits.float()


def test_tiny_gguf_direct_path_matches_dequantized_path(tiny_models: dict[str, Path]) -> None:
    reference = logits(tiny_models["dequantized"], "float32")
    scale = float(reference.abs().max())
    assert (
        card_of(tiny_models["repacked"]).parameter_count
        == card_of(tiny_models["dequantized"]).parameter_count
    )
    # float32 from the repacked groups (float32 scales and zeros on disk): the same model.
    torch.testing.assert_close(
        logits(tiny_models["repacked"], "float32"), reference, rtol=0, atol=1e-4 * scale
    )
    # int4 straight from the blocks stays close; requantizing the float weights does not
    # (Q4_0's symmetric grid is not the engine's min/max grid).
    direct = (logits(tiny_models["repacked"], "int4") - reference).abs().max()
    requantized = (logits(tiny_models["dequantized"], "int4") - reference).abs().max()
    assert direct < 0.02 * scale
    assert direct < requantized / 3


def test_repacked_linears_are_built_from_the_blocks(tiny_models: dict[str, Path]) -> None:
    card = card_of(tiny_models["repacked"])
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=1,
        world_size=2,
        start_layer=1,
        end_layer=2,
    )
    model = load_model(tiny_models["repacked"], shard, torch.device("cpu"), "int4")
    layers: Any = model.model.layers
    assert len(layers) == 1  # the pipeline rank loads only its layer
    attention: Any = layers[0].self_attn
    assert isinstance(attention.q_proj, Int4Linear)
    stored = load_file(str(tiny_models["repacked"] / "model.safetensors"))
    # The tied head (this rank has no embedding) holds the Q8_0 embedding's blocks exactly:
    # as symmetric int8 blocks where exo's kernels run, else as two int4 planes.
    native = native_int4_kernel() is not None
    assert isinstance(model.lm_head, ScaledInt8Linear if native else SplitInt4Linear)
    embedding = dequantize(
        stored["model.embed_tokens.weight.gguf_Q8_0"].numpy(), GGMLQuantizationType.Q8_0
    ).reshape(SHAPE.vocab_size, SHAPE.hidden_size)
    torch.testing.assert_close(
        model.lm_head.dequantize().float(),
        torch.from_numpy(embedding),
        rtol=2.0**-7,
        atol=1e-6,
    )
    name = "model.layers.1.self_attn.q_proj.weight"
    expected = torch.from_numpy(
        dequantize_int4(
            Int4Groups(
                stored[f"{name}.int4_packed"].numpy(),
                stored[f"{name}.int4_scales"].float().numpy(),
                stored[f"{name}.int4_zeros"].float().numpy(),
            )
        )
    )
    torch.testing.assert_close(
        attention.q_proj.dequantize().float(),
        expected,
        rtol=0,
        atol=0.01 * float(expected.abs().max()),
    )


def test_tensor_parallel_ranks_hold_their_slices(tiny_models: dict[str, Path]) -> None:
    directory = tiny_models["repacked"]
    whole = load_model(
        directory,
        ShardMetadata(
            sharding="tensor",
            model_card=card_of(directory),
            device_rank=0,
            world_size=1,
            start_layer=0,
            end_layer=card_of(directory).n_layers,
        ),
        torch.device("cpu"),
        "int4",
    )
    full = whole.model.layers[0]
    for rank in range(2):
        shard = ShardMetadata(
            sharding="tensor",
            model_card=card_of(directory),
            device_rank=rank,
            world_size=2,
            start_layer=0,
            end_layer=card_of(directory).n_layers,
        )
        model = load_model(directory, shard, torch.device("cpu"), "int4")
        layer = model.model.layers[0]
        # Column parallel: this rank's rows of the whole weight.
        rows = slice(rank * 64, (rank + 1) * 64)
        assert isinstance(layer.self_attn.q_proj, Int4Linear)
        assert torch.equal(
            layer.self_attn.q_proj.dequantize(), full.self_attn.q_proj.dequantize()[rows]
        )
        # Row parallel: its columns, wrapped to all-reduce.
        columns = slice(rank * 128, (rank + 1) * 128)
        local = layer.mlp.down_proj.local
        assert isinstance(local, Int4Linear)
        assert torch.equal(local.dequantize(), full.mlp.down_proj.dequantize()[:, columns])


def test_the_tensor_directory_matches_gguf_reader(tiny_models: dict[str, Path]) -> None:
    from gguf import GGUFReader

    from exo.download.gguf_tensors import GgufArray, read_gguf_tensors

    ours = read_gguf_tensors(tiny_models["gguf"])
    theirs = GGUFReader(str(tiny_models["gguf"]))
    assert ours.architecture == "llama"
    assert ours.metadata["llama.block_count"] == SHAPE.n_layers
    assert ours.metadata["tokenizer.ggml.tokens"] == GgufArray(SHAPE.vocab_size)
    assert [tensor.name for tensor in ours.tensors] == [tensor.name for tensor in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert mine.type_name == reference.tensor_type.name
        assert mine.shape == tuple(int(size) for size in reference.shape)
        assert np.array_equal(mine.data, np.asarray(reference.data).reshape(-1).view(np.uint8))
