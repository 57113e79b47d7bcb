"""The draft model of speculative decoding as a placed part of an instance (issue 43): the
card names it, a node's `--draft-model` overrides it, placement counts it on rank 0's node
(or places the instance without it, saying why), previews name it and its node, the
promised memory of a placed instance counts it, and the worker fetches it with the
target and hands it to the runner."""

from __future__ import annotations

from collections.abc import Mapping

import pytest

from exo.master.placement import PlacementError, place_instance, placement_previews
from exo.master.placement_memory import (
    draft_bytes,
    draft_unallocated_bytes,
    placement_room,
    required_memory_bytes,
    runner_bytes,
    runner_unallocated_bytes,
)
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.drafts import draft_for
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.instances import InstanceDraft, Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadStatus,
    NodeInfo,
    TopologyEdge,
)
from exo.shared.types.runners import RunnerIdle, RunnerReady
from exo.shared.types.state import State
from exo.shared.types.tasks import DownloadModel, LoadModel, Task
from exo.testing.builders import MIB, make_node_info, make_state
from exo.worker.main import runner_options_for
from exo.worker.plan import LocalRunner, plan
from exo.worker.runner.options import RunnerOptions

CARDS = load_builtin_cards()
QWEN3_8B = CARDS[ModelId("Qwen/Qwen3-8B")]
QWEN3_0_6B = CARDS[ModelId("Qwen/Qwen3-0.6B")]
QWEN3_1_7B = CARDS[ModelId("Qwen/Qwen3-1.7B")]
NODE_A = NodeId("node-a")
NODE_B = NodeId("node-b")
INSTANCE_ID = InstanceId("instance-1")
TOKENS = DEFAULT_KV_CACHE_TOKENS  # `make_node_info`'s `--kv-cache-tokens`


def target_bytes() -> int:
    return required_memory_bytes(QWEN3_8B, kv_cache_tokens=TOKENS)


def both_bytes(draft: ModelCard = QWEN3_0_6B) -> int:
    return target_bytes() + draft_bytes(draft, TOKENS)


