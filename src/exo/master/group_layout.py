"""The layout of one group of nodes for a model (`layout`): the nodes in rank order (rank 0
reachable by every other), each rank's layers and memory, the instance's KV-cache budget,
rank 0's draft model, and the addresses the ranks meet on; or why that group cannot run it.

Apart from `placement` (which groups to try, which layout to prefer, the instance it
becomes) because this is the arithmetic of one group, the rules `placement`'s docstring
lists applied to it: memory (`placement_memory`), layer splits (`layer_split`) and the
draft model (`exo.shared.models.drafts`).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exo.master.layer_split import PlacementError, layer_split, speed_balanced_split
from exo.master.placement_memory import (
    NodeRoom,
    draft_bytes,
    draft_runner_bytes,
    memory_sized_kv_cache_tokens,
    placement_room,
    required_memory_bytes,
    share_runner_bytes,
)
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.drafts import draft_for, draft_runs_on
from exo.shared.models.memory import RUNNER_PROCESS_OVERHEAD_BYTES, vision_tower_loading_bytes
from exo.shared.parallelism import parallelism
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import InstanceDraft, Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.state import State

# A spare node drafts when its measured int4 decode is at least this share of rank 0's
# node's: speed probes of equal nodes differ by up to ~20 % (docs/benchmarks: the VMs swing
# that much), so equal nodes must not flip the choice between placements.
DRAFT_SPARE_MIN_SPEED = 0.8


@dataclass(frozen=True, slots=True)
class Layout:
    """A valid placement before ids are given: nodes in rank order and their shares."""

    nodes: tuple[NodeId, ...]
    layer_ranges: tuple[tuple[int, int], ...]
    bytes_per_node: tuple[int, ...]
    rendezvous_addresses: dict[NodeId, str]
    kv_cache_tokens: int
    """The instance's KV-cache budget (`Instance.kv_cache_tokens`)."""
    draft: InstanceDraft | None = None
    """Its draft model (`Instance.draft`), counted in rank 0's `bytes_per_node`."""
    draft_left_out: str | None = None
    """Why a draft model named for it is not used (`Instance.draft_left_out`)."""
    draft_unusable: bool = False
    """The draft named cannot draft for this model in any layout (`drafts.draft_for`'s
    reason, in `draft_left_out`): no layout would keep it, so placement's preference for
    layouts that keep their draft does not count it against this one."""
    draft_address: str | None = None
    """Where rank 0's node reaches the draft's node when the draft runs on a spare node
    (`DraftRunner.address`; placement then gives the draft its runner), else None."""
    link_addresses: dict[NodeId, dict[NodeId, str]] = field(default_factory=dict)
    """`Rendezvous.link_addresses`: where each rank other than 0 reaches the others."""


def _edge_address(state: State, source: NodeId, sink: NodeId) -> str | None:
    edge = state.topology.get(source, {}).get(sink)
    return edge.address if edge is not None else None


def _connected(state: State, a: NodeId, b: NodeId) -> bool:
    return _edge_address(state, a, b) is not None or _edge_address(state, b, a) is not None


def _rank_order(
    state: State, room: Mapping[NodeId, NodeRoom], group: Sequence[NodeId]
) -> tuple[NodeId, ...] | str:
    """The group in rank order: most memory first, rank 0 a node every other can reach."""
    ordered = sorted(group, key=lambda n: (-room[n].available_bytes, n))
    if len(ordered) == 1:
        return tuple(ordered)
    for a, b in itertools.combinations(ordered, 2):
        if not _connected(state, a, b):
            return f"nodes {a} and {b} have no measured link"
    for rank_zero in ordered:
        if all(_edge_address(state, n, rank_zero) is not None for n in ordered if n != rank_zero):
            return (rank_zero, *[n for n in ordered if n != rank_zero])
    return "no node of the group is reachable by all the others"


def _own_address(state: State, node_id: NodeId, peer_view: dict[NodeId, str]) -> str:
    # Rank 0 binds on every interface; for itself any address others use to reach it.
    if peer_view:
        return next(iter(peer_view.values()))
    addresses = state.node_info[node_id].api_addresses
    return addresses[0] if addresses else "127.0.0.1"


