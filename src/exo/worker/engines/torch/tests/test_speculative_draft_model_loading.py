"""Loading a draft model (issue 43): a draft of another vocabulary is refused, a draft that
fails to load leaves the model serving without it, and `--draft-model` reaches the engine
through the runner's loading path. The models are
`speculative_builders.draft_model_dirs`: a tiny random Llama target and copies of it as
drafts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger

from exo.worker.engines.torch.draft_model import (
    DraftModelSource,
    VocabularyMismatchError,
    load_draft_model,
)
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    draft_model_dirs,
    draft_source,
    load,
    request,
    run,
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    return draft_model_dirs(tmp_path_factory.mktemp("draft-model"), real_model_dir)


def test_a_draft_model_with_another_vocabulary_is_refused_at_load(
    tmp_path: Path, model_dirs: dict[str, Path], real_model_dir: Path
) -> None:
    other = tmp_path / "other-vocabulary"
    shutil.copytree(model_dirs["smaller"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = sorted(vocabulary, key=vocabulary.get)[100:102]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    target = load(model_dirs["target"])
    with pytest.raises(VocabularyMismatchError) as refused:
        load_draft_model(
            other, target.tokenizer, "the-target", target.vocab_size, 2, torch.float32,
            weight_dtype="float32",
        )  # fmt: skip
    assert str(other) in str(refused.value) and "the-target" in str(refused.value)
    assert "2 tokens with other ids" in str(refused.value)


def test_a_draft_that_fails_to_load_leaves_the_model_serving_without_it(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    """Another vocabulary (trial 38: a card can be wrong, a custom draft unchecked) or a
    directory that is no model: the target loads and serves (prompt-lookup drafts, its
    greedy output plain decoding's), says why in `draft_left_out` and logs it as one
    warning, without a traceback."""
    other = tmp_path / "other-vocabulary"
    shutil.copytree(model_dirs["smaller"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = sorted(vocabulary, key=vocabulary.get)[100:102]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    params = request(PROMPTS[0], max_tokens=12, temperature=0.0, speculative=True)
    plain = load(model_dirs["target"])
    reference = plain.build_request(params, None, "plain")
    run(plain, [reference], [0])
    for draft, expected in ((other, "vocabularies differ"), (no_weights, "could not be loaded")):
        records: list[Any] = []
        sink = logger.add(records.append, level="WARNING")
        try:
            engine = load(model_dirs["target"], draft_model=draft)
        finally:
            logger.remove(sink)
        assert engine.draft_source is None
        assert engine.draft_left_out is not None and expected in engine.draft_left_out
        assert "serves without it" in engine.draft_left_out
        (record,) = [message.record for message in records]
        assert record["level"].name == "WARNING" and record["exception"] is None
        assert record["message"] == engine.draft_left_out
        state = engine.build_request(params, None, "served")
        run(engine, [state], [0])
        assert state.generated_ids == reference.generated_ids


def test_draft_model_option_reaches_the_engine_through_the_runners_loading_path(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--draft-model` parses to the node's options and the runner's; the runner's loading
    entry resolves it as a requested model (a local directory here) and the engine drafts
    from it; a split instance's ranks load none; a catalog draft whose files are not on the
    node (its download failed) is left out and the model served without it; one that is
    there is named by its model id."""
    from exo.node_options import parse_args
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine_factory import load_serving_engine
    from exo.worker.runner.options import RunnerOptions

    draft = str(model_dirs["smaller"])
    assert parse_args([]).draft_model is None
    assert parse_args(["--draft-model", draft]).draft_model == draft
    assert RunnerOptions(draft_model=draft).draft_model == draft
    card = card_from_local_directory(model_dirs["target"])
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = load_serving_engine(model_dirs["target"], shard, draft_model=draft)
    assert isinstance(engine, TorchEngine)
    assert isinstance(engine.draft_source, DraftModelSource)
    assert engine.draft_source.name == draft
    assert draft_source(engine) is engine.draft_source
    plain = load_serving_engine(model_dirs["target"], shard)
    assert isinstance(plain, TorchEngine) and plain.draft_source is None
    unknown = load_serving_engine(model_dirs["target"], shard, draft_model="no/such-model")
    assert isinstance(unknown, TorchEngine) and unknown.draft_source is None
    assert unknown.draft_left_out is not None and "unknown model" in unknown.draft_left_out
    from exo.worker.engines.torch import engine_factory

    monkeypatch.setattr(engine_factory, "models_dir", lambda: tmp_path)  # holds nothing
    missing = load_serving_engine(
        model_dirs["target"], shard, draft_model="HuggingFaceTB/SmolLM2-1.7B-Instruct"
    )
    assert isinstance(missing, TorchEngine) and missing.draft_source is None
    assert missing.draft_left_out is not None
    # A catalog draft found on the node is named by its model id (`RunnerReady.draft_model`,
    # metrics, logs), as a draft running on a spare node is, not by its directory.
    catalog_draft = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(
        engine_factory, "draft_model_directory", lambda name, _: model_dirs["smaller"]
    )
    named = load_serving_engine(model_dirs["target"], shard, draft_model=catalog_draft)
    assert isinstance(named, TorchEngine) and isinstance(named.draft_source, DraftModelSource)
    assert named.draft_source.name == catalog_draft
