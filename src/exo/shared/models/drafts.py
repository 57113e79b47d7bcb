"""Which draft model an instance's speculative decoding uses (issue 43), decided at
placement so that its memory is counted, its files fetched and its choice visible in the
state (`Instance.draft`) and the placement previews.

The rule, for a text model placed whole on one node or split (by pipeline, tensor or
expert parallelism: its rank 0 drafts, the split model verifies k + 1 positions in one
step, `draft_runs_on`):
1. the `--draft-model` of the node that would run rank 0 (`NodeInfo.draft_model`), when
   set, overrides the card: a catalog model by any of its names (its card then counts in
   placement, and the node fetches it), else a directory only that node knows (counted by
   nobody; the runner resolves it there, as a custom model is not yet);
2. else the card's `draft_model` (`ModelCard.draft_model`), a catalog model id;
3. else none: n-gram drafts.
A draft naming the target itself is no draft (it would read the target's weights twice
per token to save none).

Where it runs is placement's (`exo.master.group_layout`): in a draft runner of its own on a
spare node with room (`InstanceDraft.runner`, `placement_memory.draft_runner_bytes`), else
in the rank-0 runner's process beside the target, which then needs that node's memory
(`exo.master.placement_memory.draft_bytes`); where it fits nowhere, the instance is placed
without it and says why (`Instance.draft_left_out`) rather than not placed.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.shared.models.names import resolve_model_name
from exo.shared.parallelism import parallelism
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import InstanceDraft, Sharding
from exo.shared.types.models import ModelCard


def draft_runs_on(sharding: Sharding, world_size: int) -> bool:
    """Whether an instance of this kind drafts with a draft model in its rank 0's runner
    (the kind's description says: `Parallelism.drafts_in_rank_zero`)."""
    return parallelism(sharding).drafts_in_rank_zero(world_size)


def draft_for(
    card: ModelCard,
    node_id: NodeId,
    node_option: str | None,
    cards: Mapping[ModelId, ModelCard],
) -> InstanceDraft | None:
    """The draft model an instance of `card` whose rank 0 runs on `node_id` would use
    (the module docstring's rule), or None.

    Args:
        node_option: that node's `--draft-model` (`NodeInfo.draft_model`), None if unset.
        cards: the catalog by id (the card's `draft_model` and a node option resolve here;
            the runner resolves a draft in the catalog too, `draft_model_directory`).

    Returns:
        The draft with its card where one resolves (a card's draft that is in no catalog:
        None, as the catalog's test forbids).
    """
    if "text" not in card.capabilities:
        return None
    if node_option:
        resolved = resolve_model_name(node_option, cards)
        if resolved is None:  # a directory on that node, which only it can read
            if node_option == card.model_id:
                return None
            return InstanceDraft(
                model_id=ModelId(node_option), node_id=node_id, chosen_by="node_option"
            )
        if resolved == card.model_id:
            return None
        return InstanceDraft(
            model_id=resolved, node_id=node_id, chosen_by="node_option", model_card=cards[resolved]
        )
    if card.draft_model is None or card.draft_model == card.model_id:
        return None
    from_card = cards.get(card.draft_model)
    if from_card is None:
        return None
    return InstanceDraft(
        model_id=from_card.model_id, node_id=node_id, chosen_by="card", model_card=from_card
    )