def _named_draft(
    card: ModelCard,
    state: State,
    rank_zero: NodeId,
    cards: Mapping[ModelId, ModelCard] | None,
) -> InstanceDraft | str | None:
    """The draft model named for an instance of `card` with rank 0 on `rank_zero`, or why
    the one named cannot draft for it (`drafts.draft_for`; `cards` None: the built-in
    catalog, read only when needed)."""
    option = state.node_info[rank_zero].draft_model
    if option is None and card.draft_model is None:
        return None
    catalog = load_builtin_cards() if cards is None else cards
    return draft_for(card, rank_zero, option, catalog)


def layout(
    card: ModelCard,
    state: State,
    sharding: Sharding,
    group: Sequence[NodeId],
    room: Mapping[NodeId, NodeRoom] | None = None,
    cards: Mapping[ModelId, ModelCard] | None = None,
    spares: Sequence[NodeId] = (),
) -> Layout:
    """Shares of `group` for `card`, or why that group cannot run it, with the draft model
    named for it: on a spare node when one of `spares` has room for it and rank 0 reaches
    it (`_draft_on_spare`) and rank 0's node allows it (`NodeInfo.draft_on_spare`), else
    where rank 0's node has room for both (else without it, saying why); without it, saying
    why, where it cannot draft for `card` (the model itself, another vocabulary).

    Args:
        room: the nodes' memory (`placement_room(state)` when None).
        cards: the catalog a draft model resolves in (None: the built-in cards).
        spares: nodes outside the group the draft may run on.

    Raises:
        PlacementError: not connected, not divisible, or some node lacks memory.
    """
    room = placement_room(state) if room is None else room
    order = _rank_order(state, room, group)
    if isinstance(order, str):
        raise PlacementError(order)
    draft = _named_draft(card, state, order[0], cards)
    if draft is None:
        return _layout_in_order(card, state, sharding, order, room)
    if isinstance(draft, str):
        plain = _layout_in_order(card, state, sharding, order, room)
        return dataclasses.replace(plain, draft_left_out=draft, draft_unusable=True)
    if not draft_runs_on(sharding, len(order)):
        plain = _layout_in_order(card, state, sharding, order, room)
        reason = f"draft model {draft.model_id} not used: a {sharding} split does not speculate"
        return dataclasses.replace(plain, draft_left_out=reason)
    if draft.model_card is None:  # a directory only its node knows: not counted
        return dataclasses.replace(
            _layout_in_order(card, state, sharding, order, room), draft=draft
        )
    if spares and state.node_info[order[0]].draft_on_spare:
        plain = _layout_in_order(card, state, sharding, order, room)
        moved = _draft_on_spare(state, room, order[0], draft.model_card,
                                plain.kv_cache_tokens, spares)  # fmt: skip
        if moved is not None:
            node_id, address = moved
            return dataclasses.replace(
                plain, draft=draft.model_copy(update={"node_id": node_id}), draft_address=address
            )
    try:
        return _layout_in_order(card, state, sharding, order, room, draft)
    except PlacementError as error:
        plain = _layout_in_order(card, state, sharding, order, room)
        reason = f"draft model {draft.model_id} left out: {error}"
        if len(order) == 1:  # the room figures of the node itself, not those less the draft
            first = room[order[0]]
            tokens = first.planned_kv_cache_tokens(card)
            both = required_memory_bytes(card, kv_cache_tokens=tokens) + draft_bytes(
                draft.model_card, tokens
            )
            reason = (
                f"draft model {draft.model_id} left out: node {order[0]} has "
                f"{first.describe()}, the model and its draft need {both / 2**20:.0f} MiB"
            )
        return dataclasses.replace(plain, draft_left_out=reason)


