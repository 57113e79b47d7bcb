"""Embeddings and rerank scores through the engine's real loading path against
transformers' own forward on the same tiny random-weight checkpoints (float32):
Qwen3-Embedding's last-token pooling, a chat model's mean pooling, Qwen3-Reranker's yes/no
softmax; a batch equals its inputs run alone. Exo's own forward (the lean step, where the
loaded model has one) against the transformers-forward fallback over the same loaded
modules, and with int4 weights against the generation prefill's own states and logits; a
running generation and the serving KV cache are untouched by embedding calls."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.embedding import lean_states
from exo.worker.engines.torch.embedding.decoder import (
    RERANK_INSTRUCTION,
    RERANK_PREFIX,
    RERANK_SUFFIX,
)
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.direct_forward import LEAN_ENV
from exo.worker.engines.torch.model.direct_forward_parts import norm_weight

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


def test_chat_model_mean_pooling_equals_transformers(qwen3_dir: Path) -> None:
    """A chat card (no "embedding" capability) embeds by mean pooling."""
    card = card_from_local_directory(qwen3_dir)
    assert "text" in card.capabilities and "embedding" not in card.capabilities
    backend = _engine(qwen3_dir, card).embedding_backend()
    assert backend.pooling == "mean"
    ids = backend.tokenize(TEXTS)
    ours = backend.embed(ids)
    reference = AutoModelForCausalLM.from_pretrained(qwen3_dir, torch_dtype=torch.float32)
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
    with pytest.raises(ValueError, match="split across nodes: place one on a single node"):
        tiny_engine.embedding_backend()


# A ragged batch: lengths 1 to a few dozen tokens (token ids, so every length is exact).
RAGGED = [[17], [5, 9, 300, 41, 77, 12, 8], list(range(100, 140)), [7, 7, 7], [2, 999, 31, 4]]


def _prefill_states(engine: TorchEngine, ids: list[int]) -> torch.Tensor:
    """`[len(ids), hidden]` the final norm's states of one prompt through the model's lean
    step as a generation's prefill runs it (its own slot of a real, per-layer
    `SlotKVCache`), float32 keys and values."""
    step = lean_step_of(engine.model)
    assert step is not None
    text_config = engine.model.config.get_text_config()
    geometry = kv_geometry_of_config(text_config, text_config.num_hidden_layers)
    cache = SlotKVCache(
        geometry.layers, geometry.kv_heads, geometry.head_dim, torch.float32, engine.device, 1
    )
    slot = cache.allocate()
    windows = [None] * geometry.layers
    plan = BatchPlan(cache, windows, [], [], [PrefillSegment(slot, 0, 0, len(ids))], {})
    plan.prepare(engine.device)
    residual = step(plan, torch.tensor(ids), None, torch.arange(len(ids)), None)
    weight, eps = norm_weight(engine.model.model.norm, 0.0)  # Qwen3: no norm offset
    return torch.nn.functional.rms_norm(residual, (residual.shape[-1],), weight, eps)


def _card(directory: Path, **update: Any) -> ModelCard:
    return card_from_local_directory(directory).model_copy(update=update)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """Gemma 3: sliding-window layers (a window of 8 tokens, shorter than some inputs), the
    `1 + weight` final norm and the scaled embedding."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", real_model_dir, 2)


