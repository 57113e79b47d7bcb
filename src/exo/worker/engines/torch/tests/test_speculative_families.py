"""Greedy output with speculative decoding is plain decoding's, token for token, on every
model family of the registry (issue 43: "greedy equality for every family"), float32 weights
and KV, one process; the splits are `test_distributed_speculation.py`'s.

Three draft sources, each batched beside a request that does not draft:
- scripted drafts (`ScriptedDrafts`: the plain reply with mistakes at set places, so a whole
  draft, a rejection at its first token and one later are taken on every family), in the
  default run: a 3-layer tiny model per family;
- n-gram drafts (slow): a prompt that repeats a phrase, on a model whose embeddings are tied,
  so its greedy reply repeats tokens the prompt and the reply offer as matches;
- a draft model (slow): the target's checkpoint with seeded noise on every weight
  (`noisy_copy`), which agrees with the target part of the time.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.decoding.speculative_drafts import NgramDraftSource
from exo.worker.engines.torch.draft_model import DraftModelSource
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    DRAFT_NOISE,
    PROMPTS,
    ScriptedDrafts,
    load,
    noisy_copy,
    plain_references,
    request,
    run,
    speculation,
)

# A phrase repeated: the prompt itself holds n-gram matches, and a tied-embedding tiny
# model's greedy reply falls into repeats of what it read.
REPEATING = "one two three four five six. one two three four five six. one two three four five"


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    """A 3-layer tiny model of each family (sliding window 6 where the family has one)."""
    return {
        name: save_tiny_model(
            tmp_path_factory.mktemp(f"spec-{name}"),
            name,
            real_model_dir,
            n_layers=3,
            sliding_window=6,
        )
        for name in ARCHITECTURES
    }


def _three_requests(first: str, speculative: bool = True) -> list[TextGenerationTaskParams]:
    """Two drafting requests and a plain one between them (joined at steps 0, 2 and 5)."""
    return [
        request(first, temperature=0.0, max_tokens=23, speculative=speculative),
        request(PROMPTS[1], temperature=0.0, max_tokens=9, speculative=False),
        request(PROMPTS[2], temperature=0.0, max_tokens=17, speculative=speculative),
    ]


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_greedy_output_is_identical_with_drafts_batched_with_plain_requests(
    family_dirs: dict[str, Path], family: str, float32_kv: None
) -> None:
    engine = load(family_dirs[family])
    params = _three_requests(PROMPTS[0])
    reference = plain_references(engine, params)
    drafts = ScriptedDrafts(reference, engine.vocab_size)
    speculation(engine).source = drafts
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 2, 5])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    counters = speculation(engine).counters
    assert counters.verify_rounds >= 6 and 0 < counters.accepted_tokens < counters.drafted_tokens
    assert counters.tokens_per_step is not None and counters.tokens_per_step > 1.2
    assert {"r0", "r2"} <= set(drafts.forgotten)


def _speculated_equals_plain(engine: TorchEngine) -> tuple[int, int]:
    """Runs `_three_requests(REPEATING)` plainly (each alone) and then batched with drafts
    from the engine's own source; asserts equal tokens; (drafted, accepted) tokens."""
    params = _three_requests(REPEATING)
    reference = plain_references(engine, params)
    before = dataclasses.replace(speculation(engine).counters)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 2, 5])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    after = speculation(engine).counters
    return (
        after.drafted_tokens - before.drafted_tokens,
        after.accepted_tokens - before.accepted_tokens,
    )


@pytest.mark.slow  # 13 families: about a minute on a busy 2-core machine
@pytest.mark.parametrize("family", ARCHITECTURES)
def test_greedy_output_is_identical_with_ngram_drafts(
    family_dirs: dict[str, Path], family: str, float32_kv: None
) -> None:
    engine = load(family_dirs[family])
    assert isinstance(speculation(engine).source, NgramDraftSource)
    drafted, accepted = _speculated_equals_plain(engine)
    assert drafted > 0 and accepted > 0, (family, drafted, accepted)


@pytest.mark.slow  # 13 families, each with a second model: a few minutes when busy
@pytest.mark.parametrize("family", ARCHITECTURES)
def test_greedy_output_is_identical_with_a_draft_model(
    family_dirs: dict[str, Path], family: str, float32_kv: None, tmp_path: Path
) -> None:
    draft = noisy_copy(family_dirs[family], tmp_path / "draft", DRAFT_NOISE)
    try:
        engine = load(family_dirs[family], draft_model=draft)
        source = speculation(engine).source
        assert isinstance(source, DraftModelSource), family
        drafted, accepted = _speculated_equals_plain(engine)
        assert drafted > 0 and accepted > 0, (family, drafted, accepted)
        assert source.cache.occupied == 0  # every request's draft KV forgotten
    finally:
        shutil.rmtree(draft, ignore_errors=True)
