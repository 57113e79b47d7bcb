"""Drafts named for a model that cannot draft for it are left out at placement, saying why
(`drafts.draft_for`, `Instance.draft_left_out`): a catalog draft whose card's vocabulary is
not the target's, the served model itself, and one too large to speed the target up.

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
from exo.shared.models.drafts import DRAFT_MAX_ACTIVE_FRACTION, draft_for
from exo.shared.models.parameter_count import active_parameter_count, decoder_parameter_count
from exo.shared.types.common import ModelId
from exo.shared.types.instances import InstanceDraft
from exo.shared.types.models import MoeGeometry

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


# A tiny Llama with SmolLM2's tokenizer (trial of session 41: about 3.4M parameters, most of
# them the 49,152-row embedding), and a MoE model whose experts in all outweigh the draft
# many times over while a token reads only two of them.
TINY_LLAMA = SMOLLM2.model_copy(
    update={
        "model_id": ModelId("local/tiny-llama-smollm2-tokenizer"),
        "n_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 128,
        "head_dim": None,
        "parameter_count": None,
        "draft_model": None,
        "short_name": None,
    }
)
SPARSE = TINY_LLAMA.model_copy(
    update={
        "model_id": ModelId("local/tiny-moe-smollm2-tokenizer"),
        "architecture": "Qwen3MoeForCausalLM",
        "hidden_size": 512,
        "n_layers": 24,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "moe": MoeGeometry(experts=128, experts_per_token=2, expert_intermediate_size=128),
    }
)


def test_a_draft_not_well_below_the_target_is_left_out_and_previews_say_the_same() -> None:
    assert active_parameter_count(SMOLLM2) > DRAFT_MAX_ACTIVE_FRACTION * active_parameter_count(
        TINY_LLAMA
    )
    cards = {**CARDS, TINY_LLAMA.model_id: TINY_LLAMA}
    refused = draft_for(TINY_LLAMA, NODE_A, "HuggingFaceTB/SmolLM2-135M-Instruct", cards)
    assert isinstance(refused, str)
    assert "135M parameters" in refused and TINY_LLAMA.model_id in refused
    state = linked_state(**{NODE_A: node(8 << 30, draft_model="smollm2:135m")})
    instance = place_instance(TINY_LLAMA, state, INSTANCE_ID, cards=cards)
    assert instance.draft is None
    assert instance.draft_left_out == refused
    previews = [p for p in placement_previews(TINY_LLAMA, state, cards=cards) if p.error is None]
    assert previews
    for preview in previews:
        assert preview.draft is None
        assert preview.draft_left_out == refused


def test_a_moe_target_is_compared_by_its_active_parameters_not_its_total() -> None:
    # Every expert counted, SmolLM2-135M would be under a quarter of it; a token reads 2 of 128.
    assert active_parameter_count(SMOLLM2) < DRAFT_MAX_ACTIVE_FRACTION * decoder_parameter_count(
        SPARSE
    )
    refused = draft_for(SPARSE, NODE_A, "smollm2:135m", {**CARDS, SPARSE.model_id: SPARSE})
    assert isinstance(refused, str)
    assert "active" in refused


def test_catalog_drafts_are_well_below_their_targets() -> None:
    # Every card's own draft, and the one-tokenizer pairs above, keep drafting.
    for card in CARDS.values():
        if card.draft_model is not None:
            assert isinstance(draft_for(card, NODE_A, None, CARDS), InstanceDraft), card.model_id
    target = CARDS[ModelId("HuggingFaceTB/SmolLM2-1.7B-Instruct")]
    assert isinstance(draft_for(target, NODE_A, "smollm2:135m", CARDS), InstanceDraft)
