"""The engine's test seam: a marked model directory answers chosen prompts with chosen
text and slows its prefill; nothing of it reaches an unmarked model or a download."""

from __future__ import annotations

import shutil
from pathlib import Path

import pydantic
import pytest

from exo.download.shard_files import small_files
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.seam import mark_model_dir, unmark_model_dir
from exo.worker.engines.torch.batching import scheduler as scheduler_module
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.testing_seam import SEAM_FILE, load_testing_seam

REPLY = 'It is sunny in "Paris" today.'


def request(content: str, max_tokens: int = 40) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"),
        messages=(ChatMessage(role="user", content=content),),
        max_tokens=max_tokens,
        temperature=0.0,
    )


def load(model_dir: Path, card: ModelCard) -> TorchEngine:
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(model_dir, shard, weight_dtype="float32")


@pytest.fixture()
def marked_dir(tmp_path: Path, tiny_model_dir: Path) -> Path:
    copy = shutil.copytree(tiny_model_dir, tmp_path / "marked")
    mark_model_dir(copy, prefill_chunk_seconds=0.25, replies=[("weather", REPLY)])
    return copy


def test_a_marked_model_answers_the_scripted_reply_and_only_to_its_prompt(
    marked_dir: Path, tiny_card: ModelCard
) -> None:
    engine = load(marked_dir, tiny_card)
    pieces = list(engine.generate(request("What is the weather like?")))
    assert "".join(piece.text for piece in pieces) == REPLY
    assert pieces[-1].finish_reason == "stop"
    other = "".join(piece.text for piece in engine.generate(request("Say something.")))
    assert other != REPLY and REPLY not in other


def test_a_marked_model_sleeps_in_each_prefill_step(
    marked_dir: Path, tiny_card: ModelCard, monkeypatch: pytest.MonkeyPatch
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(scheduler_module.time, "sleep", slept.append)
    engine = load(marked_dir, tiny_card)
    list(engine.generate(request("Say something.", max_tokens=3)))
    # One prompt chunk of a short prompt: one slowed step; decode steps are not slowed.
    assert slept == [0.25]


def test_an_unmarked_model_has_no_seam(
    marked_dir: Path, tiny_card: ModelCard, monkeypatch: pytest.MonkeyPatch
) -> None:
    unmark_model_dir(marked_dir)
    slept: list[float] = []
    monkeypatch.setattr(scheduler_module.time, "sleep", slept.append)
    engine = load(marked_dir, tiny_card)
    assert engine.testing_seam is None
    text = "".join(piece.text for piece in engine.generate(request("What is the weather?")))
    assert text != REPLY and slept == []


def test_a_broken_marker_fails_the_load_with_its_reason(tmp_path: Path) -> None:
    (tmp_path / SEAM_FILE).write_text('{"prefill_chunk_seconds": -1}')
    with pytest.raises(pydantic.ValidationError, match="prefill_chunk_seconds"):
        load_testing_seam(tmp_path)


def test_downloads_never_fetch_the_marker() -> None:
    assert small_files([SEAM_FILE, "config.json", "tokenizer.json"]) == (
        "config.json",
        "tokenizer.json",
    )
