"""Drafts named for a model that cannot draft for it are left out at placement, saying why
(`drafts.draft_for`, `Instance.draft_left_out`): a catalog draft whose card's vocabulary is
not the target's, and the served model itself.

Trial 38 (2026-12-07) found a node's `--draft-model HuggingFaceTB/SmolLM2-135M-Instruct`
(49,152 tokens) given to `gemma3:270m-base` (262,144): the runner loaded both, refused the
draft, failed the instance three times and the client got a 503 after 2 min 42 s; and
`--draft-model` naming the served model itself was dropped with no reason given.
"""

from __future__ import annotations

from exo.master.placement import place_instance, placement_previews
from exo.master.tests.test_draft_placement import (
    CARDS,
    INSTANCE_ID,
    NODE_A,
    NODE_B,
    linked_state,
    node,
)
from exo.shared.models.drafts import draft_for
from exo.shared.types.common import ModelId
from exo.shared.types.instances import InstanceDraft

GEMMA = CARDS[ModelId("google/gemma-3-270m")]
SMOLLM2 = CARDS[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]


def test_a_draft_with_another_vocabulary_is_not_chosen_and_the_reason_names_both_sizes() -> None:
    assert GEMMA.vocab_size != SMOLLM2.vocab_size
    refused = draft_for(GEMMA, NODE_A, "HuggingFaceTB/SmolLM2-135M-Instruct", CARDS)
    assert isinstance(refused, str)
    assert "vocabulary" in refused and SMOLLM2.model_id in refused and GEMMA.model_id in refused
    assert "49152 tokens" in refused and "262144 tokens" in refused
    # The card's own draft is checked alike.
    named_by_card = GEMMA.model_copy(update={"draft_model": SMOLLM2.model_id})
    assert isinstance(draft_for(named_by_card, NODE_A, None, CARDS), str)


def test_checkpoints_of_one_tokenizer_padded_differently_still_draft() -> None:
    # Gemma 3 270M (262,144 rows) for Gemma 3 27B (262,208); Qwen2.5-Coder 1.5B (151,936)
    # for 7B (152,064): one tokenizer each, output layers padded to other multiples.
    gemma_27b = CARDS[ModelId("google/gemma-3-27b-it")]
    coder_7b = CARDS[ModelId("Qwen/Qwen2.5-Coder-7B-Instruct")]
    for target, option in ((gemma_27b, "gemma3:270m"), (coder_7b, "qwen2.5-coder:1.5b")):
        draft = draft_for(target, NODE_A, option, CARDS)
        assert isinstance(draft, InstanceDraft), (target.model_id, draft)
        assert draft.model_card is not None
        assert draft.model_card.vocab_size != target.vocab_size


def test_the_instance_is_placed_without_it_saying_why_and_previews_say_the_same() -> None:
    state = linked_state(**{NODE_A: node(8 << 30, draft_model="smollm2:135m")})
    instance = place_instance(GEMMA, state, INSTANCE_ID, cards=CARDS)
    assert instance.draft is None
    assert instance.draft_left_out is not None
    assert "49152 tokens" in instance.draft_left_out
    assert "262144 tokens" in instance.draft_left_out
    for preview in placement_previews(GEMMA, state, cards=CARDS):
        if preview.error is None:
            assert preview.draft is None
            assert preview.draft_left_out == instance.draft_left_out


def test_a_draft_that_is_the_served_model_itself_is_left_out_saying_so() -> None:
    for option in ("gemma3:270m-base", "google/gemma-3-270m"):
        state = linked_state(**{NODE_A: node(8 << 30, draft_model=option)})
        instance = place_instance(GEMMA, state, INSTANCE_ID, cards=CARDS)
        assert instance.draft is None
        assert instance.draft_left_out is not None
        assert "served model itself" in instance.draft_left_out
    assert isinstance(draft_for(GEMMA, NODE_A, "gemma3:270m-base", CARDS), str)
    itself = GEMMA.model_copy(update={"draft_model": GEMMA.model_id})
    assert isinstance(draft_for(itself, NODE_A, None, CARDS), str)


def test_a_node_whose_draft_cannot_serve_the_model_is_not_passed_over_for_it() -> None:
    # A draft no layout could keep is no reason to prefer another node: the node with the
    # most memory takes the model, as it would with no draft named.
    state = linked_state(
        **{
            NODE_A: node(8 << 30, draft_model="smollm2:135m"),
            NODE_B: node(4 << 30, name="b"),
        }
    )
    instance = place_instance(GEMMA, state, INSTANCE_ID, cards=CARDS)
    assert instance.shard_assignments.node_to_runner.keys() == {NODE_A}
    assert instance.draft_left_out is not None
