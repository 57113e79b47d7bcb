"""`engine_factory.load_serving_engine` picks `EncoderEngine` for an encoder card and
`TorchEngine` otherwise; the encoder engine embeds as its backend does, reports no KV cache,
refuses generation with a ValueError naming the capability (the runner's 400) and refuses a
split shard; the runner's card check runs on an encoder folder."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.testing.builders import make_params, make_shard
from exo.testing.tiny_encoders import save_tiny_embedding_model
from exo.worker.engines.torch.encoder_engine import EncoderEngine
from exo.worker.engines.torch.engine_factory import load_serving_engine
from exo.worker.runner.card_check import check_card

MINILM = ModelId("sentence-transformers/all-MiniLM-L6-v2")


def test_an_encoder_card_gets_the_encoder_engine(tmp_path: Path) -> None:
    folder = save_tiny_embedding_model(tmp_path / "bert", "bert")
    card = load_builtin_cards()[MINILM]
    loaded: list[tuple[int, int]] = []
    engine = load_serving_engine(
        folder, make_shard(card), on_layer_loaded=lambda done, total: loaded.append((done, total))
    )
    assert isinstance(engine, EncoderEngine)
    assert loaded == [(card.n_layers, card.n_layers)]
    engine.warmup()
    assert engine.kv_cache_tokens == 0 and engine.kv_cache_usage() is None
    assert engine.step() == [] and engine.store_finished() == 0
    assert 0 < engine.weight_bytes() < 2**20  # the tiny model's float32 tensors
    backend = engine.embedding_backend()
    vectors = backend.embed(backend.tokenize(["w1 w2", "w3"]))
    assert vectors.shape == (2, 32) and torch.isfinite(vectors).all()
    assert backend.score_pairs([("w1", "w2")]) is None  # not a reranker
    with pytest.raises(ValueError, match="embedding capability only"):
        engine.render_prompt(make_params(model=MINILM))
    with pytest.raises(ValueError, match="embedding capability only"):
        engine.submit(make_params(model=MINILM))
    # The runner's card check reads an encoder's config and tokenizer without failing: the
    # tiny model's shapes are reported as what the card states otherwise.
    mismatches = check_card(card, folder, engine.tokenizer)
    assert any("hidden" in line for line in mismatches), mismatches


def test_a_split_encoder_shard_is_refused(tmp_path: Path) -> None:
    folder = save_tiny_embedding_model(tmp_path / "bert", "bert")
    card = load_builtin_cards()[MINILM]
    with pytest.raises(ValueError, match="runs whole on one node"):
        load_serving_engine(folder, make_shard(card, device_rank=1, world_size=2))


def test_a_decoder_card_still_gets_the_torch_engine(
    tiny_card: ModelCard, tiny_model_dir: Path
) -> None:
    from exo.worker.engines.torch.engine import TorchEngine

    engine = load_serving_engine(tiny_model_dir, make_shard(tiny_card))
    assert isinstance(engine, TorchEngine)
