"""FP8 block-quantized checkpoints (DeepSeek-V3's layout: float8_e4m3fn weights, float32
`weight_scale_inv` per block) load for any family: each weight widened per block as it is
read, then held like a float checkpoint's. Checked on a tiny Qwen3-MoE written as an FP8
checkpoint by `save_fp8_twins`: against its dequantized float twin (bit for bit, also
through int4 and a tensor / expert rank's slices, with blocks that do not divide the
weights), and against transformers' own FP8 loader, which dequantizes on CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from exo.shared.models.cards import card_from_local_directory
from exo.testing.tiny_models import save_fp8_twins, save_tiny_model
from exo.worker.engines.torch.model.families import UnsupportedArchitectureError
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.fp8_blocks import (
    Fp8BlockSlice,
    dequantize_fp8_blocks,
    quantize_fp8_blocks,
)
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import (
    FLOAT32_TOLERANCE,
    _prompt,
    engine_greedy,
    routing_margins,
)

CPU = torch.device("cpu")
# Blocks that divide no weight of the tiny model (64 x 64 attention, 128 x 64 MLP, 32 x 64
# experts): partial edge blocks, and tensor ranks' halves that start inside a block.
ODD_BLOCK = (24, 40)
# transformers' FP8 dequantization derives the block from the scale grid, so it needs
# blocks that divide the weights.
EVEN_BLOCK = (16, 16)
# E4M3 keeps 3 mantissa bits: a weight's rounding error is at most 1/16 of its magnitude.
E4M3_RELATIVE_ERROR = 0.05


@pytest.fixture(scope="module")
def float_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("fp8-float"), "qwen3_moe", real_model_dir, n_layers=2,
        tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
    )  # fmt: skip


def _twins(factory: pytest.TempPathFactory, float_dir: Path, block: tuple[int, int]) -> Any:
    name = "x".join(map(str, block))
    return save_fp8_twins(
        float_dir, factory.mktemp(f"fp8-{name}"), factory.mktemp(f"fp8-{name}-float"), block
    )


@pytest.fixture(scope="module")
def odd_twins(tmp_path_factory: pytest.TempPathFactory, float_dir: Path) -> tuple[Path, Path]:
    return _twins(tmp_path_factory, float_dir, ODD_BLOCK)


@pytest.fixture(scope="module")
def even_twins(tmp_path_factory: pytest.TempPathFactory, float_dir: Path) -> tuple[Path, Path]:
    return _twins(tmp_path_factory, float_dir, EVEN_BLOCK)


def _load(
    model_dir: Path,
    mode: str = "pipeline",
    rank: int = 0,
    world_size: int = 1,
    weight_dtype: Any = "float32",
) -> Any:
    shard = make_shard(model_dir, mode, rank, world_size)
    return load_model(model_dir, shard, CPU, weight_dtype)


def _float_state(model: Any) -> dict[str, torch.Tensor]:
    return {
        name: tensor for name, tensor in model.state_dict().items() if tensor.is_floating_point()
    }


def test_block_round_trip_with_partial_edge_blocks(tmp_path: Path) -> None:
    """A `[40, 70]` weight in 16 x 32 blocks: a `[3, 3]` scale grid, E4M3's rounding error,
    block-grid values exact, and every slice of the stored tensor read through
    `Fp8BlockSlice` equal to that slice of the whole weight dequantized."""
    weight = torch.randn(40, 70, generator=torch.Generator().manual_seed(0))
    stored, scale_inv = quantize_fp8_blocks(weight, (16, 32))
    assert stored.dtype == torch.float8_e4m3fn and scale_inv.shape == (3, 3)
    widened = dequantize_fp8_blocks(stored, scale_inv, (16, 32))
    error = float((widened - weight).norm() / weight.norm())
    assert 0 < error < E4M3_RELATIVE_ERROR
    # Values already on the grid come back exactly.
    assert torch.equal(
        dequantize_fp8_blocks(*quantize_fp8_blocks(widened, (16, 32)), (16, 32)), widened
    )
    # The scale of block (2, 1) multiplies rows 32..39 (partial), columns 32..63.
    assert torch.equal(widened[32:, 32:64], stored[32:, 32:64].float() * scale_inv[2, 1])
    save_file({"w": stored, "w_scale_inv": scale_inv}, str(tmp_path / "w.safetensors"))
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as handle:
        sliced = Fp8BlockSlice(
            "w", handle.get_slice("w"), handle.get_slice("w_scale_inv"), (16, 32)
        )
        assert sliced.get_shape() == [40, 70]
        for key in (
            slice(None),
            slice(5, 23),
            (slice(None), slice(33, 69)),
            (slice(17, 40), slice(0, 35)),
        ):
            assert torch.equal(sliced[key], widened[key])
        with pytest.raises(TypeError, match="slices"):
            sliced[3]
        with pytest.raises(ValueError, match=r"w_scale_inv has shape \[3, 3\]"):
            Fp8BlockSlice("w", handle.get_slice("w"), handle.get_slice("w_scale_inv"), (8, 32))


@pytest.mark.parametrize("weight_dtype", ["float32", "int4"])
def test_fp8_checkpoint_loads_as_its_dequantized_twin(
    odd_twins: tuple[Path, Path], weight_dtype: str
) -> None:
    """Blocks dividing no weight: the FP8 checkpoint's model holds the twin's weights bit
    for bit (float32), or the same int4 groups quantized from them, so the engine's logits
    over a prompt and greedy steps are equal."""
    fp8_dir, twin_dir = odd_twins
    ours, twin = (_load(d, weight_dtype=weight_dtype) for d in (fp8_dir, twin_dir))
    ours_state, twin_state = _float_state(ours), _float_state(twin)
    assert ours_state.keys() == twin_state.keys()
    assert all(torch.equal(ours_state[name], twin_state[name]) for name in ours_state)
    prompt = _prompt()
    ours_logits, ours_tokens = engine_greedy(ours, prompt)
    twin_logits, twin_tokens = engine_greedy(twin, prompt)
    assert ours_tokens == twin_tokens
    assert torch.equal(ours_logits, twin_logits)


@pytest.mark.parametrize(("mode", "rank"), [("tensor", 0), ("tensor", 1), ("expert", 1)])
def test_split_ranks_read_their_blocks(odd_twins: tuple[Path, Path], mode: str, rank: int) -> None:
    """A tensor rank's rows and columns (halves starting inside a block) and an expert
    rank's experts, read from the FP8 checkpoint, equal the same rank's from the twin."""
    fp8_dir, twin_dir = odd_twins
    ours, twin = (_float_state(_load(d, mode, rank, 2)) for d in (fp8_dir, twin_dir))
    assert ours.keys() == twin.keys()
    assert all(torch.equal(ours[name], twin[name]) for name in ours)
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    if mode == "tensor":
        assert ours[q_proj].shape[0] == 32  # half of 64 rows; blocks of 24 rows


def test_fp8_checkpoint_equals_transformers_dequantized(even_twins: tuple[Path, Path]) -> None:
    """The engine on the FP8 checkpoint gives the float32 logits of transformers' own FP8
    loader (`FineGrainedFP8Config`, which dequantizes pre-quantized checkpoints on a machine
    without a GPU) within the float32 tolerance, over a prompt and greedy steps, with no
    routing decision near a tie."""
    fp8_dir, twin_dir = even_twins
    reference = AutoModelForCausalLM.from_pretrained(
        fp8_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    # It dequantized to the twin's float32 weights (the same products of value and scale).
    twin = load_file(str(twin_dir / "model.safetensors"))
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(reference.state_dict()[q_proj], twin[q_proj])
    prompt = _prompt()
    ours, tokens = engine_greedy(_load(fp8_dir), prompt)
    with torch.no_grad():
        theirs = reference(input_ids=torch.tensor([prompt + tokens])).logits[0]
    difference = float((ours - theirs).abs().max())
    margin, _ = routing_margins(reference, prompt + tokens)
    print(f"max |engine - transformers| logit {difference:.3g}, routing margin {margin:.3g}")
    assert difference < FLOAT32_TOLERANCE
    assert margin > FLOAT32_TOLERANCE


def test_missing_scale_fails_naming_the_tensor(
    odd_twins: tuple[Path, Path], tmp_path: Path
) -> None:
    fp8_dir, _ = odd_twins
    for path in fp8_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    missing = "model.layers.1.mlp.down_proj.weight_scale_inv"
    del tensors[missing]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"model.layers.1.mlp.down_proj.weight has no {missing}"):
        _load(tmp_path)


@pytest.mark.parametrize(
    ("quantization", "field"),
    [
        (None, "no FP8 quantization_config"),
        ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size=None"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0"},
            "scale_fmt='ue8m0'",
        ),
    ],
)
def test_fp8_without_block_config_is_refused(
    odd_twins: tuple[Path, Path], tmp_path: Path, quantization: Any, field: str
) -> None:
    fp8_dir, _ = odd_twins
    for path in fp8_dir.iterdir():
        (tmp_path / path.name).write_bytes(path.read_bytes())
    config = json.loads((fp8_dir / "config.json").read_text())
    if quantization is None:
        del config["quantization_config"]
    else:
        config["quantization_config"] = quantization
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedArchitectureError, match=field):
        _load(tmp_path)


def test_card_counts_fp8_weights_and_their_bytes(odd_twins: tuple[Path, Path]) -> None:
    """A card built from the FP8 checkpoint: the twin's parameter count (scales hold no
    weights) and the FP8 files' bytes (one per FP8 weight, four per scale)."""
    fp8_dir, twin_dir = odd_twins
    fp8_card, twin_card = (card_from_local_directory(d) for d in (fp8_dir, twin_dir))
    assert fp8_card.parameter_count == twin_card.parameter_count
    stored = load_file(str(fp8_dir / "model.safetensors"))
    assert fp8_card.storage_size_bytes == sum(t.numel() * t.element_size() for t in stored.values())
    assert fp8_card.storage_size_bytes < twin_card.storage_size_bytes


