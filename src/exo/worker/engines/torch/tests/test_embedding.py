"""Embeddings and rerank scores through the engine's real loading path against
transformers' own forward on the same tiny random-weight checkpoints (float32):
Qwen3-Embedding's last-token pooling, a chat model's mean pooling, Qwen3-Reranker's yes/no
softmax; a batch equals its inputs run alone."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.embedding.decoder import (
    RERANK_INSTRUCTION,
    RERANK_PREFIX,
    RERANK_SUFFIX,
)
from exo.worker.engines.torch.engine import TorchEngine

TEXTS = ["The capital of France is Paris.", "hi", "Gravity pulls two bodies together."]


def _engine(directory: Path, card: ModelCard) -> TorchEngine:
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(directory, shard, weight_dtype="float32")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", real_model_dir, 2)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


def test_qwen3_embedding_last_token_pooling_equals_transformers(qwen3_dir: Path) -> None:
    card = card_from_local_directory(qwen3_dir).model_copy(
        update={"capabilities": ("embedding",), "embedding_pooling": "last"}
    )
    backend = _engine(qwen3_dir, card).embedding_backend()
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    end = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = backend.tokenize(TEXTS)
    assert all(row[-1] == end for row in ids)
    ours = backend.embed(ids)
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        expected = torch.stack(
            [reference.model(input_ids=torch.tensor([row])).last_hidden_state[0, -1] for row in ids]
        )
    assert ours.shape == (len(TEXTS), card.hidden_size)
    assert _cosine(ours, expected) > 1 - 1e-5
    # One batch (padded to the longest) equals each input alone.
    alone = torch.cat([backend.embed([row]) for row in ids])
    torch.testing.assert_close(ours, alone, atol=1e-5, rtol=1e-5)


def test_chat_model_mean_pooling_equals_transformers(
    tiny_engine: TorchEngine, tiny_model_dir: Path
) -> None:
    backend = tiny_engine.embedding_backend()
    assert backend.pooling == "mean"
    ids = backend.tokenize(TEXTS)
    ours = backend.embed(ids)
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        expected = torch.stack(
            [
                reference.model(input_ids=torch.tensor([row])).last_hidden_state[0].mean(0)
                for row in ids
            ]
        )
    assert _cosine(ours, expected) > 1 - 1e-5


def test_qwen3_reranker_scores_equal_transformers_yes_no_softmax(qwen3_dir: Path) -> None:
    card = card_from_local_directory(qwen3_dir).model_copy(update={"capabilities": ("rerank",)})
    backend = _engine(qwen3_dir, card).embedding_backend()
    query = "What is the capital of China?"
    documents = ["The capital of China is Beijing.", "Gravity is a force.", "x"]
    ours = backend.score_pairs([(query, document) for document in documents])
    assert ours is not None
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    no = tokenizer.convert_tokens_to_ids("no")
    yes = tokenizer.convert_tokens_to_ids("yes")
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32)
    expected = []
    for document in documents:
        text = (
            f"{RERANK_PREFIX}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{RERANK_SUFFIX}"
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = reference(input_ids=ids).logits[0, -1]
        expected.append(torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1])
    torch.testing.assert_close(ours, torch.stack(expected), atol=1e-4, rtol=0)
    # A model that is not a reranker scores nothing.
    plain = card.model_copy(update={"capabilities": ("embedding",)})
    assert _engine(qwen3_dir, plain).embedding_backend().score_pairs([(query, "x")]) is None


def test_a_bare_decoder_checkpoint_loads_as_its_causal_lm(qwen3_dir: Path, tmp_path: Path) -> None:
    """sentence-transformers saves Qwen3-Embedding as the bare decoder (`layers.0...`, no
    `model.` and no LM head): it loads, and embeds as the full checkpoint does."""
    import shutil

    from safetensors.torch import load_file, save_file

    bare = tmp_path / "bare"
    shutil.copytree(qwen3_dir, bare)
    (checkpoint,) = bare.glob("*.safetensors")
    tensors = load_file(checkpoint)
    save_file(
        {
            name.removeprefix("model."): tensor
            for name, tensor in tensors.items()
            if not name.startswith("lm_head.")
        },
        checkpoint,
        metadata={"format": "pt"},
    )
    card = card_from_local_directory(qwen3_dir).model_copy(
        update={"capabilities": ("embedding",), "embedding_pooling": "last"}
    )
    full = _engine(qwen3_dir, card).embedding_backend()
    headless = _engine(bare, card).embedding_backend()
    ids = full.tokenize(TEXTS)
    torch.testing.assert_close(headless.embed(ids), full.embed(ids), atol=1e-6, rtol=1e-6)


def test_a_rank_of_a_split_instance_refuses_embeddings(tiny_engine: TorchEngine) -> None:
    """Pooling needs the final norm's states of the whole model on one rank: a split
    instance's rank 0 refuses (the runner answers the request with a 400)."""
    tiny_engine.group = cast(Any, object())
    with pytest.raises(ValueError, match="split across nodes"):
        tiny_engine.embedding_backend()
