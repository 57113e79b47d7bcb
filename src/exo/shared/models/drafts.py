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
A named draft that cannot draft for the target is left out, saying why (the reason becomes
`Instance.draft_left_out`, the instance served without it): the target itself (it would
read the target's weights twice per token to save none), or a catalog model whose card's
vocabulary is not the target's (`vocabulary_mismatch`: its tokens would be other text, and
the runner would refuse it at load), or a catalog model too large to speed the target up
(`draft_too_large`: more than `DRAFT_MAX_ACTIVE_FRACTION` of the target's active
parameters). A directory has no card here: its runner checks the tokenizers themselves
and, refused, serves the target without it (`draft_model.check_same_vocabulary`); its size
is not checked.

Where it runs is placement's (`exo.master.group_layout`): in a draft runner of its own on a
spare node with room (`InstanceDraft.runner`, `placement_memory.draft_runner_bytes`), else
in the rank-0 runner's process beside the target, which then needs that node's memory
(`exo.master.placement_memory.draft_bytes`); where it fits nowhere, the instance is placed
without it and says why (`Instance.draft_left_out`) rather than not placed.
"""

from __future__ import annotations

from collections.abc import Mapping

from exo.shared.models.names import resolve_model_name
from exo.shared.models.parameter_count import active_parameter_count, human_parameter_count
from exo.shared.parallelism import parallelism
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.instances import InstanceDraft, Sharding
from exo.shared.types.models import ModelCard

# How far apart (a share of the larger) two cards' `vocab_size` may be and still be one
# tokenizer: output layers are padded to a multiple of 64-256 rows (`vocabulary_mismatch`),
# well under 1 %; tokenizers of different families differ by far more.
VOCABULARY_PADDING_FRACTION = 0.01

# The most a draft's active parameters may be of its target's (a MoE target's active ones:
# a step reads only its routed experts). A round of k draft tokens costs k draft steps, each
# about this share of a target step on a memory-bound CPU, and yields
# (1 - a^(k+1)) / (1 - a) tokens (`speculative_policy.expected_tokens`): at 1/4 and k = 4 the
# drafts cost one target step, so at acceptance 0.8 (3.4 tokens) a round is at best ~1.7x
# plain and at 0.5 (1.9 tokens) ~0.97x, before verification's extra rows. Measured: a
# 135M draft (1/13 of its 1.7B target) gave 1.04x at 0.5 and 1.97x at 0.8
# (docs/benchmarks/2026-12-07-speculative-zen4.md); a 0.8B draft (1/5) made a 4B target
# 1.48x slower on a 4-core CPU (issue 43); a 135M draft for a 3M-parameter target ran it
# 10-400x slower (trial of session 41: the case this bound leaves out).
DRAFT_MAX_ACTIVE_FRACTION = 0.25


def draft_option_problem(name: str) -> str | None:
    """Why a node's `--draft-model name` can never name a draft, or None: it is neither a
    built-in catalog model by any of its names nor a loadable model directory on this
    node. Both are known at start-up (the catalog ships with exo; the directory is this
    node's), and nothing else resolves a draft: placement (`draft_for`) takes an unknown
    name for a directory on rank 0's node, and its runner resolves it against the built-in
    catalog or the disk only (`draft_model.draft_model_directory`), never the Hub. So a
    name that fails here is a flag error, not something to find out at the first load.
    """
    from exo.shared.models.cards import UnknownModelError, load_builtin_cards, resolve_card

    try:
        resolve_card(name, load_builtin_cards())
    except UnknownModelError:
        return (
            f"--draft-model {name!r} names no catalog model and no model directory on this "
            "node (a draft model is a catalog model by any of its names, see GET /models, or "
            "a directory with config.json, *.safetensors and a tokenizer)"
        )
    except ValueError as error:  # a directory that holds no loadable model
        return f"--draft-model {name!r}: {error}"
    return None


def draft_runs_on(sharding: Sharding, world_size: int) -> bool:
    """Whether an instance of this kind drafts with a draft model in its rank 0's runner
    (the kind's description says: `Parallelism.drafts_in_rank_zero`)."""
    return parallelism(sharding).drafts_in_rank_zero(world_size)


def vocabulary_mismatch(card: ModelCard, draft_card: ModelCard) -> str | None:
    """Why `draft_card` cannot draft for `card` by their cards' vocabularies, or None.

    Cards give `vocab_size`, the length of the output layer, which checkpoints of one
    tokenizer pad differently for their kernels (Qwen2.5-Coder 1.5B 151,936 and 7B 152,064
    tokens; Gemma 3 1B 262,144 and 4B 262,208): sizes within `VOCABULARY_PADDING_FRACTION`
    of each other may be one tokenizer (the runner compares the tokenizers themselves at
    load), sizes further apart never are (SmolLM2 49,152 against Gemma 3 262,144).
    """
    smaller, larger = sorted((card.vocab_size, draft_card.vocab_size))
    if larger - smaller <= VOCABULARY_PADDING_FRACTION * larger:
        return None
    return (
        f"draft model {draft_card.model_id} left out: its vocabulary ({draft_card.vocab_size} "
        f"tokens) is not {card.model_id}'s ({card.vocab_size} tokens); a draft model needs "
        "the served model's tokenizer"
    )


def draft_too_large(card: ModelCard, draft_card: ModelCard) -> str | None:
    """Why `draft_card` is too large to speed `card` up, or None: its active parameters
    (`active_parameter_count`, from the cards' shapes) are more than
    `DRAFT_MAX_ACTIVE_FRACTION` of the target's."""
    target = active_parameter_count(card)
    draft = active_parameter_count(draft_card)
    if draft <= DRAFT_MAX_ACTIVE_FRACTION * target:
        return None
    active = " active" if card.moe is not None else ""
    return (
        f"draft model {draft_card.model_id} left out: it has {human_parameter_count(draft)} "
        f"parameters, more than {DRAFT_MAX_ACTIVE_FRACTION:g} of {card.model_id}'s "
        f"{human_parameter_count(target)}{active}; a draft that large costs more time than "
        "its accepted tokens save"
    )


def draft_for(
    card: ModelCard,
    node_id: NodeId,
    node_option: str | None,
    cards: Mapping[ModelId, ModelCard],
) -> InstanceDraft | str | None:
    """The draft model an instance of `card` whose rank 0 runs on `node_id` would use
    (the module docstring's rule), why the one named cannot draft for it, or None.

    Args:
        node_option: that node's `--draft-model` (`NodeInfo.draft_model`), None if unset.
        cards: the catalog by id (the card's `draft_model` and a node option resolve here;
            the runner resolves a draft in the catalog too, `draft_model_directory`).

    Returns:
        The draft with its card where one resolves; a string (`Instance.draft_left_out`)
        where the draft named is the target itself, has another vocabulary or is too large
        to speed it up (`draft_too_large`); None where
        none is named (or a card's draft is in no catalog, as the catalog's test forbids),
        and for a model that does not generate text.
    """
    if "text" not in card.capabilities:
        return None
    if node_option:
        resolved = resolve_model_name(node_option, cards)
        if resolved is None:  # a directory on that node, which only it can read
            if node_option == card.model_id:
                return _itself(card)
            return InstanceDraft(
                model_id=ModelId(node_option), node_id=node_id, chosen_by="node_option"
            )
        named = InstanceDraft(
            model_id=resolved, node_id=node_id, chosen_by="node_option", model_card=cards[resolved]
        )
        return _usable(card, named)
    if card.draft_model is None:
        return None
    if card.draft_model == card.model_id:
        return _itself(card)
    from_card = cards.get(card.draft_model)
    if from_card is None:
        return None
    named = InstanceDraft(
        model_id=from_card.model_id, node_id=node_id, chosen_by="card", model_card=from_card
    )
    return _usable(card, named)


def _itself(card: ModelCard) -> str:
    return (
        f"draft model {card.model_id} left out: it is the served model itself (a model "
        "cannot draft for itself)"
    )


def _usable(card: ModelCard, draft: InstanceDraft) -> InstanceDraft | str:
    """`draft` (which has a card), or why it cannot draft for `card`."""
    assert draft.model_card is not None
    if draft.model_id == card.model_id:
        return _itself(card)
    return (
        vocabulary_mismatch(card, draft.model_card)
        or draft_too_large(card, draft.model_card)
        or draft
    )