def _draft_on_spare(
    state: State,
    room: Mapping[NodeId, NodeRoom],
    rank_zero: NodeId,
    draft_card: ModelCard,
    kv_cache_tokens: int,
    spares: Sequence[NodeId],
) -> tuple[NodeId, str] | None:
    """The spare node a draft model runs on, apart from the target, and the address rank 0's
    node reaches it at; None when no spare has room for it (`draft_runner_bytes` at the
    instance's budget) or a measured link from rank 0.

    Why a spare node first: the draft's weights and KV then take no room from the target's
    node, its forward passes no time from the target's cores, and its server drafts ahead
    while the target verifies (`draft_server`), for one round trip per step (tens of bytes).
    Measured on two cores of one machine (docs/benchmarks/2026-12-06-draft-on-a-spare-node.md)
    it came out 0.92-0.95x the draft in rank 0's process: there the two "nodes" share the
    memory bandwidth the drafting ahead competes for; on two machines they do not (not
    measured). A spare whose measured int4 decode is slower than rank 0's node's is passed
    over (`_drafts_slower`). Among spares: the most available memory, then the node id
    (deterministic on every master)."""
    needed = draft_runner_bytes(draft_card, kv_cache_tokens)
    for node_id in sorted(spares, key=lambda n: (-room[n].available_bytes, n)):
        address = _edge_address(state, rank_zero, node_id)
        if (
            address is not None
            and room[node_id].available_bytes >= needed
            and not _drafts_slower(state, node_id, rank_zero)
        ):
            return node_id, address
    return None


def _drafts_slower(state: State, spare: NodeId, rank_zero: NodeId) -> bool:
    """Whether both nodes measured their int4 decode product (`NodeSpeed`) and the spare's
    is slower (below `DRAFT_SPARE_MIN_SPEED` of rank 0's): drafting is decode (a row per
    request and position, int4 weights), and rank 0 waits for its drafts, so a slower spare
    would slow every step it drafts for. Where either node has no figure (its speed probe
    off or not done yet), it is not slower."""
    spare_speed = state.node_info[spare].speed
    rank_zero_speed = state.node_info[rank_zero].speed
    if spare_speed is None or rank_zero_speed is None:
        return False
    ratio = spare_speed.int4_decode_bytes_per_second / rank_zero_speed.int4_decode_bytes_per_second
    return ratio < DRAFT_SPARE_MIN_SPEED


