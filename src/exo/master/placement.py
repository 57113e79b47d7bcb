"""Placement: which node(s) run which shard of a model. Pure functions of the state.
The rules below, applied to one group of nodes, are `exo.master.group_layout.layout`;
this module tries the groups, prefers one layout and makes it an instance.

Rules (exo's, with its gaps filled):
- candidates are single nodes and groups of nodes that measured links to each other
  (topology edges); every rank must reach rank 0, where the process group meets;
- a group must hold the model in its total available memory, and each node its share:
  the peak of its weights while loading in the engine's format (int4 on CPU, see
  `exo.shared.models.memory`), not the float32 or on-disk size, or of its weights and
  KV-cache budget while serving, plus the runner process's own memory; a vision card's
  float32 tower counts on the rank that runs it (rank 0: `Parallelism.runs_vision_tower`);
- the KV-cache budget is the node's `--kv-cache-tokens`, else sized from its memory
  (`memory_sized_kv_cache_tokens`: the default budget plus half of what is left); the ranks
  of a split instance share one budget, the smallest of theirs (`Instance.kv_cache_tokens`);
- a node's available memory is what it reported minus what is promised to runners
  already placed on it that its report cannot show yet (`placement_room`), so placements
  in quick succession never share the same free memory;
- pipeline sharding, when every node of the group measured its speed (`NodeSpeed`),
  splits layers so that the slowest rank's predicted decode stage (its layers, the last
  rank's LM head: `speed_prediction.decode_stage_seconds`) is as short as the nodes'
  memory allows (`speed_balanced_split`): a pipeline serving several streams runs as fast
  as its slowest stage, and one stream gains when a faster node holds more layers; without
  every speed, in proportion to each node's available memory beyond its runner process
  and rank 0's vision tower at its loading peak (largest-remainder rounding, exo's rule);
  at least one layer per node either way;
- tensor sharding needs the card's tensor support and attention heads, KV heads and MLP
  size divisible by the node count;
- a draft model for speculative decoding (`exo.shared.models.drafts`: the card's, or rank
  0's node's `--draft-model`) runs on a spare node (one of the candidates outside the
  group, reached from rank 0, with room for it: `group_layout._draft_on_spare`) in a
  draft runner of its own (`DraftRunner`, `draft_runner_bytes` counted there), else in
  rank 0's runner: its weights and KV for the instance's budget count on that node
  (`draft_bytes`); a group where it fits nowhere is placed without it, saying why
  (`Instance.draft_left_out`); a split instance takes one where its kind verifies drafts
  (`drafts.draft_runs_on`: every kind today); a draft that cannot draft for the model (the
  model itself, a card of another vocabulary: `drafts.draft_for`) is left out, saying why;
- prefer the fewest nodes that fit, then layouts that keep their draft model, then nodes
  that already hold the model's files, then the most available memory (ties by node id,
  so every master decides the same).
"""

from __future__ import annotations

import hashlib
import itertools
from collections.abc import Mapping, Sequence

from exo.master.group_layout import Layout, layout
from exo.master.layer_split import PlacementError as PlacementError
from exo.master.layer_split import layer_split as layer_split
from exo.master.layer_split import speed_balanced_split as speed_balanced_split
from exo.master.placement_memory import MEMORY_OVERHEAD_FRACTION as MEMORY_OVERHEAD_FRACTION
from exo.master.placement_memory import (
    NodeRoom,
    placement_room,
)
from exo.master.placement_memory import pipeline_share_bytes as pipeline_share_bytes
from exo.master.speed_prediction import (
    DEFAULT_PROMPT_TOKENS,
    predict_speed,
)
from exo.shared.models.architectures import SERVED_ARCHITECTURES, is_encoder_architecture
from exo.shared.parallelism import PARALLELISMS, parallelism
from exo.shared.types.common import FrozenModel, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.instances import (
    DraftRunner,
    Instance,
    InstanceDraft,
    Rendezvous,
    ShardAssignments,
    Sharding,
)
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import State

# Rank 0 of a multi-node instance listens on a port derived from the instance id.
# Below Linux's ephemeral range (32768-60999): a port the OS hands to an outgoing connection
# (or to a test's free-port probe) can never be the one a group meets on.
RENDEZVOUS_PORT_BASE = 20000
RENDEZVOUS_PORT_SPAN = 10000
# Groups larger than this are not enumerated (the number of groups grows combinatorially).
MAX_GROUP_SIZE = 8


