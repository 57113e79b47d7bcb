"""Which catalog model a client's model name means."""

from __future__ import annotations

import pytest

from exo.shared.models.cards import UnknownModelError, load_builtin_cards, resolve_card
from exo.shared.models.names import resolve_model_name
from exo.shared.types.common import ModelId

CARDS = load_builtin_cards()
SMOLLM2 = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
QWEN3 = ModelId("Qwen/Qwen3-0.6B")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("HuggingFaceTB/SmolLM2-135M-Instruct", SMOLLM2),
        ("huggingfacetb/smollm2-135m-instruct", SMOLLM2),
        ("HuggingFaceTB/SmolLM2-135M-Instruct:latest", SMOLLM2),
        ("smollm2:135m", SMOLLM2),
        ("smollm2-135m", SMOLLM2),
        ("smollm2:135m:latest", SMOLLM2),
        ("SmolLM2-135M-Instruct", SMOLLM2),
        ("qwen3:0.6b", QWEN3),
        ("qwen3-0.6b", QWEN3),
        ("Qwen3-0.6B", QWEN3),
        ("qwen2.5-coder:7b", ModelId("Qwen/Qwen2.5-Coder-7B-Instruct")),
        ("llama3.2-1b", ModelId("meta-llama/Llama-3.2-1B-Instruct")),
        ("deepseek-r1:8b", ModelId("deepseek-ai/DeepSeek-R1-Distill-Llama-8B")),
        ("gemma3:27b", ModelId("google/gemma-3-27b-it")),
    ],
)
def test_names_resolve_to_the_catalog_id(name: str, expected: ModelId) -> None:
    assert resolve_model_name(name, CARDS) == expected
    assert resolve_card(name, CARDS).model_id == expected


@pytest.mark.parametrize("name", ["", "qwen3", "qwen3:0.7b", "smollm2:135", "nope/nope"])
def test_unknown_names_resolve_to_nothing(name: str) -> None:
    assert resolve_model_name(name, CARDS) is None
    with pytest.raises(UnknownModelError):
        resolve_card(name, CARDS)


def test_models_without_a_card_match_exactly() -> None:
    assert resolve_model_name("org/custom", CARDS, ["org/custom"]) == "org/custom"
    assert resolve_model_name("org/custom:latest", CARDS, ["org/custom"]) == "org/custom"
    assert resolve_model_name("ORG/custom", CARDS, ["org/custom"]) is None