def _layout_in_order(
    card: ModelCard,
    state: State,
    sharding: Sharding,
    order: tuple[NodeId, ...],
    room: Mapping[NodeId, NodeRoom],
    draft: InstanceDraft | None = None,
) -> Layout:
    """`layout` of the nodes in rank order, with `draft` (which has a card) counted on
    rank 0: its `draft_bytes` at the node's planned budget come off the node's room before
    the target's shares are sized, and at the instance's budget once that is chosen."""
    if draft is not None and draft.model_card is not None:
        first = room[order[0]]
        planned = draft_bytes(draft.model_card, first.planned_kv_cache_tokens(card))
        if planned > first.available_bytes:
            raise PlacementError(
                f"node {order[0]} has {first.describe()}, the draft model alone needs "
                f"{planned / 2**20:.0f} MiB"
            )
        room = {
            **room,
            order[0]: dataclasses.replace(first, reported_bytes=first.reported_bytes - planned),
        }
    world_size = len(order)
    total_available = sum(room[n].available_bytes for n in order)
    # Each further node runs one more runner process.
    smallest_kv_cache = min(room[n].planned_kv_cache_tokens(card) for n in order)
    needed_total = (
        required_memory_bytes(card, kv_cache_tokens=smallest_kv_cache)
        + (world_size - 1) * RUNNER_PROCESS_OVERHEAD_BYTES
    )
    if total_available < needed_total:
        holder = f"the node has {room[order[0]].describe()}"
        if world_size > 1:
            promised = sum(room[n].promised_bytes for n in order)
            holder = f"these {world_size} nodes have {total_available / 2**20:.0f} MiB available"
            if promised:
                holder += f" ({promised / 2**20:.0f} MiB promised to runners already placed)"
        raise PlacementError(
            f"model {card.model_id} needs {needed_total / 2**20:.0f} MiB but {holder}"
        )
    kind = parallelism(sharding)
    error = kind.split_error(card, world_size)
    if error is not None:
        raise PlacementError(error)

    def layer_counts() -> list[int]:
        measured = [state.node_info[n].speed for n in order]
        speeds = [speed for speed in measured if speed is not None]
        if len(speeds) == world_size:
            available = [room[n].available_bytes for n in order]
            kv_cache_tokens = [room[n].planned_kv_cache_tokens(card) for n in order]
            balanced = speed_balanced_split(card, speeds, available, kv_cache_tokens)
            if balanced is not None:
                return balanced
        # In proportion to the memory left for layers beside each runner process (and
        # the vision tower of the rank that runs it, at its loading peak).
        tower = vision_tower_loading_bytes(card)
        for_layers = [
            max(
                0,
                room[n].available_bytes
                - RUNNER_PROCESS_OVERHEAD_BYTES
                - (tower if kind.runs_vision_tower(rank, world_size) else 0),
            )
            for rank, n in enumerate(order)
        ]
        return layer_split(card.n_layers, for_layers)

    ranges = kind.layer_ranges(card.n_layers, world_size, layer_counts)
    weight_shares = [
        kind.weight_share(card, rank, world_size, layer_range)
        for rank, layer_range in enumerate(ranges)
    ]
    for node_id, weight_share in zip(order, weight_shares, strict=True):
        planned = share_runner_bytes(
            card, weight_share, room[node_id].planned_kv_cache_tokens(card)
        )
        if planned > room[node_id].available_bytes:
            raise PlacementError(
                f"node {node_id} would need {planned / 2**20:.0f} MiB for its share but has "
                f"{room[node_id].describe()}"
            )
    # The ranks hold KV for the same tokens: the budget is the smallest any node allows.
    kv_cache_tokens = min(
        memory_sized_kv_cache_tokens(
            card, weight_share, room[node_id].kv_cache_tokens, room[node_id].available_bytes
        )
        for node_id, weight_share in zip(order, weight_shares, strict=True)
    )
    # A node's own --kv-cache-tokens is what it reserves; a memory-sized node the budget.
    shares = tuple(
        share_runner_bytes(card, weight_share, room[node_id].kv_cache_tokens or kv_cache_tokens)
        for node_id, weight_share in zip(order, weight_shares, strict=True)
    )
    if draft is not None and draft.model_card is not None:
        # Now at the instance's budget: the draft holds KV for the texts the target runs.
        with_draft = shares[0] + draft_bytes(draft.model_card, kv_cache_tokens)
        left_for_both = room[order[0]].available_bytes + draft_bytes(
            draft.model_card, room[order[0]].planned_kv_cache_tokens(card)
        )
        if with_draft > left_for_both:
            raise PlacementError(
                f"node {order[0]} would need {with_draft / 2**20:.0f} MiB for the model and "
                f"its draft but has {left_for_both / 2**20:.0f} MiB available"
            )
        shares = (with_draft, *shares[1:])
    rank_zero = order[0]
    peer_view = {n: a for n in order[1:] if (a := _edge_address(state, n, rank_zero)) is not None}
    addresses = {rank_zero: _own_address(state, rank_zero, peer_view), **peer_view}
    links = _link_addresses(state, order[1:])
    return Layout(order, ranges, shares, addresses, kv_cache_tokens, draft, link_addresses=links)


def _link_addresses(state: State, ranks: Sequence[NodeId]) -> dict[NodeId, dict[NodeId, str]]:
    """For each pair of these nodes (ranks other than 0) with a measured link a -> b, the
    address a reaches b at: nodes may reach each other on networks rank 0 is not on (a
    rank's own published address is the one it reaches rank 0 from)."""
    links: dict[NodeId, dict[NodeId, str]] = {}
    for a in ranks:
        for b in ranks:
            if a != b and (address := _edge_address(state, a, b)) is not None:
                links.setdefault(a, {})[b] = address
    return links
