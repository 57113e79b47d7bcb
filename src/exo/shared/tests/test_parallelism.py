"""The parallelism descriptions: one per `Sharding` value, and the rules each states."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from exo.shared.models.kv_cache_memory import kv_cache_bytes_per_token
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism import PARALLELISMS, parallelism
from exo.shared.types.common import NodeId
from exo.shared.types.instances import Instance
from exo.shared.types.shards import Sharding, ShardMetadata
from exo.testing.builders import make_instance, make_shard, smollm2_card

CARD = smollm2_card()
LAYERS = CARD.n_layers


def test_every_sharding_value_has_one_description() -> None:
    assert set(PARALLELISMS) == set(get_args(Sharding))
    assert all(kind.sharding == sharding for sharding, kind in PARALLELISMS.items())


def test_a_pipeline_rank_holds_its_layers_the_first_the_embedding_the_last_the_head() -> None:
    pipeline = parallelism("pipeline")
    ranges = pipeline.layer_ranges(LAYERS, 3, lambda: [10, 10, LAYERS - 20])
    assert ranges == ((0, 10), (10, 20), (20, LAYERS))
    shares = [pipeline.weight_share(CARD, rank, 3, ranges[rank]) for rank in range(3)]
    assert shares == [
        WeightShare(layers=10, holds_embedding=True, holds_output_layer=False),
        WeightShare(
            layers=10, holds_embedding=False, holds_output_layer=False, holds_vision_tower=False
        ),
        WeightShare(
            layers=LAYERS - 20,
            holds_embedding=False,
            holds_output_layer=True,
            holds_vision_tower=False,
        ),
    ]
    middle = make_shard(CARD, "pipeline", 1, 3)
    assert not pipeline.reads_tensor("model.embed_tokens.weight", middle)
    assert not pipeline.reads_tensor("lm_head.weight", middle)
    assert pipeline.kv_heads_per_rank(CARD.num_key_value_heads, 3) == CARD.num_key_value_heads


def test_a_tensor_rank_holds_every_layer_a_slice_of_each_and_the_whole_model_parts() -> None:
    tensor = parallelism("tensor")
    ranges = tensor.layer_ranges(LAYERS, 3, lambda: pytest.fail("tensor splits no layers"))
    assert ranges == ((0, LAYERS),) * 3
    share = tensor.weight_share(CARD, 1, 3, ranges[1])
    # Every rank holds the embedding; only rank 0 runs a vision card's tower.
    assert share == WeightShare(layers=LAYERS, tensor_parallel_ranks=3, holds_vision_tower=False)
    assert tensor.weight_share(CARD, 0, 3, ranges[0]).holds_vision_tower
    middle = make_shard(CARD, "tensor", 1, 3)
    assert tensor.reads_tensor("model.embed_tokens.weight", middle)
    assert tensor.reads_tensor("lm_head.weight", middle)
    assert tensor.reads_tensor(f"model.layers.{LAYERS - 1}.mlp.up_proj.weight", middle)
    assert tensor.kv_heads_per_rank(CARD.num_key_value_heads, 3) == CARD.num_key_value_heads // 3
    assert WeightShare(layers=1, tensor_parallel_ranks=3).kv_heads(CARD) == 1
    half = kv_cache_bytes_per_token(CARD, tensor.weight_share(CARD, 0, 3, ranges[0]))
    assert half * 3 == kv_cache_bytes_per_token(CARD)


def test_one_rank_of_either_kind_holds_the_whole_model() -> None:
    for sharding in get_args(Sharding):
        kind = parallelism(sharding)
        whole = kind.weight_share(CARD, 0, 1, (0, LAYERS))
        assert whole == WeightShare(layers=LAYERS)
        # Every kind runs a model on one node, except a dense one by experts (refused).
        dense_by_experts = sharding == "expert" and CARD.moe is None
        assert (kind.split_error(CARD, 1) is None) != dense_by_experts


def test_a_tensor_shard_with_a_partial_layer_range_is_refused() -> None:
    with pytest.raises(ValidationError, match="holds every layer"):
        ShardMetadata(
            model_card=CARD, sharding="tensor", device_rank=0, world_size=2, start_layer=0,
            end_layer=LAYERS - 1,
        )  # fmt: skip


def test_an_instance_holds_shards_of_its_own_kind_only() -> None:
    pipeline = make_instance([NodeId("a"), NodeId("b")], sharding="pipeline")
    with pytest.raises(ValidationError, match="pipeline shard of a tensor instance"):
        Instance(
            instance_id=pipeline.instance_id,
            sharding="tensor",
            shard_assignments=pipeline.shard_assignments,
            rendezvous=pipeline.rendezvous,
        )