@pytest.mark.parametrize(("mode", "rank"), [("pipeline", 1), ("expert", 1)])
def test_a_rank_downloads_the_scales_of_the_weights_it_reads(
    odd_twins: tuple[Path, Path], mode: str, rank: int
) -> None:
    """With every tensor in a file of its own, the files a rank fetches hold each FP8
    weight it reads with its scales, and no scales of weights it does not read."""
    from exo.download.shard_files import weight_files_for_shard

    fp8_dir, _ = odd_twins
    names = list(load_file(str(fp8_dir / "model.safetensors")))
    index = {"weight_map": {name: f"{name}.safetensors" for name in names}}
    files = [f"{name}.safetensors" for name in names]
    shard = make_shard(fp8_dir, mode, rank, 2)
    fetched = {
        file.removesuffix(".safetensors") for file in weight_files_for_shard(files, index, shard)
    }
    scales = {name for name in fetched if name.endswith("_scale_inv")}
    assert scales  # this rank reads FP8 weights
    assert scales == {f"{name}_scale_inv" for name in fetched if f"{name}_scale_inv" in names}
    assert len(fetched) < len(names)  # not everything


@pytest.mark.slow
def test_fp8_tensor_split_equals_single_process(odd_twins: tuple[Path, Path]) -> None:
    """Two tensor ranks on the FP8 checkpoint (blocks cut inside) give the single
    process's greedy and seeded tokens."""
    from exo.worker.engines.torch.tests.test_distributed import (
        GREEDY,
        SEEDED,
        Job,
        run_group,
        single_process_tokens,
    )

    fp8_dir, _ = odd_twins
    expected = single_process_tokens(fp8_dir, (GREEDY, SEEDED))
    results = run_group(2, [Job("tensor", str(fp8_dir), "tensor", (GREEDY, SEEDED))])
    assert results["tensor"].tokens == expected
