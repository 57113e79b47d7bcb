"""Instances: one placed copy of a model, split into shards held by runners."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from exo.shared.types.common import FrozenModel, InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import Sharding, ShardMetadata

__all__ = [
    "DraftRunner",
    "Instance",
    "InstanceDraft",
    "Rendezvous",
    "ShardAssignments",
    "Sharding",
]

DraftChosenBy = Literal["card", "node_option"]
"""Who named an instance's draft model: the target's card (`ModelCard.draft_model`) or
the `--draft-model` of the node running its rank 0, which overrides the card."""


class ShardAssignments(FrozenModel):
    """Which runner holds which shard, and which node runs which runner."""

    model_id: ModelId
    runner_to_shard: dict[RunnerId, ShardMetadata]
    node_to_runner: dict[NodeId, RunnerId]

    @model_validator(mode="after")
    def _consistent(self) -> ShardAssignments:
        if set(self.node_to_runner.values()) != set(self.runner_to_shard):
            raise ValueError("every runner needs exactly one node and one shard")
        if len(set(self.node_to_runner.values())) != len(self.node_to_runner):
            raise ValueError("a runner cannot run on two nodes")
        return self

    def runner_for_node(self, node_id: NodeId) -> RunnerId | None:
        return self.node_to_runner.get(node_id)

    def node_for_runner(self, runner_id: RunnerId) -> NodeId:
        for node_id, candidate in self.node_to_runner.items():
            if candidate == runner_id:
                return node_id
        raise KeyError(runner_id)

    def rank_zero_runner(self) -> RunnerId:
        for runner_id, shard in self.runner_to_shard.items():
            if shard.device_rank == 0:
                return runner_id
        raise KeyError("no rank 0 runner")

    @property
    def world_size(self) -> int:
        return len(self.runner_to_shard)


class DraftRunner(FrozenModel):
    """A draft model run apart from the target, on a node that holds none of its ranks
    (`InstanceDraft.runner`): the runner `runner_id` there loads the draft and serves its
    drafts on `port`; rank 0's node reaches that node at `address` (measured topology)."""

    runner_id: RunnerId
    port: int = Field(gt=0, lt=65536)
    address: str


class InstanceDraft(FrozenModel):
    """The draft model of an instance's speculative decoding, on `node_id`, which fetches
    its files (`exo.shared.models.drafts`): loaded in the instance's rank-0 runner when
    `runner` is None, else in a draft runner of its own on a spare node, whose drafts rank
    0 asks for over the cluster's links.

    `model_card` is the draft's card, whose weights and KV placement counted on that node;
    None for a `--draft-model` directory only rank 0's node knows (its memory is the node
    operator's to leave free: placement cannot size it; it never moves to a spare node)."""

    model_id: ModelId
    node_id: NodeId
    chosen_by: DraftChosenBy
    model_card: ModelCard | None = None
    runner: DraftRunner | None = None


class Rendezvous(FrozenModel):
    """Where the ranks of one instance meet to form their torch.distributed group.

    Rank 0 listens on `port`; `addresses[node]` is the address that node uses to reach
    rank 0 (measured topology: nodes may reach it on different networks).
    `link_addresses[a][b]`: the address node `a` reaches node `b` at, for the measured
    links between two ranks other than 0; a rank links to a lower rank there, else at the
    address that rank published (empty in instances placed before it existed)."""

    backend: Literal["gloo", "nccl"]
    port: int = Field(gt=0, lt=65536)
    addresses: dict[NodeId, str]
    link_addresses: dict[NodeId, dict[NodeId, str]] = Field(default_factory=dict)


class Instance(FrozenModel):
    """One placed copy of a model: its runners' shards, all cut by `sharding`
    (`exo.shared.parallelism` describes each kind; one runner is a single node)."""

    instance_id: InstanceId
    sharding: Sharding
    shard_assignments: ShardAssignments
    rendezvous: Rendezvous | None = None
    """None for a single-rank instance."""
    kv_cache_tokens: int | None = Field(default=None, ge=1)
    """The KV-cache budget (tokens) every runner's engine holds, running requests and the
    prefix cache together, chosen at placement (`exo.master.placement`; ranks agree on one
    budget: the smallest any of their nodes allows). None in instances placed before it
    was carried: each runner then takes its node's `--kv-cache-tokens` or the default."""
    draft: InstanceDraft | None = None
    """The draft model its rank 0 drafts with, in its own runner or on a spare node
    (None: n-gram drafts only)."""
    draft_left_out: str | None = None
    """Why a draft model named for it (by the card or rank 0's node) is not used: no room
    for it beside the target on rank 0's node, a split kind that does not speculate, the
    served model itself, or a card of another vocabulary (`drafts.draft_for`). None when it
    is used or none is named."""

    @model_validator(mode="after")
    def _shards_of_its_kind(self) -> Instance:
        for runner_id, shard in self.shard_assignments.runner_to_shard.items():
            if shard.sharding != self.sharding:
                raise ValueError(
                    f"runner {runner_id} holds a {shard.sharding} shard of a "
                    f"{self.sharding} instance"
                )
        draft = self.draft
        if draft is not None and draft.runner is not None:
            if draft.node_id in self.shard_assignments.node_to_runner:
                raise ValueError(
                    f"a draft runner runs on a node that holds no rank; {draft.node_id} holds one"
                )
            if draft.runner.runner_id in self.shard_assignments.runner_to_shard:
                raise ValueError(f"draft runner {draft.runner.runner_id} is also a rank's runner")
            if draft.model_card is None:
                raise ValueError("a draft runner loads a catalog model: its draft needs a card")
        return self

    @property
    def model_id(self) -> ModelId:
        return self.shard_assignments.model_id

    @property
    def draft_runner(self) -> DraftRunner | None:
        """The runner of its draft model on a spare node, None when there is none."""
        return None if self.draft is None else self.draft.runner

    def draft_runner_on(self, node_id: NodeId) -> RunnerId | None:
        """The id of its draft runner when that runs on `node_id`, else None."""
        draft = self.draft
        if draft is None or draft.runner is None or draft.node_id != node_id:
            return None
        return draft.runner.runner_id
