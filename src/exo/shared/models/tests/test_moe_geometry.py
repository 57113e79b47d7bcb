"""A mixture-of-experts model's card: its geometry read from `config.json`, every expert
counted in parameters and memory, a pipeline share sized by which of its layers are sparse,
an expert-parallel rank's share (its experts, the rest whole), and a card that misses or
misstates the experts reported at load (`card_mismatches`).

The config is Qwen3-30B-A3B's (facts of its public `config.json`, Qwen/Qwen3-30B-A3B):
its model card publishes 30.5B parameters, 29.9B without the embeddings, 3.3B activated.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from exo.shared.models.memory import (
    linear_weight_bytes,
    loading_peak_bytes,
    resident_weight_bytes,
    vocab_rows,
)
from exo.shared.models.moe import experts_of_rank, moe_geometry_of_config
from exo.shared.models.parameter_count import active_parameter_count, decoder_parameter_count
from exo.shared.models.profile import card_mismatches
from exo.shared.models.weight_formats import FLOAT32_BYTES
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism import parallelism
from exo.shared.types.common import ModelId
from exo.shared.types.models import HuggingFaceSource, ModelCard, MoeGeometry
from exo.shared.types.shards import ShardMetadata

QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
}


# The MoE fields of GLM-4.5-Air's and MiniMax-M2's `config.json` (zai-org/GLM-4.5-Air,
# MiniMaxAI/MiniMax-M2) over Qwen3-30B-A3B's other shapes.
GLM_4_5_AIR: dict[str, Any] = {
    **{key: value for key, value in QWEN3_30B_A3B.items() if key != "num_experts"},
    "architectures": ["Glm4MoeForCausalLM"],
    "n_routed_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1408,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "num_hidden_layers": 46,
}  # fmt: skip
MINIMAX_M2: dict[str, Any] = {
    **{key: value for key, value in QWEN3_30B_A3B.items() if "expert" not in key},
    "moe_intermediate_size": None,
    "architectures": ["MiniMaxM2ForCausalLM"],
    "num_local_experts": 256, "num_experts_per_tok": 8, "intermediate_size": 1536,
    "scoring_func": "sigmoid", "num_hidden_layers": 62,
}  # fmt: skip


def test_geometry_of_glm_and_minimax_configs() -> None:
    """GLM's routed and shared experts and first dense layer; MiniMax-M2's experts sized
    by `intermediate_size`, every layer sparse."""
    glm = moe_geometry_of_config(GLM_4_5_AIR)
    assert glm == MoeGeometry(
        experts=128, experts_per_token=8, expert_intermediate_size=1408, dense_layers=(0,),
        shared_expert_intermediate_size=1408,
    )  # fmt: skip
    two_shared = moe_geometry_of_config({**GLM_4_5_AIR, "n_shared_experts": 2})
    assert two_shared is not None and two_shared.shared_expert_intermediate_size == 2816
    assert moe_geometry_of_config(MINIMAX_M2) == MoeGeometry(
        experts=256, experts_per_token=8, expert_intermediate_size=1536
    )
    # The shared expert counts in every sparse layer's parameters and memory, read by
    # every token.
    assert glm is not None
    card = card_of(GLM_4_5_AIR, glm)
    no_shared = glm.model_copy(update={"shared_expert_intermediate_size": 0})
    alone = card.model_copy(update={"moe": no_shared})
    shared = 45 * 3 * 2048 * 1408
    assert decoder_parameter_count(card) - decoder_parameter_count(alone) == shared
    assert active_parameter_count(card) - active_parameter_count(alone) == shared
    linears = 2 * linear_weight_bytes(2048, 1408, "int4") + linear_weight_bytes(1408, 2048, "int4")
    assert (
        resident_weight_bytes(card, "int4") - resident_weight_bytes(alone, "int4") == 45 * linears
    )


def card_of(config: dict[str, Any], moe: MoeGeometry | None) -> ModelCard:
    return ModelCard(
        model_id=ModelId("Qwen/Qwen3-30B-A3B"),
        source=HuggingFaceSource(repo_id="Qwen/Qwen3-30B-A3B"),
        architecture=config["architectures"][0],
        n_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        num_attention_heads=config["num_attention_heads"],
        num_key_value_heads=config["num_key_value_heads"],
        intermediate_size=config["intermediate_size"],
        vocab_size=config["vocab_size"],
        storage_size_bytes=61_000_000_000,
        context_length=config["max_position_embeddings"],
        head_dim=config["head_dim"],
        tie_word_embeddings=config["tie_word_embeddings"],
        moe=moe,
    )


def test_geometry_of_the_qwen3_moe_config() -> None:
    geometry = moe_geometry_of_config(QWEN3_30B_A3B)
    assert geometry == MoeGeometry(experts=128, experts_per_token=8, expert_intermediate_size=768)
    assert geometry.sparse_layers(48) == 48
    card = card_of(QWEN3_30B_A3B, geometry)
    assert ModelCard.model_validate_json(card.model_dump_json()) == card
    assert moe_geometry_of_config({**QWEN3_30B_A3B, "num_experts": 0}) is None
    dense_config = {key: value for key, value in QWEN3_30B_A3B.items() if "expert" not in key}
    assert moe_geometry_of_config(dense_config) is None


def test_mxfp4_experts_are_read_from_the_quantization_config() -> None:
    """gpt-oss's checkpoints say `quantization_config.quant_method: mxfp4` (its public
    config.json); a card that misstates it is reported (its memory would be off by 18%)."""
    mxfp4 = {**QWEN3_30B_A3B, "quantization_config": {"quant_method": "mxfp4"}}
    geometry = moe_geometry_of_config(mxfp4)
    assert geometry is not None and geometry.mxfp4_experts
    assert not moe_geometry_of_config(QWEN3_30B_A3B).mxfp4_experts  # type: ignore[union-attr]
    fp8 = {**QWEN3_30B_A3B, "quantization_config": {"quant_method": "fp8"}}
    assert not moe_geometry_of_config(fp8).mxfp4_experts  # type: ignore[union-attr]
    stated = geometry.model_copy(update={"mxfp4_experts": False})
    assert card_mismatches(card_of(mxfp4, stated), mxfp4) == (
        "moe.mxfp4_experts: card False, config.json True",
    )


def test_dense_layers_follow_mlp_only_layers_and_the_sparse_step() -> None:
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 6, "decoder_sparse_step": 2}
    assert moe_geometry_of_config({**config, "mlp_only_layers": [1]}).dense_layers == (0, 1, 2, 4)  # type: ignore[union-attr]
    step_one = {**config, "decoder_sparse_step": 1, "mlp_only_layers": [3]}
    assert moe_geometry_of_config(step_one).dense_layers == (3,)  # type: ignore[union-attr]
    deepseek_like = {**step_one, "mlp_only_layers": [], "first_k_dense_replace": 2}
    assert moe_geometry_of_config(deepseek_like).dense_layers == (0, 1)  # type: ignore[union-attr]


def test_a_config_routing_more_experts_than_it_has_is_refused() -> None:
    with pytest.raises(
        ValueError, match="num_experts_per_tok=8 must be between 1 and num_experts=4"
    ):
        moe_geometry_of_config({**QWEN3_30B_A3B, "num_experts": 4})
    with pytest.raises(ValueError, match="n_routed_experts=4"):
        moe_geometry_of_config({**GLM_4_5_AIR, "n_routed_experts": 4})
    # A Qwen3-MoE config as transformers 5 saves it (`num_local_experts`, the alias its
    # config class maps to `num_experts`): the refusal names Qwen3's own field.
    saved = {key: value for key, value in QWEN3_30B_A3B.items() if key != "num_experts"}
    with pytest.raises(
        ValueError,
        match=r"between 1 and num_experts=4 \(num_local_experts in this config\)$",
    ):
        moe_geometry_of_config({**saved, "num_local_experts": 4})
    with pytest.raises(ValueError, match=r"between 1 and num_local_experts=4$"):
        moe_geometry_of_config({**MINIMAX_M2, "num_local_experts": 4})
    with pytest.raises(ValueError, match="scoring_func='relu'"):
        moe_geometry_of_config({**MINIMAX_M2, "scoring_func": "relu"})
    without = {key: value for key, value in QWEN3_30B_A3B.items() if key != "num_experts_per_tok"}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        moe_geometry_of_config(without)


def test_parameters_count_every_expert_and_active_ones_the_routed() -> None:
    card = card_of(QWEN3_30B_A3B, moe_geometry_of_config(QWEN3_30B_A3B))
    total = decoder_parameter_count(card)
    embeddings = 2 * 151936 * 2048  # input embedding and untied LM head
    assert abs(total / 30.5e9 - 1) < 0.01
    assert abs((total - embeddings) / 29.9e9 - 1) < 0.01
    assert abs(active_parameter_count(card) / 3.3e9 - 1) < 0.03
    # Without its geometry the card sized a dense MLP of intermediate_size: 1/16 of it.
    assert decoder_parameter_count(card.model_copy(update={"moe": None})) < total / 5


def test_memory_counts_every_expert_in_int4() -> None:
    card = card_of(QWEN3_30B_A3B, moe_geometry_of_config(QWEN3_30B_A3B))
    hidden, query, key_value = 2048, 32 * 128, 4 * 128
    attention = sum(
        linear_weight_bytes(i, o, "int4")
        for i, o in ((hidden, query), (hidden, key_value), (hidden, key_value), (query, hidden))
    )
    experts = 128 * (
        2 * linear_weight_bytes(hidden, 768, "int4") + linear_weight_bytes(768, hidden, "int4")
    )
    router = 128 * hidden * FLOAT32_BYTES
    norms = (2 * hidden + 2 * 128) * FLOAT32_BYTES
    layer = attention + experts + router + norms
    embedding = 151936 * hidden * FLOAT32_BYTES
    head = hidden * FLOAT32_BYTES + linear_weight_bytes(hidden, 151936, "int8")
    assert resident_weight_bytes(card, "int4") == 48 * layer + embedding + head
    assert 17e9 < resident_weight_bytes(card, "int4") < 22e9  # ~0.625 bytes per weight
    # Loading quantizes each expert as soon as it is read: one expert in float32 at a time,
    # beside the layer's attention, never the layer's 128 (1.2 GB).
    layers_only = WeightShare(layers=48, holds_output_layer=False)  # no float32 LM head read
    peak = loading_peak_bytes(card, "int4", layers_only)
    transient = peak - resident_weight_bytes(card, "int4", layers_only)
    expert = 3 * hidden * 768 * FLOAT32_BYTES
    assert expert < transient < 128 * expert / 10
    # A tensor rank holds half of every expert, the router whole.
    half = resident_weight_bytes(card, "int4", WeightShare(layers=48, tensor_parallel_ranks=2))
    assert 0.45 < half / resident_weight_bytes(card, "int4") < 0.55


def test_a_pipeline_share_is_sized_by_its_sparse_layers() -> None:
    config = {**QWEN3_30B_A3B, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]}
    card = card_of(config, moe_geometry_of_config(config))
    dense_first = WeightShare(layers=2, holds_output_layer=False, first_layer=0)
    sparse_last = WeightShare(layers=2, holds_embedding=False, first_layer=2)
    unknown = WeightShare(layers=2, holds_embedding=False)
    whole = resident_weight_bytes(card, "int4")
    first = resident_weight_bytes(card, "int4", dense_first)
    last = resident_weight_bytes(card, "int4", sparse_last)
    assert first + last == whole  # the split parts add up to the whole (embedding once)
    layers_only = {"holds_embedding": False, "holds_output_layer": False}
    dense_layers = resident_weight_bytes(card, "int4", WeightShare(2, first_layer=0, **layers_only))
    sparse_layers = resident_weight_bytes(
        card, "int4", WeightShare(2, first_layer=2, **layers_only)
    )
    assert 5 * dense_layers < sparse_layers  # 128 experts of 768 against one MLP of 6144
    # Where the layers are not known, a share is sized as the sparse ones (an upper bound).
    assert resident_weight_bytes(card, "int4", unknown) == last


def test_a_card_missing_or_misstating_the_experts_is_reported() -> None:
    geometry = moe_geometry_of_config(QWEN3_30B_A3B)
    assert geometry is not None
    assert card_mismatches(card_of(QWEN3_30B_A3B, geometry), QWEN3_30B_A3B) == ()
    assert card_mismatches(card_of(QWEN3_30B_A3B, None), QWEN3_30B_A3B) == (
        "moe: card dense, config.json 128 experts, 8 per token",
    )
    fewer = geometry.model_copy(update={"experts": 64, "dense_layers": (0,)})
    assert card_mismatches(card_of(QWEN3_30B_A3B, fewer), QWEN3_30B_A3B) == (
        "moe.experts: card 64, config.json 128",
        "moe.dense_layers: card (0,), config.json ()",
    )
    dense = {key: value for key, value in QWEN3_30B_A3B.items() if "expert" not in key}
    assert card_mismatches(card_of(QWEN3_30B_A3B, geometry), dense) == (
        "moe: card 128 experts, 8 per token, config.json dense",
    )


def test_experts_are_divided_in_contiguous_runs_uneven_allowed() -> None:
    assert [list(experts_of_rank(4, rank, 3)) for rank in range(3)] == [[0], [1], [2, 3]]
    assert [len(experts_of_rank(128, rank, 3)) for rank in range(3)] == [42, 43, 43]
    with pytest.raises(ValueError, match="4 experts cannot be split over 5 ranks"):
        experts_of_rank(4, 0, 5)


def test_an_expert_rank_holds_and_reads_its_experts_only() -> None:
    card = card_of(QWEN3_30B_A3B, moe_geometry_of_config(QWEN3_30B_A3B))
    expert = parallelism("expert")
    assert expert.split_error(card, 3) is None
    assert "not a mixture-of-experts" in (
        expert.split_error(card.model_copy(update={"moe": None}), 2) or ""
    )
    assert "128 experts per layer" in (expert.split_error(card, 200) or "")
    shares = [expert.weight_share(card, rank, 3, (0, 48)) for rank in range(3)]
    assert [share.experts for share in shares] == [42, 43, 43]
    assert all(share.holds_embedding and share.holds_output_layer for share in shares)
    rows = [share.output_layer_rows for share in shares]
    assert rows == [vocab_rows(card.vocab_size, rank, 3) for rank in range(3)]
    assert sum(row or 0 for row in rows) == card.vocab_size

    def size(share: WeightShare, **changes: Any) -> int:
        return resident_weight_bytes(card, "int4", dataclasses.replace(share, **changes))

    whole = WeightShare(layers=48)
    held = [size(share) for share in shares]
    # The experts are divided: each counted once over the ranks.
    experts = [size(share) - size(share, experts=0) for share in shares]
    assert sum(experts) == size(whole) - size(whole, experts=0)
    # The LM head's rows are divided (the final norm on every rank), as on tensor ranks;
    # the last rank holds what is left of the vocabulary.
    heads = [size(s, experts=0) - size(s, experts=0, holds_output_layer=False) for s in shares]
    norm = card.hidden_size * FLOAT32_BYTES
    whole_head = size(whole, experts=0) - size(whole, experts=0, holds_output_layer=False)
    assert sum(head - norm for head in heads) == whole_head - norm
    assert heads[0] == heads[1] > heads[2]
    # Attention, router and embedding are on every rank whole.
    replicated = size(shares[0], experts=0, holds_output_layer=False)
    assert all(size(s, experts=0, holds_output_layer=False) == replicated for s in shares)
    assert held[0] < held[1] and held[2] < held[1] < size(whole) / 2
    shard = ShardMetadata(
        model_card=card, sharding="expert", device_rank=1, world_size=2, start_layer=0,
        end_layer=48,
    )  # fmt: skip
    assert expert.reads_tensor("model.layers.3.mlp.experts.70.down_proj.weight", shard)
    assert not expert.reads_tensor("model.layers.3.mlp.experts.7.down_proj.weight", shard)
    assert expert.reads_tensor("model.layers.3.self_attn.q_proj.weight", shard)
    assert expert.reads_tensor("lm_head.weight", shard)


def test_an_expert_shard_of_a_dense_model_is_refused() -> None:
    card = card_of(QWEN3_30B_A3B, None)
    with pytest.raises(ValueError, match="not a mixture-of-experts model"):
        ShardMetadata(
            model_card=card, sharding="expert", device_rank=0, world_size=2, start_layer=0,
            end_layer=48,
        )  # fmt: skip
