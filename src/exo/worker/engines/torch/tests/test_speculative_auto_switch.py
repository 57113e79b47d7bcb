"""The automatic switch (`speculative_policy.AutoSwitch`) on an engine with a draft model
whose drafts are never accepted: it turns drafting off within a bounded number of steps,
the text stays plain decoding's, and while it is off a new request's prompt is not
prefilled by the draft model.

Trial of session 41 (2026-12-07): SmolLM2-135M drafting for a tiny model never had a token
accepted, yet `"auto"` stayed on (`auto_enabled` True, acceptance 0.0) and made the model
10-400x slower: the switch compared drafting steps only with plain steps, and the only
plain steps it measured carried the draft model's prompt catch-up in their time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.decoding.speculative_policy import (
    PROBE_INTERVAL,
    PROBE_STEPS,
    AutoSwitch,
)
from exo.worker.engines.torch.draft_model import DRAFT_PREFILL_CHUNK, DraftModelSource
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    load,
    noisy_copy,
    plain_references,
    request,
    run,
    speculation,
)

# What the draft model's work takes at least, in seconds: per forward pass and per position
# computed (about a 135M draft's on two cores: a decode pass ~3 ms, a prompt position ~0.2
# ms), so that drafting, and most its prompt catch-up, costs more than the jitter of the
# tiny target's step on a busy machine, as in the trial.
PASS_SECONDS = 0.003
POSITION_SECONDS = 0.0002
# Drafting steps the switch may take to turn off: its first one after the reference step
# (a plain step it measures first) suffices here; one more for a clock's hiccup.
MOST_DRAFTING_STEPS = 2


def test_a_draft_models_catch_up_counts_as_drafting_never_as_a_plain_steps_time() -> None:
    # A step whose draft model prefilled the prompt (no draft rows yet) cost 0.5 s of
    # drafting beside a 10 ms forward pass: a plain step stays 10 ms, and drafting lost.
    switch = AutoSwitch()
    assert not switch.allows(1)
    switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)
    assert switch.allows(1)
    switch.observe(requests=1, rows=1, emitted=1, seconds=0.010, draft_seconds=0.5)
    assert switch.step_seconds(1) == pytest.approx(0.010)
    assert not switch.enabled and switch.gain == pytest.approx(0.010 / 0.510)
    # A draft source that found nothing in no time costs nothing.
    fresh = AutoSwitch()
    fresh.allows(1)
    fresh.observe(requests=1, rows=1, emitted=1, seconds=0.010)
    fresh.observe(requests=1, rows=1, emitted=1, seconds=0.012, draft_seconds=1e-6)
    assert fresh.enabled


def test_a_probe_step_that_loses_ends_the_probe() -> None:
    # Off, then a probe whose first step only caught a draft model up on a new prompt (no
    # draft rows, 0.5 s of drafting): the probe's other steps do not draft.
    switch = AutoSwitch()
    switch.allows(1)
    switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)
    switch.allows(1)
    switch.observe(requests=1, rows=7, emitted=1, seconds=0.015)
    assert not switch.enabled
    allowed = []
    for _ in range(PROBE_INTERVAL):
        allowed.append(switch.allows(1))
        if allowed[-1]:
            switch.observe(requests=1, rows=1, emitted=1, seconds=0.010, draft_seconds=0.5)
        else:
            switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)
    assert allowed.count(True) == 1 and not switch.enabled


class DisagreeingDraft:
    """A real draft model's proposals (its forward passes and prompt catch-up run) with
    every token replaced by one the target never chooses there (`reference`: request id ->
    plain decoding's prompt and tokens), taking at least `PASS_SECONDS` a forward pass and
    `POSITION_SECONDS` a position."""

    def __init__(self, source: DraftModelSource, reference: dict[str, list[int]]) -> None:
        self.source = source
        self.reference = reference
        self.proposals = 0
        self.catch_up_positions = 0

    @property
    def name(self) -> str:
        return "disagreeing"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        started = time.perf_counter()
        passes, positions = self.source.forward_passes, self.source.positions_computed
        proposed = self.source.propose(requests)
        passes = self.source.forward_passes - passes
        positions = self.source.positions_computed - positions
        self.catch_up_positions += positions
        self.proposals += 1
        drafts = []
        for wanted, draft in zip(requests, proposed, strict=True):
            expected = self.reference[wanted.request_id]
            start = len(wanted.tokens)
            wrong = tuple(
                (expected[start + index] + 1) % self.source.vocab_size
                for index in range(len(draft.tokens))
            )
            drafts.append(Draft(wrong))
        least = PASS_SECONDS * passes + POSITION_SECONDS * positions
        time.sleep(max(0.0, least - (time.perf_counter() - started)))
        return drafts

    def forget(self, request_id: str) -> None:
        self.source.forget(request_id)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> TorchEngine:
    root = tmp_path_factory.mktemp("auto-switch")
    target = save_tiny_model(
        root / "target", "llama", real_model_dir, n_layers=3, tie_word_embeddings=False,
        max_position_embeddings=8192,
    )  # fmt: skip
    draft = noisy_copy(target, root / "draft", 0.0, layers=1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_KV_CACHE_DTYPE", "float32")
        return load(target, draft_model=draft)


def test_auto_turns_a_draft_that_is_never_accepted_off_and_the_text_stays_plain(
    engine: TorchEngine,
) -> None:
    # A prompt the draft model catches up on over several steps (`DRAFT_PREFILL_CHUNK`).
    prompt = " ".join(f"{PROMPTS[0]} number {index}." for index in range(280))
    params = [request(prompt, temperature=0.0, max_tokens=40, speculative="auto")]
    reference = plain_references(engine, params)
    spec = speculation(engine)
    source = spec.source
    assert isinstance(source, DraftModelSource)
    drafts = DisagreeingDraft(source, reference)
    spec.source = drafts
    try:
        state = engine.build_request(params[0], None, "r0")
        run(engine, [state], [0])
        assert state.prompt_ids + state.generated_ids == reference["r0"]
        switch = spec.auto_switch
        assert not switch.enabled and switch.gain is not None and switch.gain < 1
        assert spec.counters.accepted_tokens == 0
        # Off after at most MOST_DRAFTING_STEPS proposals; none since (the first probe
        # comes PROBE_INTERVAL - PROBE_STEPS steps after it turned off, past this text).
        assert PROBE_INTERVAL - PROBE_STEPS > 40
        assert 1 <= drafts.proposals <= MOST_DRAFTING_STEPS
        assert len(state.prompt_ids) > PROBE_STEPS * DRAFT_PREFILL_CHUNK

        # While off, a new request's prompt is not prefilled by the draft model: its
        # prefill and first token, and its decoding until a probe, run the target alone.
        proposals = drafts.proposals
        catch_up = drafts.catch_up_positions
        long_prompt = " ".join(["one two three four five six seven eight"] * 12)
        second = [request(long_prompt, temperature=0.0, max_tokens=8, speculative="auto")]
        drafts.reference["r1"] = plain_references(engine, second)["r0"]
        later = engine.build_request(second[0], None, "r1")
        run(engine, [later], [0])
        assert later.prompt_ids + later.generated_ids == drafts.reference["r1"]
        assert drafts.proposals == proposals and drafts.catch_up_positions == catch_up
    finally:
        spec.source = source
