"""How much memory placement reserves per runner, and how much each node has left for a
new placement once the runners already placed on it are counted (`placement_room`).

Sizes come from `exo.shared.models.memory` (the engine's CPU format: int4 layers, int8 LM
head, float32 embedding; a vision card's float32 tower on the rank that runs it) plus
`MEMORY_OVERHEAD_FRACTION` and the runner process's own memory
(`RUNNER_PROCESS_OVERHEAD_BYTES`).
"""

from __future__ import annotations

from dataclasses import dataclass

from exo.shared.models.kv_cache_memory import (
    DEFAULT_KV_CACHE_TOKENS,
    MIN_KV_CACHE_TOKENS,
    kv_budget_tokens_of_length,
    kv_cache_bytes_per_token,
)
from exo.shared.models.memory import (
    RUNNER_PROCESS_OVERHEAD_BYTES,
    resident_weight_bytes,
    serving_peak_bytes,
)
from exo.shared.models.weight_formats import ENGINE_CPU_WEIGHT_FORMAT
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism import parallelism
from exo.shared.types.common import InstanceId, NodeId
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import State

# Activations and allocator slack on top of the weights and KV-cache budget.
MEMORY_OVERHEAD_FRACTION = 0.10
# A node without `--kv-cache-tokens` sizes each runner's KV-cache budget from its memory:
# the planned `DEFAULT_KV_CACHE_TOKENS` (what placement checks the node can hold) plus this
# fraction of the memory left on the node after the runner's weights, process and planned
# budget, so a later placement still finds the other part...
KV_CACHE_MEMORY_FRACTION = 0.5
# ...and never more than this many full contexts (a budget past it would sit unused: one
# request holds at most a context, and a few contexts cover concurrent requests plus the
# prefix cache).
KV_CACHE_MAX_CONTEXTS = 4


def planned_kv_cache_tokens(node_tokens: int | None, card: ModelCard) -> int:
    """The KV-cache budget placement checks a node can hold for a runner of `card`: its
    `--kv-cache-tokens` (`NodeInfo.kv_cache_tokens`), else `DEFAULT_KV_CACHE_TOKENS` but
    no more than `KV_CACHE_MAX_CONTEXTS` of the model's contexts (a 512-token model gets
    2,048, not 8,192 it could never fill; a context counted as `kv_budget_tokens_of_length`:
    less where sliding-window layers keep only their window) nor less than
    `MIN_KV_CACHE_TOKENS`."""
    if node_tokens is not None:
        return node_tokens
    contexts = max(MIN_KV_CACHE_TOKENS, KV_CACHE_MAX_CONTEXTS * _context_tokens(card))
    return min(DEFAULT_KV_CACHE_TOKENS, contexts)


def _context_tokens(card: ModelCard) -> int:
    """Budget tokens one full context of `card` holds (`kv_budget_tokens_of_length`)."""
    return kv_budget_tokens_of_length(card, card.context_length)


def memory_sized_kv_cache_tokens(
    card: ModelCard, share: WeightShare, node_tokens: int | None, available_bytes: int
) -> int:
    """The KV-cache budget (tokens) of a runner holding `share` of `card` on a node with
    `available_bytes` for it (`NodeRoom.available_bytes`).

    A node's `--kv-cache-tokens` (`node_tokens`) is the budget. Without it: the planned
    budget (`planned_kv_cache_tokens`, itself at most `KV_CACHE_MAX_CONTEXTS` contexts)
    plus `KV_CACHE_MEMORY_FRACTION` of what is left after the runner's memory at the
    planned budget (`share_runner_bytes`), at most `KV_CACHE_MAX_CONTEXTS` model contexts
    (what one request may hold, `engine.token_limit`, is one context: a budget past a
    few would sit unused) and never below the planned budget. A runner
    placed on a node that already holds others so takes its fraction of what those left:
    every placed runner keeps the budget it was given (resizing a loaded runner's KV cache
    would drop its prefix cache), and the node keeps room for the next one.
    """
    planned = planned_kv_cache_tokens(node_tokens, card)
    if node_tokens is not None:
        return node_tokens
    left = available_bytes - share_runner_bytes(card, share, planned)
    per_token = kv_cache_bytes_per_token(card, share) * (1 + MEMORY_OVERHEAD_FRACTION)
    extra = int(KV_CACHE_MEMORY_FRACTION * max(0, left) / per_token) if per_token else 0
    ceiling = max(planned, KV_CACHE_MAX_CONTEXTS * _context_tokens(card))
    return min(ceiling, planned + extra)