class PlacementPreview(FrozenModel):
    """One way to place a model, valid or not (`error` says why not).

    `predicted_decode_tokens_per_second` (one stream, tok/s) and `predicted_ttft_seconds`
    for a prompt of `prediction_prompt_tokens` tokens come from the nodes' measured speeds
    and links (`exo.master.speed_prediction`); None when the placement is invalid or a
    node has not measured its speed."""

    model_id: str
    sharding: Sharding
    node_count: int
    node_ids: tuple[NodeId, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    bytes_per_node: tuple[int, ...]
    error: str | None = None
    kv_cache_tokens: int | None = None
    """The KV-cache budget (tokens) its runners would hold (`Instance.kv_cache_tokens`);
    None when the placement is invalid."""
    draft: InstanceDraft | None = None
    """The draft model its rank 0 would load and on which node (`Instance.draft`), its
    memory in that node's `bytes_per_node`."""
    draft_left_out: str | None = None
    """Why a draft model named for it would not be used (`Instance.draft_left_out`)."""
    predicted_decode_tokens_per_second: float | None = None
    predicted_ttft_seconds: float | None = None
    prediction_prompt_tokens: int = DEFAULT_PROMPT_TOKENS


def runner_id_for(instance_id: InstanceId, rank: int, runner_tag: str = "") -> RunnerId:
    """`{instance_id}-rank{rank}`; a re-placed instance tags its new runners
    (`{instance_id}-{tag}-rank{rank}`) so no status of the old ones is taken for theirs."""
    if runner_tag:
        return RunnerId(f"{instance_id}-{runner_tag}-rank{rank}")
    return RunnerId(f"{instance_id}-rank{rank}")


def draft_runner_id_for(instance_id: InstanceId, runner_tag: str = "") -> RunnerId:
    """`{instance_id}-draft` (`{instance_id}-{tag}-draft` for a re-placement): the runner
    of an instance's draft model on a spare node (`DraftRunner`)."""
    if runner_tag:
        return RunnerId(f"{instance_id}-{runner_tag}-draft")
    return RunnerId(f"{instance_id}-draft")


def rendezvous_port(instance_id: InstanceId, runner_tag: str = "") -> int:
    """Rank 0's port: in [20000, 30000), from the instance id (and the re-placement's
    tag, so a new group never meets on the port the broken one used)."""
    key = f"{instance_id}-{runner_tag}" if runner_tag else instance_id
    digest = hashlib.sha256(key.encode()).digest()
    return RENDEZVOUS_PORT_BASE + int.from_bytes(digest[:4], "big") % RENDEZVOUS_PORT_SPAN


def tensor_split_error(card: ModelCard, world_size: int) -> str | None:
    """Why `card` cannot be split inside its layers over `world_size` nodes, or None
    (`TensorParallelism.split_error`)."""
    return parallelism("tensor").split_error(card, world_size)


def holds_files(state: State, card: ModelCard, node_id: NodeId) -> bool:
    """Whether `node_id` reported `card`'s files complete on its disk (`DownloadCompleted`):
    a runner there loads without fetching anything."""
    status = state.downloads.get(node_id, {}).get(card.model_id)
    return isinstance(status, DownloadCompleted)


def _cannot_fetch(state: State, card: ModelCard, node_id: NodeId) -> bool:
    """An `--offline` node not known to hold the files may fail to prepare them."""
    return state.node_info[node_id].offline and not holds_files(state, card, node_id)


def _preference(
    state: State, room: Mapping[NodeId, NodeRoom], card: ModelCard, candidate: Layout
) -> tuple[int, bool, int, int, tuple[str, ...]]:
    """Smaller is better: fewest offline nodes lacking the files (they can only use what
    they hold; a lone offline node is still chosen), then a layout that keeps the draft
    model named for it (where another layout could: not one that cannot draft for it),
    then most nodes holding the files, then most memory, then the node ids
    (deterministic)."""
    cannot_fetch = sum(_cannot_fetch(state, card, n) for n in candidate.nodes)
    holding = sum(holds_files(state, card, n) for n in candidate.nodes)
    memory = sum(room[n].available_bytes for n in candidate.nodes)
    drops_draft = candidate.draft_left_out is not None and not candidate.draft_unusable
    return (cannot_fetch, drops_draft, -holding, -memory, tuple(sorted(candidate.nodes)))


def best_layout(
    card: ModelCard,
    state: State,
    sharding: Sharding,
    node_count: int,
    nodes: Sequence[NodeId],
    room: Mapping[NodeId, NodeRoom] | None = None,
    cards: Mapping[ModelId, ModelCard] | None = None,
) -> Layout:
    """The preferred valid layout on exactly `node_count` of `nodes` (`room` and `cards`
    as in `layout`).

    Raises:
        PlacementError: none is valid (the reason of the most promising group), or the
            engine has no model family for the card's architecture (a catalog card may
            precede its family: it would be downloaded and then fail to load).
    """
    if card.cannot_serve is not None:
        raise PlacementError(f"{card.model_id}: {card.cannot_serve}")
    if card.architecture not in SERVED_ARCHITECTURES:
        raise PlacementError(
            f"{card.model_id}: the engine has no model family for {card.architecture} yet "
            f"(it runs {', '.join(SERVED_ARCHITECTURES)})"
        )
    if is_encoder_architecture(card.architecture) and node_count > 1:
        raise PlacementError(
            f"{card.model_id} is an encoder model ({card.architecture}): it is placed whole "
            "on one node, never split"
        )
    # A refusal no group changes (a dense model split by experts), before any memory figure.
    whole_model_error = parallelism(sharding).split_error(card, 1)
    if whole_model_error is not None:
        raise PlacementError(whole_model_error)
    if node_count > len(nodes):
        raise PlacementError(f"needs {node_count} nodes but the cluster has {len(nodes)}")
    if node_count > MAX_GROUP_SIZE:
        raise PlacementError(f"groups of more than {MAX_GROUP_SIZE} nodes are not placed")
    room = placement_room(state) if room is None else room
    valid: list[Layout] = []
    errors: list[tuple[int, str]] = []
    for group in itertools.combinations(sorted(nodes), node_count):
        try:
            spares = [node_id for node_id in nodes if node_id not in group]
            valid.append(layout(card, state, sharding, group, room, cards, spares))
        except PlacementError as error:
            errors.append((sum(room[n].available_bytes for n in group), str(error)))
    if valid:
        return min(valid, key=lambda candidate: _preference(state, room, card, candidate))
    # The group with the most memory explains best why nothing fits.
    raise PlacementError(max(errors)[1])


def _candidate_nodes(state: State, node_ids: Sequence[NodeId] | None) -> list[NodeId]:
    """The nodes a placement may use: the ones asked for, or every reachable node.

    Raises:
        PlacementError: an asked-for node is unknown or lost (its link dropped)."""
    if node_ids is None:
        return [node_id for node_id in state.node_info if node_id not in state.lost_nodes]
    unknown = [node_id for node_id in node_ids if node_id not in state.node_info]
    if unknown:
        raise PlacementError(f"unknown node id(s): {', '.join(unknown)}")
    lost = [node_id for node_id in node_ids if node_id in state.lost_nodes]
    if lost:
        raise PlacementError(f"node(s) {', '.join(lost)} left the cluster (link lost)")
    return list(dict.fromkeys(node_ids))


def _shards(card: ModelCard, sharding: Sharding, chosen: Layout) -> list[ShardMetadata]:
    world_size = len(chosen.nodes)
    return [
        ShardMetadata(
            model_card=card,
            sharding=sharding,
            device_rank=rank,
            world_size=world_size,
            start_layer=start,
            end_layer=end,
        )
        for rank, (start, end) in enumerate(chosen.layer_ranges)
    ]


def place_instance(
    card: ModelCard,
    state: State,
    instance_id: InstanceId,
    sharding: Sharding = "pipeline",
    min_nodes: int = 1,
    node_ids: Sequence[NodeId] | None = None,
    runner_tag: str = "",
    cards: Mapping[ModelId, ModelCard] | None = None,
) -> Instance:
    """Choose where to run `card` and return the instance to create. The memory of
    instances already placed counts (`placement_room`), except `instance_id`'s own (a
    re-placement replaces it).

    Args:
        node_ids: restrict the placement to these nodes (all of them need not be used).
        min_nodes: use at least this many nodes.
        runner_tag: part of the runner ids and rendezvous port of a re-placement
            (`runner_id_for`); empty for a first placement.
        cards: the catalog a draft model resolves in (None: the built-in cards).

    Raises:
        PlacementError: no nodes are known, too few, or no group can hold the model.
    """
    candidates = _candidate_nodes(state, node_ids)
    if not candidates:
        raise PlacementError("no nodes are known yet; wait for the node to report its memory")
    if min_nodes > len(candidates):
        raise PlacementError(
            f"min_nodes={min_nodes} but only {len(candidates)} node(s) are available"
        )
    room = placement_room(state, exclude=instance_id)
    chosen: Layout | None = None
    last_error: str | None = None
    # An encoder is never split: past one node, only its refusal would be learnt.
    largest = 1 if is_encoder_architecture(card.architecture) else MAX_GROUP_SIZE
    last = max(min_nodes, min(len(candidates), largest, MAX_GROUP_SIZE))
    for node_count in range(min_nodes, last + 1):
        try:
            chosen = best_layout(card, state, sharding, node_count, candidates, room, cards)
            break
        except PlacementError as error:
            last_error = str(error)  # the largest groups explain best what is missing
    if chosen is None:
        raise PlacementError(last_error or "no placement found")
    shards = _shards(card, sharding, chosen)
    runner_to_shard = {runner_id_for(instance_id, s.device_rank, runner_tag): s for s in shards}
    node_to_runner = {
        node_id: runner_id_for(instance_id, rank, runner_tag)
        for rank, node_id in enumerate(chosen.nodes)
    }
    assignments = ShardAssignments(
        model_id=card.model_id, runner_to_shard=runner_to_shard, node_to_runner=node_to_runner
    )
    rendezvous = None
    if len(chosen.nodes) > 1:
        all_cuda = all(state.node_info[n].gpus for n in chosen.nodes)
        rendezvous = Rendezvous(
            backend="nccl" if all_cuda else "gloo",
            port=rendezvous_port(instance_id, runner_tag),
            addresses=chosen.rendezvous_addresses,
            link_addresses=chosen.link_addresses,
        )
    draft = chosen.draft
    if draft is not None and chosen.draft_address is not None:
        draft = draft.model_copy(
            update={
                "runner": DraftRunner(
                    runner_id=draft_runner_id_for(instance_id, runner_tag),
                    port=rendezvous_port(instance_id, f"{runner_tag}-draft"),
                    address=chosen.draft_address,
                )
            }
        )
    return Instance(
        instance_id=instance_id,
        sharding=sharding,
        shard_assignments=assignments,
        rendezvous=rendezvous,
        kv_cache_tokens=chosen.kv_cache_tokens,
        draft=draft,
        draft_left_out=chosen.draft_left_out,
    )


def placement_previews(
    card: ModelCard,
    state: State,
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    cards: Mapping[ModelId, ModelCard] | None = None,
) -> list[PlacementPreview]:
    """Every (sharding, node count) combination with its layout (and the draft model it
    would load, and where), or why it is invalid, and the valid ones' predicted speed for
    a prompt of `prompt_tokens` tokens (`cards` as in `layout`)."""
    speeds = {node_id: info.speed for node_id, info in state.node_info.items()}
    rounding = {node_id: info.prefill_activations for node_id, info in state.node_info.items()}
    room = placement_room(state)
    previews: list[PlacementPreview] = []
    nodes = sorted(state.node_info)
    for sharding in PARALLELISMS:
        for count in range(1, max(len(nodes), 1) + 1):
            try:
                chosen = best_layout(card, state, sharding, count, nodes, room, cards)
            except PlacementError as error:
                previews.append(
                    PlacementPreview(
                        model_id=card.model_id,
                        sharding=sharding,
                        node_count=count,
                        node_ids=(),
                        layer_ranges=(),
                        bytes_per_node=(),
                        error=str(error),
                        prediction_prompt_tokens=prompt_tokens,
                    )
                )
                continue
            prediction = predict_speed(
                card, sharding, chosen.nodes, chosen.layer_ranges, speeds, state.topology,
                prompt_tokens, rounding,
            )  # fmt: skip
            previews.append(
                PlacementPreview(
                    model_id=card.model_id,
                    sharding=sharding,
                    node_count=count,
                    node_ids=chosen.nodes,
                    layer_ranges=chosen.layer_ranges,
                    bytes_per_node=chosen.bytes_per_node,
                    kv_cache_tokens=chosen.kv_cache_tokens,
                    draft=chosen.draft,
                    draft_left_out=chosen.draft_left_out,
                    predicted_decode_tokens_per_second=(
                        None if prediction is None else prediction.decode_tokens_per_second
                    ),
                    predicted_ttft_seconds=None if prediction is None else prediction.ttft_seconds,
                    prediction_prompt_tokens=prompt_tokens,
                )
            )
    return previews
