"""Speculative decoding with a draft model on the target's node (issue 43): greedy output is
plain decoding's token for token, the draft's and the target's KV follow the verified text,
a failing or slow draft is handled, and a seed repeats its output. The general rejection
rule on a bare request state is `test_speculative_draft_model_sampling.py`; loading (a draft
of another vocabulary refused, the model then serving without it) is
`test_speculative_draft_model_loading.py`.

The target is a tiny random Llama with untied embeddings (a tied one repeats its input
token, which any draft guesses). A draft agreeing with it part of the time is the target's
checkpoint with every weight moved by a little seeded noise
(`speculative_builders.noisy_copy`): random models of another size agree on almost nothing.
A smaller draft (the target's first layer only) is checked for exactness too.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.worker.engines.torch import draft_model
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.draft_model import DraftModelSource
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    draft_model_dirs,
    draft_source,
    load,
    plain_references,
    request,
    run,
    speculation,
)

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades "
    "of salt and wind. Every night the keeper climbed the spiral stairs to light the lamp."
)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    return draft_model_dirs(tmp_path_factory.mktemp("draft-model"), real_model_dir)


@pytest.fixture(scope="module")
def module_float32_kv() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_KV_CACHE_DTYPE", "float32")
        yield


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path], module_float32_kv: None) -> TorchEngine:
    return load(model_dirs["target"], draft_model=model_dirs["draft"])


# --- greedy: token for token --------------------------------------------------------------


def test_greedy_with_a_draft_model_is_plain_decoding_batched_with_plain_requests(
    engine: TorchEngine,
) -> None:
    params = [
        request(PROMPTS[0], temperature=0.0, max_tokens=23, speculative=True),
        request(PROMPTS[1], temperature=0.0, max_tokens=9, speculative=False),
        request(PROMPTS[2], temperature=0.0, max_tokens=17, speculative=True),
    ]
    reference = plain_references(engine, params)
    before = dataclasses.replace(speculation(engine).counters)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 2, 5])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    counters = speculation(engine).counters
    drafted = counters.drafted_tokens - before.drafted_tokens
    accepted = counters.accepted_tokens - before.accepted_tokens
    assert counters.verify_rounds - before.verify_rounds >= 6
    assert 0 < accepted < drafted  # whole drafts, and rejections
    source = draft_source(engine)
    assert source.cache.occupied == 0 and source.held_tokens("r0") == []  # all forgotten


@pytest.mark.slow
def test_a_smaller_draft_model_keeps_greedy_output_exact(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    engine = load(model_dirs["target"], draft_model=model_dirs["smaller"])
    assert draft_source(engine).model.config.num_hidden_layers == 1
    params = [request(prompt, temperature=0.0, max_tokens=12, speculative=True)
              for prompt in PROMPTS]  # fmt: skip
    reference = plain_references(engine, params)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 0, 1])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert speculation(engine).counters.verify_rounds > 0


def test_int4_target_and_draft_keep_greedy_output_exact(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    """The draft model is held in the target's weight format; verify rows stay decode rows
    on int4 weights, so greedy output is plain decoding's there too."""
    engine = load(model_dirs["target"], draft_model=model_dirs["draft"], weight_dtype="int4")
    assert engine.weight_dtype == "int4"
    assert type(draft_source(engine).model.model.layers[0].mlp.up_proj).__name__ == "Int4Linear"
    params = [request(prompt, temperature=0.0, max_tokens=16, speculative=index != 1)
              for index, prompt in enumerate(PROMPTS)]  # fmt: skip
    reference = plain_references(engine, params)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 1, 2])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert speculation(engine).counters.accepted_tokens > 0