def required_memory_bytes(
    card: ModelCard, world_size: int = 1, kv_cache_tokens: int | None = None
) -> int:
    """Bytes one tensor-parallel rank of `world_size` (or a whole single node) needs: the
    peak of its weights while loading in the engine's CPU format (int4 layers, int8 LM head,
    float32 embedding, and a vision card's float32 tower: rank 0's, the largest share;
    `exo.shared.models.memory`) or of its weights and KV-cache budget
    (`kv_cache_tokens`, its node's `--kv-cache-tokens`; None: the default) while serving,
    whichever is larger, plus the overhead fraction, plus the runner process's own memory
    (`RUNNER_PROCESS_OVERHEAD_BYTES`)."""
    share = WeightShare(layers=card.n_layers, tensor_parallel_ranks=world_size)
    return share_runner_bytes(card, share, kv_cache_tokens)


def cluster_too_small_message(card: ModelCard, state: State) -> str | None:
    """Why `card` can never run on this cluster as it is, or None when it might: the
    memory it needs whole (`required_memory_bytes`) exceeds the total memory of the
    cluster's nodes together (a split's best case), whatever runs on them now. A download
    of such a model is refused (`exo.master.decisions`): Ollama and LM Studio users expect
    a model too large for their machines to be flagged before its files fill the disk.
    None when no node has reported its memory yet (nothing to judge by)."""
    nodes = [info for node, info in state.node_info.items() if node not in state.lost_nodes]
    if not nodes:
        return None
    needed = required_memory_bytes(card)
    total = sum(info.memory.total_bytes for info in nodes)
    if needed <= total:
        return None
    largest = max(info.memory.total_bytes for info in nodes)
    return (
        f"{card.model_id} does not fit this cluster: it needs {needed / 2**30:.1f} GiB of "
        f"memory to run ({card.storage_size_bytes / 1e9:.0f} GB of files), and the cluster's "
        f"{len(nodes)} node(s) have {total / 2**30:.1f} GiB in all (the largest "
        f"{largest / 2**30:.1f} GiB); add nodes before downloading it"
    )


def pipeline_share_bytes(
    card: ModelCard,
    n_layers: int,
    is_first: bool = True,
    is_last: bool = True,
    kv_cache_tokens: int | None = None,
) -> int:
    """Bytes a pipeline rank holding `n_layers` layers (and the embedding and a vision
    card's tower on the first rank, the LM head on the last) needs while loading or serving
    (its layers' KV-cache budget of `kv_cache_tokens`), plus the overhead fraction, plus the
    runner process's own memory."""
    share = WeightShare(
        layers=n_layers,
        holds_embedding=is_first,
        holds_output_layer=is_last,
        holds_vision_tower=is_first,
    )
    return share_runner_bytes(card, share, kv_cache_tokens)


def share_runner_bytes(
    card: ModelCard, share: WeightShare, kv_cache_tokens: int | None = None
) -> int:
    """Bytes a runner holding `share` of `card` needs: its loading or serving peak (with a
    KV-cache budget of `kv_cache_tokens`, its node's; None: the default), plus the overhead
    fraction, plus the runner process's own memory."""
    peak = serving_peak_bytes(card, ENGINE_CPU_WEIGHT_FORMAT, share, kv_cache_tokens)
    return int(peak * (1 + MEMORY_OVERHEAD_FRACTION)) + RUNNER_PROCESS_OVERHEAD_BYTES


def runner_bytes(shard: ShardMetadata, kv_cache_tokens: int | None = None) -> int:
    """Bytes placement reserves for the runner of `shard` on a node whose runners keep
    `kv_cache_tokens` of KV cache (`required_memory_bytes` of a tensor rank,
    `pipeline_share_bytes` of a pipeline rank)."""
    share = parallelism(shard.sharding).shard_weight_share(shard)
    return share_runner_bytes(shard.model_card, share, kv_cache_tokens)


