"""Every built-in card is internally consistent: its shapes fit together, the parameter
count they imply matches the count the card states (from its sources), and its names are
unique across the catalog."""

from __future__ import annotations

import pytest

from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.names import card_names, duplicate_names
from exo.shared.models.parameter_count import decoder_parameter_count
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard

CARDS = load_builtin_cards()
SMOLLM2 = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
# Published counts are rounded (0.6B, 14.7B); a shape error moves the count far more.
PARAMETER_COUNT_TOLERANCE = 0.03


def test_the_catalog_spans_the_families_and_sizes() -> None:
    assert len(CARDS) >= 30
    architectures = {card.architecture for card in CARDS.values()}
    assert {
        "LlamaForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "MistralForCausalLM",
        "Mistral3ForConditionalGeneration",
        "Phi3ForCausalLM",
    } <= architectures


@pytest.mark.parametrize("card", CARDS.values(), ids=list(CARDS))
def test_card_shapes_fit_together(card: ModelCard) -> None:
    assert card.num_attention_heads % card.num_key_value_heads == 0
    if card.head_dim is None:
        assert card.hidden_size % card.num_attention_heads == 0
    assert card.sources, "every card names the source of its numbers"
    assert card.short_name is not None
    # An embedding or reranker model (issue 42) serves no chat, and encoders are short:
    # all-MiniLM-L6-v2 has 512 positions.
    if {"embedding", "rerank"} & set(card.capabilities):
        assert "text" not in card.capabilities and card.context_length >= 512
        assert not card.has_chat_template
    else:
        assert "text" in card.capabilities and card.context_length >= 2048
    if card.matryoshka_dimensions:
        assert max(card.matryoshka_dimensions) <= card.hidden_size
    if card.vision_parameter_count:
        assert "vision" in card.capabilities
    # A model trained on a tool format says so, and one with a format has the capability.
    assert ("tools" in card.capabilities) == (card.tool_call_format != "none")
    if card.supports_tensor:
        assert card.num_attention_heads % 2 == card.num_key_value_heads % 2 == 0


@pytest.mark.parametrize("card", CARDS.values(), ids=list(CARDS))
def test_stated_parameter_count_matches_the_shapes(card: ModelCard) -> None:
    assert card.parameter_count is not None
    computed = decoder_parameter_count(card) + card.vision_parameter_count
    drift = abs(computed - card.parameter_count) / card.parameter_count
    assert drift < PARAMETER_COUNT_TOLERANCE, (computed, card.parameter_count)


@pytest.mark.parametrize(
    "card",
    [card for card in CARDS.values() if card.gguf_weight_types is not None],
    ids=[model for model, card in CARDS.items() if card.gguf_weight_types is not None],
)
def test_recorded_gguf_types_cover_exactly_the_layer_linears(card: ModelCard) -> None:
    """A GGUF card's per-type weight counts (copied from the file's tensor directory) add
    up to its shapes' decoder-layer linears: a miscopied count shows here."""
    assert card.gguf_weight_types is not None
    query = card.num_attention_heads * card.attention_head_dim
    key_value = card.num_key_value_heads * card.attention_head_dim
    per_layer = card.hidden_size * (2 * query + 2 * key_value + 3 * card.intermediate_size)
    counted = sum(count for _, count in card.gguf_weight_types.layer_weights)
    assert counted == card.n_layers * per_layer


def test_a_wrong_shape_is_caught() -> None:
    card = CARDS[SMOLLM2]
    for wrong in (
        card.model_copy(update={"intermediate_size": card.intermediate_size * 2}),
        card.model_copy(update={"tie_word_embeddings": not card.tie_word_embeddings}),
        card.model_copy(update={"n_layers": card.n_layers + 4}),
    ):
        computed = decoder_parameter_count(wrong)
        assert card.parameter_count is not None
        assert abs(computed - card.parameter_count) / card.parameter_count > (
            PARAMETER_COUNT_TOLERANCE
        )


def test_names_are_unique_across_the_catalog() -> None:
    assert duplicate_names(CARDS.values()) == {}
    assert all(card_names(card) for card in CARDS.values())


def test_smollm2_counts_exactly() -> None:
    card = CARDS[SMOLLM2]
    assert decoder_parameter_count(card) == card.parameter_count == 134_515_008