def test_kv_after_a_rejection_equals_plain_decodings_for_target_and_draft(
    engine: TorchEngine,
) -> None:
    params = request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True)
    plain = engine.build_request(params.model_copy(update={"speculative": False}), None, "p0")
    engine.clear_prefix_cache()
    run(engine, [plain], [0])
    text = plain.prompt_ids + plain.generated_ids
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is not None
    plain_kv = scheduler.prefix_cache.lookup(text, limit=len(text))
    assert plain_kv is not None
    engine.clear_prefix_cache()
    source = draft_source(engine)
    # A second source over the same draft weights: its KV of a text is a fresh prefill's.
    fresh = DraftModelSource(
        source.model, _empty_like(source), source._windows, source.vocab_size, "fresh",
        source._device,
    )  # fmt: skip
    state = engine.build_request(params, None, "k0")
    scheduler.add(state)
    rejections = 0
    while engine.has_work:
        counters = speculation(engine).counters
        drafted, accepted = counters.drafted_tokens, counters.accepted_tokens
        engine.step()
        if state.finished:
            break
        if counters.drafted_tokens - drafted == counters.accepted_tokens - accepted:
            continue
        rejections += 1
        (running,) = scheduler._running
        kv = scheduler._cache.read(running.slot, running.computed)
        torch.testing.assert_close(
            kv, plain_kv.kv[:, :, :, : running.computed], atol=1e-5, rtol=1e-5
        )
        # The draft rolls back to the verified text at its next proposal; its KV is then
        # a fresh prefill's of that text.
        source.propose([DraftRequest("k0", running.tokens, 1)])
        held = source.held_tokens("k0")
        assert held == running.tokens
        fresh.forget("k0")
        fresh.propose([DraftRequest("k0", held, 1)])
        assert fresh.held_tokens("k0") == held
        slot = source._sequences["k0"].slot
        torch.testing.assert_close(
            source.cache.read(slot, len(held)),
            fresh.cache.read(fresh._sequences["k0"].slot, len(held)),
            atol=1e-5,
            rtol=1e-5,
        )
    assert rejections >= 2
    assert state.prompt_ids + state.generated_ids == text
    engine.store_finished()


def test_a_long_texts_draft_catches_up_one_chunk_per_step_with_the_kv_of_one_prefill(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step prefills at most `DRAFT_PREFILL_CHUNK` draft positions in all: a short
    request drafts at once, a long one catches up with what is left of each step's budget
    and drafts once its KV caught up: the draft and the KV of one whole prefill."""
    source = draft_source(engine)
    whole = DraftModelSource(
        source.model, _empty_like(source), source._windows, source.vocab_size, "whole",
        source._device,
    )  # fmt: skip
    text = engine.tokenizer.encode(PASSAGE)
    assert len(text) > 33
    wanted = [DraftRequest("long", text, 3), DraftRequest("short", text[:9], 2)]
    expected = whole.propose(wanted)  # the whole text in one pass (a chunk of 512)
    monkeypatch.setattr(draft_model, "DRAFT_PREFILL_CHUNK", 16)
    steps = 0
    while True:
        positions = source.positions_computed
        got = source.propose(wanted)
        steps += 1
        # The first pass's positions: the step's total less one per later draft token.
        later = sum(max(0, len(draft.tokens) - 1) for draft in got)
        assert source.positions_computed - positions - later <= 16
        assert got[1].tokens == expected[1].tokens  # the short request drafts every step
        if got[0].tokens:
            break
        assert steps < len(text)
    assert got[0].tokens == expected[0].tokens
    # 16 - 9 positions at the first step, then 15 a step (beside the short one's token).
    assert steps == 1 + -(-(len(text) - 7) // 15)
    for request_id in ("long", "short"):
        held = source.held_tokens(request_id)
        assert held == whole.held_tokens(request_id)
        torch.testing.assert_close(
            source.cache.read(source._sequences[request_id].slot, len(held)),
            whole.cache.read(whole._sequences[request_id].slot, len(held)),
            atol=1e-5,
            rtol=1e-5,
        )
        source.forget(request_id)
        whole.forget(request_id)
    assert source.cache.occupied == 0


def test_a_long_prompts_draft_prefill_is_bounded_per_step_and_greedy_stays_exact(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt joining a speculating batch: no draft forward pass of any step
    computes more than the chunk, the long request speculates once its draft caught up,
    and every request's greedy output is plain decoding's."""
    chunk = 8
    monkeypatch.setattr(draft_model, "DRAFT_PREFILL_CHUNK", chunk)
    params = [
        request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True),
        request(PASSAGE, temperature=0.0, max_tokens=24, speculative=True),
    ]
    reference = plain_references(engine, params)
    source = draft_source(engine)
    passes: list[int] = []
    forward = source._forward

    def counted(sequences: list[Any], feeds: list[list[int]]) -> torch.Tensor:
        passes.append(sum(len(feed) for feed in feeds))
        return forward(sequences, feeds)

    monkeypatch.setattr(source, "_forward", counted)
    before = speculation(engine).counters.verify_rounds
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    assert len(states[1].prompt_ids) > 4 * chunk
    run(engine, states, join_at=[0, 0])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert passes and max(passes) <= chunk
    assert speculation(engine).counters.verify_rounds - before >= 4