# Gemma 3 (sliding-window layers) marked slow: Qwen3 is the default run's decoder family.
@pytest.mark.parametrize(
    ("family", "pooling"),
    [("qwen3", "last"), ("qwen3", "mean"), pytest.param("gemma3", "mean", marks=pytest.mark.slow)],
)
def test_exo_forward_equals_the_transformers_forward_path(
    request: pytest.FixtureRequest, family: str, pooling: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The lean step (exo's forward) against transformers' forward over the same loaded
    modules (`EXO_LEAN_FORWARD=0`, the fallback), float32: each input alone and a ragged
    batch, cosine within 1e-5."""
    directory: Path = request.getfixturevalue(f"{family}_dir")
    card = _card(directory, capabilities=("embedding",), embedding_pooling=pooling)
    ours = _engine(directory, card).embedding_backend()
    monkeypatch.setenv(LEAN_ENV, "0")
    fallback = _engine(directory, card).embedding_backend()
    assert ours.runs_exo_forward and not fallback.runs_exo_forward
    batch = ours.embed(RAGGED)
    expected = fallback.embed(RAGGED)
    assert _cosine(batch, expected) > 1 - 1e-5
    torch.testing.assert_close(batch, expected, atol=1e-4, rtol=1e-4)
    alone = torch.cat([ours.embed([row]) for row in RAGGED])
    assert _cosine(alone, expected) > 1 - 1e-5
    torch.testing.assert_close(batch, alone, atol=1e-5, rtol=1e-5)
    # Segment by segment through the scratch cache (long inputs' path) as in one padded call.
    monkeypatch.setattr(lean_states, "WHOLE_INPUTS_LONGEST", 0)
    torch.testing.assert_close(ours.embed(RAGGED), batch, atol=1e-5, rtol=1e-5)
    # Different inputs differ: the agreement above is not one of a degenerate model.
    assert _cosine(batch[:1], batch[1:2]) < 0.999


def test_exo_forward_rerank_equals_the_transformers_forward_path(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    card = _card(qwen3_dir, capabilities=("rerank",))
    pairs = [("What is the capital of China?", document) for document in [*TEXTS, "x"]]
    ours = _engine(qwen3_dir, card).embedding_backend()
    monkeypatch.setenv(LEAN_ENV, "0")
    fallback = _engine(qwen3_dir, card).embedding_backend()
    scores, expected = ours.score_pairs(pairs), fallback.score_pairs(pairs)
    assert scores is not None and expected is not None
    torch.testing.assert_close(scores, expected, atol=1e-4, rtol=0)
    alone = torch.cat([cast(torch.Tensor, ours.score_pairs([pair])) for pair in pairs])
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=0)


def test_int4_embeddings_equal_exo_generation_prefill_states(qwen3_dir: Path) -> None:
    """int4 weights: a ragged batch's pooled vectors equal the final-norm states the
    generation prefill computes for each input alone (the same kernels over the same
    quantized weights; only summation order may differ), cosine within 1e-5; and the
    reranker's P("yes") equals the one from the generation step's own logits
    (`forward_batch`) within 1e-4."""
    shard_card = _card(qwen3_dir, capabilities=("embedding", "rerank"), embedding_pooling="last")
    shard = ShardMetadata(
        sharding="pipeline", model_card=shard_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=shard_card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(qwen3_dir, shard, weight_dtype="int4")
    backend = engine.embedding_backend()
    assert backend.runs_exo_forward
    prefill = [_prefill_states(engine, row) for row in RAGGED]
    last = backend.embed(RAGGED)
    assert _cosine(last, torch.stack([states[-1] for states in prefill])) > 1 - 1e-5
    backend.pooling = "mean"
    mean = backend.embed(RAGGED)
    assert _cosine(mean, torch.stack([states.mean(0) for states in prefill])) > 1 - 1e-5

    pairs = [("What is the capital of China?", document) for document in TEXTS]
    scores = backend.score_pairs(pairs)
    assert scores is not None
    tokenizer = AutoTokenizer.from_pretrained(qwen3_dir)
    no, yes = tokenizer.convert_tokens_to_ids("no"), tokenizer.convert_tokens_to_ids("yes")
    text_config = engine.model.config.get_text_config()
    expected = []
    for query, document in pairs:
        text = (
            f"{RERANK_PREFIX}<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n"
            f"<Document>: {document}{RERANK_SUFFIX}"
        )
        ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
        length = ids.shape[1]
        cache = SlotKVCache(
            text_config.num_hidden_layers, text_config.num_key_value_heads,
            text_config.head_dim, torch.float32, engine.device, 1,
        )  # fmt: skip
        plan = BatchPlan(
            cache, [None] * text_config.num_hidden_layers, [], [],
            [PrefillSegment(cache.allocate(), 0, 0, length)], {},
        )  # fmt: skip
        logits = forward_batch(
            engine.model, plan, ids, torch.arange(length)[None], torch.tensor([length - 1])
        )[0]
        expected.append(torch.softmax(torch.stack([logits[no], logits[yes]]), dim=0)[1])
    torch.testing.assert_close(scores, torch.stack(expected), atol=1e-4, rtol=0)


def test_embeddings_leave_the_serving_cache_and_running_generations_alone(
    qwen3_dir: Path,
) -> None:
    """Embedding and rerank calls between the steps of a running generation: its greedy
    tokens are those it gives alone, and the serving KV cache holds the same slots and
    positions before and after each call (the inputs' keys and values went to a scratch
    cache)."""
    card = _card(qwen3_dir, capabilities=("embedding", "rerank"), embedding_pooling="last")
    engine = _engine(qwen3_dir, card)
    backend = engine.embedding_backend()
    params = TextGenerationTaskParams(
        model=ModelId(card.model_id), prompt="The capital of France is", max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    alone = [token for piece in engine.generate(params) for token in piece.token_ids]
    engine.clear_prefix_cache()
    handle = engine.submit(params)
    tokens: list[int] = []
    for _ in range(40):
        cache = engine.scheduler._cache
        before = (cache.occupied, list(cache.lengths), engine.kv_cache_usage())
        backend.embed(RAGGED)
        backend.score_pairs([("q", "a document")])
        assert (cache.occupied, list(cache.lengths), engine.kv_cache_usage()) == before
        finished = False
        for request_id, output in engine.step():
            assert request_id == handle.request_id and not isinstance(output, Exception)
            tokens += output.token_ids
            finished = output.finish_reason is not None
        if finished:
            break
    assert tokens == alone and len(alone) == 8
