"""Ollama's `details` (`/api/tags`, `/api/show`, `/api/ps`): `parameter_size` writes
billions to one decimal at any size, as Ollama does, so it never reads as a size
contradicting the model's short name; an encoder's `family` is Ollama's name for it."""

from __future__ import annotations

from exo.api.ollama.model_listings import show_response
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.testing.builders import SMOLLM2


def test_parameter_size_writes_billions_to_one_decimal() -> None:
    """gpt-oss:120b's 116,829,156,672 is "116.8B" in Ollama too; a whole "107B" beside the
    name glm-4.5-air:106b (106,852,251,264 counted) read as a second size."""
    cards = load_builtin_cards()
    sizes = {
        "zai-org/GLM-4.5-Air": "106.9B",
        "MiniMaxAI/MiniMax-M2": "228.7B",
        "openai/gpt-oss-120b": "116.8B",
        "meta-llama/Llama-3.1-70B-Instruct": "70.6B",
        "google/gemma-3-4b-it": "4.3B",
        "moonshotai/Kimi-K2-Instruct": "1.0T",
        SMOLLM2: "135M",
        "sentence-transformers/all-MiniLM-L6-v2": "22.7M",
    }
    shown = {
        model_id: show_response(cards[ModelId(model_id)], "", "x", False).details.parameter_size
        for model_id in sizes
    }
    assert shown == sizes


def test_encoder_families_are_ollamas() -> None:
    """Trial 42: the bge reranker's family was "xlmrobertaforsequenceclassification" (the
    architecture lowercased). Ollama lists bge-m3 as "bert" (llama.cpp converts XLM-RoBERTa
    as BERT), nomic-embed-text as "nomic-bert", EmbeddingGemma as "gemma3"."""
    cards = load_builtin_cards()
    families = {
        "sentence-transformers/all-MiniLM-L6-v2": "bert",
        "BAAI/bge-m3": "bert",
        "BAAI/bge-reranker-v2-m3": "bert",
        "nomic-ai/nomic-embed-text-v1.5": "nomic-bert",
        "google/embeddinggemma-300m": "gemma3",
        "google/gemma-3-4b-it": "gemma3",
        SMOLLM2: "llama",
    }
    shown = {
        model_id: show_response(cards[ModelId(model_id)], "", "x", False).details
        for model_id in families
    }
    assert {model_id: details.family for model_id, details in shown.items()} == families
    assert all(details.families == [details.family] for details in shown.values())