def test_a_failing_draft_source_leaves_decoding_plain(engine: TorchEngine) -> None:
    source = draft_source(engine)
    forgotten: list[str] = []

    class Failing:
        name = "failing"

        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            raise RuntimeError("the draft model broke")

        def forget(self, request_id: str) -> None:
            forgotten.append(request_id)

    params = request(PROMPTS[0], temperature=0.0, max_tokens=10, speculative=True)
    reference = plain_references(engine, [params])
    speculation(engine).source = Failing()
    try:
        state = engine.build_request(params, None, "r0")
        run(engine, [state], [0])
    finally:
        speculation(engine).source = source
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    assert forgotten.count("r0") >= 9  # every step's proposal failed, then the release


def test_the_drafting_time_counts_in_the_step_time_the_switch_measures(
    engine: TorchEngine,
) -> None:
    """A draft model's forward passes are part of a speculating step's cost: the step time
    the automatic switch observes includes the proposal's."""
    source = draft_source(engine)
    observed: list[tuple[int, float]] = []
    spec = speculation(engine)

    class Slow:
        name = "slow"

        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            time.sleep(0.05)  # at least 50 ms, whatever the machine
            return source.propose(requests)

        def forget(self, request_id: str) -> None:
            source.forget(request_id)

    def step_measured(
        requests: int, rows: int, emitted: int, seconds: float, draft_seconds: float
    ) -> None:
        observed.append((rows, seconds + draft_seconds))

    spec.source = Slow()
    spec.step_measured = step_measured  # type: ignore[method-assign]
    try:
        state = engine.build_request(
            request(PROMPTS[1], temperature=0.0, max_tokens=6, speculative=True), None, "t0"
        )
        run(engine, [state], [0])
    finally:
        spec.source = source
        del spec.step_measured
    drafted = [seconds for rows, seconds in observed if rows > 1]
    assert drafted and all(seconds >= 0.05 for seconds in drafted)
    assert spec.take_draft_seconds() == 0.0  # each step took its own


def _empty_like(source: DraftModelSource) -> SlotKVCache:
    """An empty KV cache of `source`'s geometry and slots."""
    cache = source.cache
    keys = cache.keys[0]
    return SlotKVCache(
        len(cache.keys), keys.shape[1], keys.shape[3], keys.dtype, keys.device, cache.slots,
        cache.latent_values, cache.windows,
    )  # fmt: skip


# --- sampling: a seed repeats its output -------------------------------------------------


def test_seeded_sampling_with_a_draft_model_repeats_its_output(engine: TorchEngine) -> None:
    # top-k keeps the filters cheap (a top-p nucleus of a random model's flat distribution
    # holds most of the vocabulary).
    params = request(PROMPTS[2], temperature=0.9, top_k=40, seed=5, max_tokens=20,
                     speculative=True, frequency_penalty=0.4)  # fmt: skip
    outputs = []
    before = dataclasses.replace(speculation(engine).counters)
    for attempt in range(2):
        engine.clear_prefix_cache()
        state = engine.build_request(params, None, f"s{attempt}")
        run(engine, [state], [0])
        outputs.append(state.generated_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 20
    counters = speculation(engine).counters
    assert counters.verify_rounds > before.verify_rounds
    assert counters.accepted_tokens > before.accepted_tokens
