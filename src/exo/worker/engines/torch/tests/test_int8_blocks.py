"""GGUF Q8_0 / Q6_K blocks as symmetric int8 blocks: the integers and scales against `gguf`'s
own dequantizer, the decode kernel and the integer GEMM against the held weight, fusion,
a vocabulary split, and a tiny Q8_0 GGUF loaded through them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from exo.download.gguf_repack import convert_gguf
from exo.shared.types.shards import ShardMetadata
from exo.testing.random_gguf import RandomGgufShape, write_random_gguf
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.fusion import fuse_linears
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.int4_planes import SplitInt4Linear
from exo.worker.engines.torch.quant.int5_blocks import Int5Linear
from exo.worker.engines.torch.quant.int8_blocks import (
    ScaledBlockPart,
    ScaledInt8Linear,
    scaled_block_values,
)
from exo.worker.engines.torch.quant.native_kernels import (
    NATIVE_INT4_ENV,
    ROUNDS_ACTIVATIONS,
    built_int8_scaled_kernel,
    native_int4_kernel,
    rounded_activations,
)
from exo.worker.engines.torch.tests import lean_steps

pytestmark = pytest.mark.skipif(
    built_int8_scaled_kernel() is None, reason="exo's native kernels cannot be built here"
)

ROWS, COLUMNS = 96, 512
BF16_RELATIVE = 2.0**-8  # bfloat16 rounding moves a scale by at most 2^-9 of itself


def raw_blocks(type_name: str, seed: int = 0) -> np.ndarray:
    """Raw GGUF blocks `[ROWS, bytes]`: Q8_0 quantized by `gguf` from Gaussian weights with
    outliers; Q6_K random bytes with a finite fp16 `d` (`gguf` cannot write Q6_K)."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[type_name]
    if type_name == "Q8_0":
        weights = rng.standard_normal((ROWS, COLUMNS)).astype(np.float32) * 0.02
        weights[rng.random(weights.shape) < 0.002] *= 10.0
        return quantize(weights, qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (ROWS, COLUMNS // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16)
    raw[..., 208:210] = d[..., None].view(np.uint8)
    return raw.reshape(ROWS, -1)


def gguf_weight(raw: np.ndarray, type_name: str) -> torch.Tensor:
    flat = dequantize(raw, GGMLQuantizationType[type_name])
    return torch.from_numpy(flat.reshape(raw.shape[0], -1))


@pytest.mark.parametrize(("type_name", "block_size"), [("Q8_0", 32), ("Q6_K", 16)])
def test_held_blocks_are_gguf_values_up_to_the_bfloat16_scales(
    type_name: str, block_size: int
) -> None:
    raw = raw_blocks(type_name)
    values, scales = scaled_block_values(raw, type_name)
    assert values.shape == (ROWS, COLUMNS) and scales.shape == (ROWS, COLUMNS // block_size)
    expected = gguf_weight(raw, type_name)
    # float32 scales: the same numbers as gguf's.
    exact = torch.from_numpy(values).float() * torch.from_numpy(scales).repeat_interleave(
        block_size, dim=1
    )
    torch.testing.assert_close(exact, expected, rtol=1e-6, atol=0)
    linear = ScaledInt8Linear(torch.from_numpy(values), torch.from_numpy(scales), None, block_size)
    assert linear.values.dtype == torch.int8 and linear.block_scales.dtype == torch.bfloat16
    held = linear.dequantize_float()
    bound = expected.abs() * BF16_RELATIVE + 1e-9
    assert bool(((held - expected).abs() <= bound).all())
    assert int(values.min()) < 0 < int(values.max())

    # A column slice of whole blocks reads the same values (a tensor-parallel rank's part).
    class Slice:
        def get_shape(self) -> list[int]:
            return list(raw.shape)

        def __getitem__(self, key: object) -> torch.Tensor:
            return torch.from_numpy(raw)[key]  # type: ignore[index]

    part = ScaledBlockPart(Slice(), type_name, "values")
    assert part.get_shape() == [ROWS, COLUMNS]
    assert torch.equal(part[8:24, 64:128], torch.from_numpy(values)[8:24, 64:128])
    scale_part = ScaledBlockPart(Slice(), type_name, "scales")
    assert scale_part.get_shape() == [ROWS, COLUMNS // block_size]


def test_q6_k_values_are_integers_in_range_and_other_types_are_refused() -> None:
    values, _ = scaled_block_values(raw_blocks("Q6_K", seed=4), "Q6_K")
    assert int(values.min()) >= -32 and int(values.max()) <= 31
    with pytest.raises(ValueError, match="Q5_0"):
        scaled_block_values(raw_blocks("Q8_0"), "Q5_0")
    with pytest.raises(ValueError, match="whole blocks"):
        scaled_block_values(raw_blocks("Q8_0")[:, :-1], "Q8_0")


def random_linear(block_size: int, out: int = 80, seed: int = 0, bias: bool = False) -> Any:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(-128, 128, (out, COLUMNS), generator=generator)
    scales = torch.rand(out, COLUMNS // block_size, generator=generator) * 1e-3 + 1e-4
    offsets = torch.randn(out, generator=generator) if bias else None
    return ScaledInt8Linear(values, scales, offsets, block_size)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 33])
def test_the_kernels_compute_the_held_weight_times_the_rounded_rows(
    block_size: int, rows: int
) -> None:
    """Up to 7 rows the decode kernel, from 8 the integer GEMM: both the held weight times
    the activations as the AVX2 kernels round them (int16 per block of 32), with the bias."""
    linear = random_linear(block_size, bias=True)
    x = torch.randn(rows, COLUMNS, generator=torch.Generator().manual_seed(rows))
    activations = rounded_activations(x) if ROUNDS_ACTIVATIONS else x
    expected = activations.double() @ linear.dequantize_float().double().t() + linear.bias
    out = linear(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 80)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5 * expected.abs().max())


def test_fused_projections_equal_their_parts_and_mixed_blocks_do_not_fuse() -> None:
    parts = [random_linear(32, out, seed) for out, seed in ((64, 1), (32, 2), (32, 3))]
    x = torch.randn(2, COLUMNS, generator=torch.Generator().manual_seed(9))
    separately = torch.cat([part(x) for part in parts], dim=-1)
    fused = fuse_linears(parts)
    assert isinstance(fused, ScaledInt8Linear) and fused.out_features == 128
    torch.testing.assert_close(fused(x), separately, rtol=0, atol=1e-6)
    # The parts now view the fused weight's rows (held once) and still compute their own.
    assert parts[1].values.data_ptr() == fused.values[64:].data_ptr()
    torch.testing.assert_close(parts[1](x), separately[:, 64:96], rtol=0, atol=1e-6)
    assert fuse_linears([random_linear(32), random_linear(16)]) is None


def test_a_vocabulary_share_keeps_its_rows() -> None:
    head = random_linear(32, out=192, bias=True)
    kept = head.rows(slice(64, 128), head.bias[64:128].clone())
    x = torch.randn(3, COLUMNS, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(kept(x), head(x)[:, 64:128], rtol=0, atol=1e-6)


def test_bad_shapes_and_values_are_refused() -> None:
    values = torch.zeros(64, COLUMNS, dtype=torch.int32)
    with pytest.raises(ValueError, match="16 or 32"):
        ScaledInt8Linear(values, torch.ones(64, COLUMNS // 64), None, 64)
    with pytest.raises(ValueError, match="do not fit"):
        ScaledInt8Linear(values, torch.ones(64, COLUMNS // 16), None, 32)
    with pytest.raises(ValueError, match="-128, 127"):
        ScaledInt8Linear(values + 200, torch.ones(64, COLUMNS // 32), None, 32)


SHAPE = RandomGgufShape(
    architecture="llama", hidden_size=256, n_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=320,
)  # fmt: skip


def _load_both(directory: Path) -> tuple[Any, Any]:
    from exo.shared.models.cards import card_from_local_directory

    card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    held = load_model(directory, shard, torch.device("cpu"), "int4")
    reference = load_model(directory, shard, torch.device("cpu"), "float32")
    return held, reference


def test_a_q4_k_m_like_gguf_holds_each_type_in_its_own_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Q5_0 linears, Q8_0 value and Q6_K down projections, a tied Q8_0 head (as Gemma 3's
    Q4_K_M): where exo's kernels run the downs are int8 blocks of 16, the head int8 blocks
    of 32, the Q5_0 MLP 5-bit blocks,
    every decoder layer still runs in exo's one-call decode layer, and the logits equal a
    float32 model of gguf's dequantized weights up to the bfloat16 scales and the
    activations' int16 rounding."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    assert native_int4_kernel() is not None
    gguf_path = write_random_gguf(
        tmp_path / "mixed.gguf",
        SHAPE,
        tensor_type="Q5_0",
        seed=11,
        types={"ffn_down": "Q6_K", "attn_v": "Q8_0"},
    )
    directory = tmp_path / "converted"
    directory.mkdir()
    convert_gguf(gguf_path, directory)
    held, reference_model = _load_both(directory)
    for layer in held.model.layers:
        assert isinstance(layer.mlp.down_proj, ScaledInt8Linear)
        assert layer.mlp.down_proj.block_size == 16
        # Q5_0 gate / up stay 5-bit blocks, fused; Q5_0 q / k beside a Q8_0 v were
        # widened to int8 blocks so that the three fuse.
        assert isinstance(layer.mlp.up_proj, Int5Linear) and not layer.mlp.up_proj.widened
        assert isinstance(layer.self_attn.q_proj, Int5Linear) and layer.self_attn.q_proj.widened
        assert type(layer.self_attn.v_proj) is SplitInt4Linear
    assert isinstance(held.lm_head, ScaledInt8Linear) and held.lm_head.block_size == 32
    lean = lean_step_of(held)
    assert isinstance(lean, LeanModel) and lean._decode_layer is not None
    tokens = lean_steps.forced_tokens(300)
    logits = lean_steps.run_single(held, tokens, lean=True)
    reference = lean_steps.run_single(reference_model, tokens, lean=False)
    scale = float(reference.abs().max())
    assert (logits - reference).abs().max().item() < 0.02 * scale
    assert torch.equal(logits.argmax(-1), reference.argmax(-1))


def test_q8_0_layers_stay_fusable_int8_blocks_beside_a_scaled_head(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Q8_0 GGUF's linears keep the (scale, zero) int8 blocks that fuse with Q5_0 ones
    (`int4_planes`); only its head becomes symmetric blocks."""
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    gguf_path = write_random_gguf(tmp_path / "q8.gguf", SHAPE, tensor_type="Q8_0", seed=3)
    directory = tmp_path / "converted"
    directory.mkdir()
    convert_gguf(gguf_path, directory)
    held, reference_model = _load_both(directory)
    assert isinstance(held.model.layers[0].self_attn.v_proj, SplitInt4Linear)
    assert isinstance(held.lm_head, ScaledInt8Linear)
    tokens = torch.tensor([[5, 17, 99, 200, 3, 44, 8, 250]])
    with torch.no_grad():
        logits = held(tokens).logits.float()
        reference = reference_model(tokens).logits.float()
    assert (logits - reference).abs().max().item() < 0.02 * float(reference.abs().max())
