"""What a runner reports against its card at load (`card_mismatches`): each fact the model's
own files state otherwise, from a multimodal config's text part too; a card declaring no
tool-call training is not contradicted by the format exo prompts it with."""

from __future__ import annotations

from exo.shared.models.profile import card_mismatches
from exo.testing.builders import make_card

CARD = make_card(n_layers=4).model_copy(update={"tool_call_format": "hermes"})


def config_of(card_update: dict[str, object] | None = None) -> dict[str, object]:
    card = CARD.model_copy(update=card_update or {})
    return {
        "num_hidden_layers": card.n_layers,
        "hidden_size": card.hidden_size,
        "num_attention_heads": card.num_attention_heads,
        "num_key_value_heads": card.num_key_value_heads,
        "intermediate_size": card.intermediate_size,
        "vocab_size": card.vocab_size,
        "max_position_embeddings": card.context_length,
        "tie_word_embeddings": card.tie_word_embeddings,
    }


def test_a_card_that_agrees_reports_nothing() -> None:
    assert card_mismatches(CARD, config_of(), "hermes") == ()
    assert card_mismatches(CARD, {"text_config": config_of()}, "hermes") == ()


def test_each_contradicted_fact_is_one_line() -> None:
    config = {**config_of(), "num_key_value_heads": CARD.num_key_value_heads * 2}
    config["max_position_embeddings"] = CARD.context_length // 2
    config["tie_word_embeddings"] = not CARD.tie_word_embeddings
    found = card_mismatches(CARD, {"text_config": config}, "mistral")
    assert found == (
        f"num_key_value_heads: card {CARD.num_key_value_heads}, config.json "
        f"{CARD.num_key_value_heads * 2}",
        f"tie_word_embeddings: card {CARD.tie_word_embeddings}, config.json "
        f"{not CARD.tie_word_embeddings}",
        f"context_length: card {CARD.context_length}, config.json max_position_embeddings "
        f"{CARD.context_length // 2}",
        "tool_call_format: card hermes, chat template mistral",
    )


def test_a_shorter_card_context_and_an_untrained_card_are_no_mismatch() -> None:
    shorter = CARD.model_copy(update={"context_length": 2048, "tool_call_format": "none"})
    assert card_mismatches(shorter, config_of(), "generic") == ()