def runner_unallocated_bytes(shard: ShardMetadata, kv_cache_tokens: int | None = None) -> int:
    """What a loaded runner of `shard` may still allocate: `runner_bytes` minus its
    resident weights and process memory, i.e. the KV-cache budget it fills as requests
    come, the overhead fraction, and no more than that."""
    loaded = resident_weight_bytes(
        shard.model_card,
        ENGINE_CPU_WEIGHT_FORMAT,
        parallelism(shard.sharding).shard_weight_share(shard),
    )
    return max(0, runner_bytes(shard, kv_cache_tokens) - loaded - RUNNER_PROCESS_OVERHEAD_BYTES)


def draft_bytes(draft_card: ModelCard, kv_cache_tokens: int | None = None) -> int:
    """Bytes a draft model takes in its rank-0 runner's process (`Instance.draft`): its
    serving peak in the engine's CPU format (weights, loaded after the target's, or weights
    and KV for `kv_cache_tokens`, the instance's budget: it holds KV for the texts the
    target runs, at most that many tokens) plus the overhead fraction; no process of its
    own."""
    peak = serving_peak_bytes(draft_card, ENGINE_CPU_WEIGHT_FORMAT, None, kv_cache_tokens)
    return int(peak * (1 + MEMORY_OVERHEAD_FRACTION))


def draft_unallocated_bytes(draft_card: ModelCard, kv_cache_tokens: int | None = None) -> int:
    """What a loaded draft model may still allocate: `draft_bytes` less its resident
    weights (its KV and the overhead fraction)."""
    loaded = resident_weight_bytes(draft_card, ENGINE_CPU_WEIGHT_FORMAT)
    return max(0, draft_bytes(draft_card, kv_cache_tokens) - loaded)


def draft_runner_bytes(draft_card: ModelCard, kv_cache_tokens: int | None = None) -> int:
    """Bytes a draft model takes in a draft runner of its own on a spare node
    (`InstanceDraft.runner`): `draft_bytes` plus that runner's process."""
    return draft_bytes(draft_card, kv_cache_tokens) + RUNNER_PROCESS_OVERHEAD_BYTES


def _draft_promise(instance: Instance, node_id: NodeId, tokens: int, ready: bool) -> int:
    """What the instance's draft model (counted when it has a card) promises on `node_id`
    beyond its rank-0 runner (`placement_room`'s rule: all of it until the runner is
    ready, then its unallocated part). A draft in a runner of its own promises nothing
    here (`_draft_runner_promise`)."""
    draft = instance.draft
    if draft is None or draft.model_card is None or draft.node_id != node_id:
        return 0
    if draft.runner is not None:
        return 0
    if ready:
        return draft_unallocated_bytes(draft.model_card, tokens)
    return draft_bytes(draft.model_card, tokens)


def _draft_runner_promise(instance: Instance, state: State, tokens: int) -> int:
    """What the instance's draft runner on a spare node promises there, by the same rule
    (all of `draft_runner_bytes` until it reports ready, then its KV and overhead)."""
    draft = instance.draft
    assert draft is not None and draft.runner is not None and draft.model_card is not None
    if isinstance(state.runners.get(draft.runner.runner_id), RunnerReady | RunnerRunning):
        return draft_unallocated_bytes(draft.model_card, tokens)
    return draft_runner_bytes(draft.model_card, tokens)


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """A node's memory as placement sees it (bytes).

    Attributes:
        reported_bytes: the available memory the node last reported (`NodeInfo.memory`).
        promised_bytes: memory its placed runners will still take that the report cannot
            show (`placement_room`).
        promised_runners: how many runners that is.
        kv_cache_tokens: the node's `--kv-cache-tokens` (`NodeInfo.kv_cache_tokens`), the
            budget of every runner placed on it; None: each runner's budget is sized from
            the node's memory (`memory_sized_kv_cache_tokens`).
    """

    reported_bytes: int
    promised_bytes: int = 0
    promised_runners: int = 0
    kv_cache_tokens: int | None = None

    def planned_kv_cache_tokens(self, card: ModelCard) -> int:
        """The budget a share of `card` placed here is checked against
        (`planned_kv_cache_tokens`)."""
        return planned_kv_cache_tokens(self.kv_cache_tokens, card)

    @property
    def available_bytes(self) -> int:
        """What a new placement may use: reported minus promised, at least 0."""
        return max(0, self.reported_bytes - self.promised_bytes)

    def describe(self) -> str:
        """'N MiB available', with what was promised when anything was."""
        text = f"{self.available_bytes / 2**20:.0f} MiB available"
        if self.promised_runners:
            text += (
                f" ({self.reported_bytes / 2**20:.0f} MiB free, "
                f"{self.promised_bytes / 2**20:.0f} MiB of it promised to "
                f"{self.promised_runners} runner(s) already placed there)"
            )
        return text


