"""The speed model for mixture-of-experts layers: the experts a decode step's rows read,
the bytes a MoE layer decodes at, prefill's top-k and shared experts, and MXFP4 experts'
size."""

from __future__ import annotations

import pytest

from exo.master.speed_prediction import (
    ENGINE_KV_READ_FACTOR,
    ENGINE_LAYER_OVERHEAD_FACTOR,
    decode_stage_seconds,
)
from exo.master.tests.speed_builders import CARD, GB, speed
from exo.shared.models.decode_reads import (
    active_linear_params_per_layer,
    decode_read_bytes,
    expected_experts_read,
    moe_layer_read_bytes,
)
from exo.shared.models.kv_cache_memory import kv_cache_bytes_per_token
from exo.shared.models.memory import decoder_layer_bytes, decoder_layers_bytes, output_layer_bytes
from exo.shared.models.weight_formats import WeightFormat
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.models import GgufWeightTypes, ModelCard, MoeGeometry

# A MoE card: 12 layers, layer 0 dense, the others 16 experts of width 128, top 2, and a
# shared expert of width 128 (every width divides by 2 and fits int4).
MOE_CARD = CARD.model_copy(
    update={
        "moe": MoeGeometry(
            experts=16,
            experts_per_token=2,
            expert_intermediate_size=128,
            dense_layers=(0,),
            shared_expert_intermediate_size=128,
        )
    }
)


def test_expected_experts_read_is_the_union_of_the_rows_choices() -> None:
    moe = MOE_CARD.moe
    assert moe is not None
    assert expected_experts_read(moe, 16) == pytest.approx(2.0)  # one row: its top 2
    assert expected_experts_read(moe, 8) == pytest.approx(1.0)  # an expert rank's half
    assert expected_experts_read(moe, 16, streams=4) == pytest.approx(16 * (1 - (7 / 8) ** 4))
    assert 15.9 < expected_experts_read(moe, 16, streams=64) <= 16  # nearly every expert
    with pytest.raises(ValueError, match="streams"):
        expected_experts_read(moe, 16, streams=0)


def test_a_moe_layer_decodes_at_the_bytes_of_the_experts_a_token_reads() -> None:
    share = WeightShare(layers=12, first_layer=0)
    seconds = decode_stage_seconds(MOE_CARD, speed(), share, 512)
    dense = decoder_layer_bytes(MOE_CARD, "int4")
    held = decoder_layer_bytes(MOE_CARD, "int4", sparse=True)
    without = decoder_layer_bytes(MOE_CARD, "int4", sparse=True, experts=0)
    read = without + 2 * (held - without) / 16  # top 2 of 16 experts
    assert moe_layer_read_bytes(MOE_CARD, "int4") == pytest.approx(read)
    kv = ENGINE_KV_READ_FACTOR * 2 * 512 * kv_cache_bytes_per_token(MOE_CARD) / (20 * GB)
    norm = MOE_CARD.hidden_size * 4
    head = (output_layer_bytes(MOE_CARD, "int4", shares_embedding=False) - norm) / (8 * GB)
    overhead = 12 * 100e-6 * ENGINE_LAYER_OVERHEAD_FACTOR
    expected = (dense + 11 * read) / (10 * GB) + kv + head + overhead
    assert seconds == pytest.approx(expected, rel=1e-9)
    # Memory counts every expert; the step reads an eighth of the routed ones.
    assert decode_read_bytes(MOE_CARD, "int4", share) < 0.5 * decoder_layers_bytes(
        MOE_CARD, "int4", share
    )
    # An expert-parallel rank holding half the experts reads half as many routed ones.
    half = moe_layer_read_bytes(MOE_CARD, "int4", experts=8)
    assert half == pytest.approx(without + (held - without) / 16)


def test_moe_prefill_counts_a_tokens_top_k_and_shared_experts() -> None:
    hidden, head = MOE_CARD.hidden_size, MOE_CARD.attention_head_dim
    attention = hidden * (2 * 8 * head + 2 * 4 * head)  # 8 query and 4 KV heads
    assert active_linear_params_per_layer(MOE_CARD, sparse=True) == attention + 3 * hidden * (
        2 * 128 + 128
    )
    assert active_linear_params_per_layer(MOE_CARD, sparse=False) == attention + 3 * hidden * (
        MOE_CARD.intermediate_size
    )


def test_mxfp4_experts_are_sized_and_read_at_17_bytes_per_32_weights() -> None:
    """The engine holds MXFP4 experts (gpt-oss) as stored, 17 bytes per 32 weights, in every
    weight format, not as its int4 groups (20 per 32): memory and the bytes a decode step
    reads count them so, for a card whose geometry says so and for a GGUF storing MXFP4
    (whose other types are then averaged without it), and the rest of the layer as before."""
    assert MOE_CARD.moe is not None
    mxfp4 = MOE_CARD.model_copy(
        update={"moe": MOE_CARD.moe.model_copy(update={"mxfp4_experts": True})}
    )
    expert = 3 * MOE_CARD.hidden_size * 128  # one expert's gate, up and down weights
    int4, stored = expert * 0.625, expert * 17 / 32

    def experts_bytes(card: ModelCard, weight_format: WeightFormat = "int4") -> float:
        whole = decoder_layer_bytes(card, weight_format, sparse=True)
        return whole - decoder_layer_bytes(card, weight_format, sparse=True, experts=0)

    assert experts_bytes(MOE_CARD) == pytest.approx(16 * int4)
    assert experts_bytes(mxfp4) == pytest.approx(16 * stored, abs=1)
    assert experts_bytes(mxfp4, "float32") == pytest.approx(16 * stored, abs=1)
    without = decoder_layer_bytes(mxfp4, "int4", sparse=True, experts=0)
    assert without == decoder_layer_bytes(MOE_CARD, "int4", sparse=True, experts=0)
    assert moe_layer_read_bytes(mxfp4, "int4") == pytest.approx(without + 2 * stored, abs=1)
    share = WeightShare(layers=12, first_layer=0)
    saved = decode_stage_seconds(MOE_CARD, speed(), share, 512) - decode_stage_seconds(
        mxfp4, speed(), share, 512
    )
    assert saved == pytest.approx(11 * 2 * (int4 - stored) / (10 * GB), rel=1e-6)
    # A GGUF with Q8_0 attention and shared expert and MXFP4 experts (its geometry silent):
    # the experts at 17 / 32, the Q8_0 weights at two int4 planes' 1.25, not all at an average.
    hidden, head = MOE_CARD.hidden_size, MOE_CARD.attention_head_dim
    other = hidden * (2 * 8 * head + 2 * 4 * head) + 3 * hidden * 128  # attention, shared
    gguf = MOE_CARD.model_copy(
        update={
            "gguf_weight_types": GgufWeightTypes(
                layer_weights=(("Q8_0", 12 * other), ("MXFP4", 11 * 16 * expert)),
                output_type="Q8_0",
            )
        }
    )
    assert experts_bytes(gguf) == pytest.approx(16 * stored, abs=1)
    assert decoder_layer_bytes(gguf, "int4", sparse=True, experts=0) - decoder_layer_bytes(
        MOE_CARD, "int4", sparse=True, experts=0
    ) == pytest.approx(other * (1.25 - 0.625), abs=1)