def node(available_bytes: int, draft_model: str | None = None, name: str = "n") -> NodeInfo:
    info = make_node_info(available_bytes // MIB + 1, name=name)
    return info.model_copy(update={"draft_model": draft_model})


def linked_state(**nodes: NodeInfo) -> State:
    infos = {NodeId(name): info for name, info in nodes.items()}
    edges = {
        source: {
            sink: TopologyEdge(
                source=source, sink=sink, address="127.0.0.1", latency_ms=1, bandwidth_mbps=1000
            )
            for sink in infos
            if sink != source
        }
        for source in infos
    }
    return make_state(nodes=infos).model_copy(update={"topology": edges})


# --- the card field and the node option ------------------------------------------------


def test_catalog_drafts_are_catalog_text_models_with_the_targets_vocabulary() -> None:
    named = {card.model_id: card.draft_model for card in CARDS.values() if card.draft_model}
    assert named[QWEN3_8B.model_id] == QWEN3_0_6B.model_id
    assert named[ModelId("HuggingFaceTB/SmolLM2-1.7B-Instruct")] == ModelId(
        "HuggingFaceTB/SmolLM2-135M-Instruct"
    )
    for target_id, draft_id in named.items():
        target, draft = CARDS[target_id], CARDS[draft_id]
        assert draft.vocab_size == target.vocab_size, target_id
        assert "text" in draft.capabilities and draft.draft_model is None
        assert draft.storage_size_bytes < target.storage_size_bytes / 4, target_id


def test_the_nodes_option_overrides_the_cards_draft() -> None:
    by_card = draft_for(QWEN3_8B, NODE_A, None, CARDS)
    assert by_card == InstanceDraft(
        model_id=QWEN3_0_6B.model_id, node_id=NODE_A, chosen_by="card", model_card=QWEN3_0_6B
    )
    # A catalog model by its short name: its card, counted.
    by_option = draft_for(QWEN3_8B, NODE_A, "qwen3:1.7b", CARDS)
    assert isinstance(by_option, InstanceDraft) and by_option.chosen_by == "node_option"
    assert by_option.model_id == QWEN3_1_7B.model_id and by_option.model_card == QWEN3_1_7B
    # A directory only the node knows: named, without a card.
    local = draft_for(QWEN3_8B, NODE_A, "/models/my-draft", CARDS)
    assert local == InstanceDraft(
        model_id=ModelId("/models/my-draft"), node_id=NODE_A, chosen_by="node_option"
    )
    # No draft for a card without one; the target itself is left out, saying so.
    assert draft_for(QWEN3_0_6B, NODE_A, None, CARDS) is None
    itself = draft_for(QWEN3_8B, NODE_A, "qwen3:8b", CARDS)
    assert isinstance(itself, str) and "served model itself" in itself
    embedding = CARDS[ModelId("Qwen/Qwen3-Embedding-0.6B")]
    assert draft_for(embedding, NODE_A, "qwen3:0.6b", CARDS) is None


# --- placement ---------------------------------------------------------------------------


def test_a_node_with_room_for_both_places_the_draft_on_rank_zero_and_counts_it() -> None:
    state = linked_state(**{NODE_A: node(both_bytes())})
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    assert instance.draft == InstanceDraft(
        model_id=QWEN3_0_6B.model_id, node_id=NODE_A, chosen_by="card", model_card=QWEN3_0_6B
    )
    assert instance.draft_left_out is None
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    # A placed instance promises its runner and its draft until the runner is ready...
    room = placement_room(state.model_copy(update={"instances": {INSTANCE_ID: instance}}))
    assert room[NODE_A].promised_bytes == runner_bytes(shard, TOKENS) + draft_bytes(
        QWEN3_0_6B, TOKENS
    )
    assert room[NODE_A].promised_runners == 1
    # ...then what both may still allocate (their KV caches).
    runner_id = instance.shard_assignments.rank_zero_runner()
    ready = state.model_copy(
        update={"instances": {INSTANCE_ID: instance}, "runners": {runner_id: RunnerReady()}}
    )
    assert placement_room(ready)[NODE_A].promised_bytes == runner_unallocated_bytes(
        shard, TOKENS
    ) + draft_unallocated_bytes(QWEN3_0_6B, TOKENS)


def test_a_node_without_room_for_both_places_the_model_alone_and_says_why() -> None:
    state = linked_state(**{NODE_A: node(target_bytes())})
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    assert instance.draft is None
    assert instance.draft_left_out is not None
    assert f"draft model {QWEN3_0_6B.model_id} left out" in instance.draft_left_out
    assert str(NODE_A) in instance.draft_left_out
    # Nothing is promised for a draft that is not loaded.
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    room = placement_room(state.model_copy(update={"instances": {INSTANCE_ID: instance}}))
    assert room[NODE_A].promised_bytes == runner_bytes(shard, TOKENS)
    # Without room for the model itself, the model's own shortage is the reason.
    with pytest.raises(PlacementError, match="Qwen3-8B needs"):
        place_instance(QWEN3_8B, linked_state(**{NODE_A: node(target_bytes() // 2)}), INSTANCE_ID)


def test_a_node_without_room_for_the_draft_is_not_chosen_over_one_with_room() -> None:
    # Node B holds the files (preferred otherwise) but has room for the model alone, and
    # the nodes measured no link between them: no spare node for the draft to go to.
    nodes = {NODE_A: node(both_bytes()), NODE_B: node(target_bytes())}
    state = make_state(nodes=nodes).model_copy(
        update={"downloads": {NODE_B: {QWEN3_8B.model_id: DownloadCompleted(path="/m")}}}
    )
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    assert instance.shard_assignments.node_to_runner.keys() == {NODE_A}
    assert instance.draft is not None and instance.draft.node_id == NODE_A
    assert instance.draft.runner is None
    # Linked, A is B's spare node: B runs the target and A the draft in a runner of its own.
    linked = linked_state(**nodes).model_copy(update={"downloads": state.downloads})
    instance = place_instance(QWEN3_8B, linked, INSTANCE_ID, cards=CARDS)
    assert instance.shard_assignments.node_to_runner.keys() == {NODE_B}
    assert instance.draft is not None and instance.draft.node_id == NODE_A
    assert instance.draft.runner is not None


def test_the_nodes_option_is_placed_and_counted_and_a_directory_is_named_uncounted() -> None:
    roomy = linked_state(**{NODE_A: node(both_bytes(QWEN3_1_7B), draft_model="Qwen/Qwen3-1.7B")})
    instance = place_instance(QWEN3_8B, roomy, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None
    assert (instance.draft.model_id, instance.draft.chosen_by) == (
        QWEN3_1_7B.model_id,
        "node_option",
    )
    # Room for the card's 0.6B draft but not for the node's 1.7B one: left out, not swapped.
    tight = linked_state(**{NODE_A: node(both_bytes(), draft_model="Qwen/Qwen3-1.7B")})
    instance = place_instance(QWEN3_8B, tight, INSTANCE_ID, cards=CARDS)
    assert instance.draft is None
    assert instance.draft_left_out is not None and "Qwen3-1.7B" in instance.draft_left_out
    directory = linked_state(**{NODE_A: node(target_bytes(), draft_model="/models/my-draft")})
    instance = place_instance(QWEN3_8B, directory, INSTANCE_ID, cards=CARDS)
    assert instance.draft is not None and instance.draft.model_card is None
    room = placement_room(directory.model_copy(update={"instances": {INSTANCE_ID: instance}}))
    (shard,) = instance.shard_assignments.runner_to_shard.values()
    assert room[NODE_A].promised_bytes == runner_bytes(shard, TOKENS)


@pytest.mark.parametrize("sharding", ["tensor", "pipeline"])
def test_a_split_drafts_on_rank_zero_and_counts_the_draft_there(sharding: Sharding) -> None:
    state = linked_state(**{NODE_A: node(both_bytes()), NODE_B: node(both_bytes())})
    split = place_instance(
        QWEN3_8B, state, INSTANCE_ID, sharding=sharding, min_nodes=2, cards=CARDS
    )
    assert split.shard_assignments.world_size == 2
    rank_zero = split.shard_assignments.node_for_runner(split.shard_assignments.rank_zero_runner())
    assert split.draft is not None and split.draft.node_id == rank_zero
    assert split.draft_left_out is None
    room = placement_room(state.model_copy(update={"instances": {INSTANCE_ID: split}}))
    shards = split.shard_assignments.runner_to_shard
    for node_id, runner_id in split.shard_assignments.node_to_runner.items():
        own = runner_bytes(shards[runner_id], split.kv_cache_tokens)
        drafting = draft_bytes(QWEN3_0_6B, split.kv_cache_tokens) if node_id == rank_zero else 0
        assert room[node_id].promised_bytes == own + drafting


def test_previews_name_the_draft_its_node_and_count_it_in_that_nodes_bytes() -> None:
    state = linked_state(**{NODE_A: node(both_bytes())})
    previews = {
        (preview.sharding, preview.node_count): preview
        for preview in placement_previews(QWEN3_8B, state, cards=CARDS)
    }
    single = previews[("pipeline", 1)]
    assert single.error is None
    assert single.draft is not None
    assert (single.draft.model_id, single.draft.node_id) == (QWEN3_0_6B.model_id, NODE_A)
    plain = placement_previews(
        QWEN3_8B.model_copy(update={"draft_model": None}), state, cards=CARDS
    )[0]
    assert plain.draft is None and plain.draft_left_out is None
    assert single.bytes_per_node[0] == plain.bytes_per_node[0] + draft_bytes(QWEN3_0_6B, TOKENS)
    # Too little room for the draft: the preview says it would be left out.
    tight = placement_previews(QWEN3_8B, linked_state(**{NODE_A: node(target_bytes())}))[0]
    assert tight.error is None and tight.draft is None
    assert tight.draft_left_out is not None and "left out" in tight.draft_left_out


# --- the worker: fetched with the target, handed to the runner ---------------------------


def test_the_worker_fetches_the_draft_after_the_target_and_loads_once_both_are_there() -> None:
    state = linked_state(**{NODE_A: node(both_bytes())})
    instance = place_instance(QWEN3_8B, state, INSTANCE_ID, cards=CARDS)
    state = state.model_copy(update={"instances": {INSTANCE_ID: instance}})
    runner_id = instance.shard_assignments.rank_zero_runner()
    runners = {runner_id: LocalRunner(INSTANCE_ID, RunnerIdle(), frozenset())}

    def next_task(
        downloads: Mapping[ModelId, DownloadStatus], retry_after: Mapping[str, float] = {}
    ) -> Task | None:
        return plan(NODE_A, state, runners, downloads, retry_after, 0.0)

    target = next_task({})
    assert isinstance(target, DownloadModel)
    assert target.shard.model_card.model_id == QWEN3_8B.model_id
    done = DownloadCompleted(path="/models/qwen3-8b")
    draft = next_task({QWEN3_8B.model_id: done})
    assert isinstance(draft, DownloadModel)
    assert draft.shard.model_card == QWEN3_0_6B
    assert (draft.shard.start_layer, draft.shard.end_layer) == (0, QWEN3_0_6B.n_layers)
    ongoing = DownloadOngoing(message="1/3")
    assert next_task({QWEN3_8B.model_id: done, QWEN3_0_6B.model_id: ongoing}) is None
    load = LoadModel(
        instance_id=INSTANCE_ID, runner_id=RunnerId(runner_id), model_dir="/models/qwen3-8b"
    )
    both = {QWEN3_8B.model_id: done, QWEN3_0_6B.model_id: DownloadCompleted(path="/d")}
    assert next_task(both) == load
    # A draft whose download failed: retried when due, meanwhile the model loads without it
    # (the runner leaves it out).
    failed: dict[ModelId, DownloadStatus] = {
        QWEN3_8B.model_id: done,
        QWEN3_0_6B.model_id: DownloadFailed(error_message="gone"),
    }
    assert next_task(failed) == draft
    assert next_task(failed, {QWEN3_0_6B.model_id: 60.0}) == load


def test_the_runner_loads_the_instances_draft_whatever_the_nodes_option() -> None:
    options = RunnerOptions(draft_model="/models/my-draft")
    draft = InstanceDraft(model_id=QWEN3_0_6B.model_id, node_id=NODE_A, chosen_by="card")
    assert runner_options_for(options, None, draft).draft_model == QWEN3_0_6B.model_id
    # Left out by placement (no room): not loaded, though the node names one.
    assert runner_options_for(options, 4096, None).draft_model is None