def placement_room(state: State, exclude: InstanceId | None = None) -> dict[NodeId, NodeRoom]:
    """Every known node's memory for a new placement.

    A node reports its available memory every few seconds, and only when it moved by
    256 MiB (`exo.node.info_gatherer`), while the state knows each placed runner's status.
    So a runner placed on a node promises, beyond that report:
    - until it reports `RunnerReady` / `RunnerRunning` (no status yet, idle, connecting,
      loading, warming up, or failed and about to be started again): all of its
      `runner_bytes`: its process and weights are not (all) allocated yet (what a
      loading runner already holds may so count twice: a placement meanwhile is refused
      rather than overcommitting the node);
    - once ready: `runner_unallocated_bytes`, the KV cache it fills later (its weights and
      process are in the node's report from the next one on: a report lagging a runner
      that just became ready, or under 256 MiB, is the error left).
    Each runner is sized with its instance's KV-cache budget (`Instance.kv_cache_tokens`);
    a rank-0 runner that loads a draft model (`Instance.draft`) promises its `draft_bytes`
    too, by the same rule, and a draft runner on a spare node its `draft_runner_bytes`
    there.
    Instance `exclude` (the one being re-placed) promises nothing, nor does an instance
    waiting for room (it runs nowhere until placed again). Deterministic: a pure function
    of the state, the same on every master.
    """
    promised: dict[NodeId, list[int]] = {node_id: [] for node_id in state.node_info}
    for instance in state.instances.values():
        waiting = state.unavailable_instances.get(instance.instance_id)
        if instance.instance_id == exclude or (waiting is not None and waiting.waiting_for_room):
            continue
        assignments = instance.shard_assignments
        for node_id, runner_id in assignments.node_to_runner.items():
            shard = assignments.runner_to_shard.get(runner_id)
            if node_id not in promised or shard is None:
                continue
            tokens = instance.kv_cache_tokens
            if tokens is None:  # placed before instances carried their budget
                tokens = planned_kv_cache_tokens(
                    state.node_info[node_id].kv_cache_tokens, shard.model_card
                )
            ready = isinstance(state.runners.get(runner_id), RunnerReady | RunnerRunning)
            own = runner_unallocated_bytes(shard, tokens) if ready else runner_bytes(shard, tokens)
            draft = _draft_promise(instance, node_id, tokens, ready)
            promised[node_id].append(own + draft)
        spare_draft = instance.draft
        if (
            spare_draft is not None
            and spare_draft.runner is not None
            and spare_draft.model_card is not None
            and spare_draft.node_id in promised
        ):
            tokens = instance.kv_cache_tokens or planned_kv_cache_tokens(
                state.node_info[spare_draft.node_id].kv_cache_tokens, spare_draft.model_card
            )
            promised[spare_draft.node_id].append(_draft_runner_promise(instance, state, tokens))
    return {
        node_id: NodeRoom(
            reported_bytes=info.memory.available_bytes,
            promised_bytes=sum(promised[node_id]),
            promised_runners=len(promised[node_id]),
            kv_cache_tokens=info.kv_cache_tokens,
        )
        for node_id, info in state.node_info.items()
    }
