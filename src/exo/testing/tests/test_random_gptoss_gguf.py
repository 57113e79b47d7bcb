"""The random-block gpt-oss GGUF writer (`write_random_block_gptoss_gguf`, what
`bench/bench_moe.py` writes at gpt-oss-20b's shapes): llama.cpp's tensor layout and types,
MXFP4 experts whose blocks decode (by `gguf`'s own dequantizer) to E2M1 values at the fixed
scale, Q8_0 linears at their fixed `d`, and a card that holds its experts as MXFP4."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from exo.download.gguf_models import card_for_gguf
from exo.download.gguf_tensors import read_gguf_model
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.random_gptoss_gguf import (
    GPT_OSS_20B,
    RANDOM_MXFP4_SCALE_BYTE,
    RANDOM_Q8_0_D,
    GptOssGgufShape,
    write_random_block_gptoss_gguf,
)

SHAPE = GptOssGgufShape(n_layers=2)
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def test_random_block_gguf_has_llama_cpps_layout_and_fixed_scales(tmp_path: Path) -> None:
    path = write_random_block_gptoss_gguf(tmp_path / "blocks.gguf", SHAPE, seed=3)
    directory = read_gguf_model(path)
    assert directory.architecture == "gpt-oss"
    types = {tensor.name: tensor.type_name for tensor in directory.tensors}
    for layer in range(SHAPE.n_layers):
        for kind in ("gate", "up", "down"):
            assert types[f"blk.{layer}.ffn_{kind}_exps.weight"] == "MXFP4"
            assert types[f"blk.{layer}.ffn_{kind}_exps.bias"] == "F32"
        assert types[f"blk.{layer}.attn_q.weight"] == "Q8_0"
        assert types[f"blk.{layer}.attn_sinks.weight"] == "F32"
    assert types["token_embd.weight"] == types["output.weight"] == "Q8_0"
    tensors = {tensor.name: tensor for tensor in directory.tensors}
    experts = tensors["blk.1.ffn_down_exps.weight"]
    values = dequantize(experts.data, GGMLQuantizationType.MXFP4)
    scale = 2.0 ** (RANDOM_MXFP4_SCALE_BYTE - 127)
    assert set(np.unique(np.abs(values) / scale)) <= set(E2M1)
    assert len(np.unique(values)) > 8  # random codes, both signs
    query = dequantize(tensors["blk.0.attn_q.weight"].data, GGMLQuantizationType.Q8_0)
    steps = query / np.float32(np.float16(RANDOM_Q8_0_D))
    assert np.allclose(steps, np.round(steps), atol=1e-3) and np.abs(steps).max() <= 128
    # Another seed, other blocks; the same seed, the same file.
    again = write_random_block_gptoss_gguf(tmp_path / "again.gguf", SHAPE, seed=3)
    assert again.read_bytes() == path.read_bytes()
    other = write_random_block_gptoss_gguf(tmp_path / "other.gguf", SHAPE, seed=4)
    assert other.read_bytes() != path.read_bytes()


def test_random_block_gguf_card_holds_mxfp4_experts(tmp_path: Path) -> None:
    path = write_random_block_gptoss_gguf(tmp_path / "blocks.gguf", SHAPE)
    card = card_for_gguf(path, "random-gpt-oss")
    assert card.moe is not None and card.moe.mxfp4_experts
    assert (card.moe.experts, card.moe.experts_per_token) == (SHAPE.experts, 2)


def test_gpt_oss_20b_shape_is_the_catalog_cards() -> None:
    """`GPT_OSS_20B` states what the catalog card does (checked against the model's
    config.json by `test_cards_against_configs`)."""
    card = load_builtin_cards()[ModelId("openai/gpt-oss-20b")]
    assert card.moe is not None
    shape = GPT_OSS_20B
    assert (shape.hidden_size, shape.n_layers, shape.vocab_size) == (
        card.hidden_size, card.n_layers, card.vocab_size,
    )  # fmt: skip
    assert (shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (
        card.num_attention_heads, card.num_key_value_heads, card.head_dim,
    )  # fmt: skip
    assert (shape.experts, shape.experts_per_token, shape.intermediate_size) == (
        card.moe.experts, card.moe.experts_per_token, card.moe.expert_intermediate_size,
    )  # fmt: skip
    assert shape.context_length == card.context_length
