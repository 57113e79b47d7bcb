"""Speculative decoding (issue 43), what is drafted and how much: the n-gram source alone,
the draft length, the automatic switch, and the cost rule that stops drafting where its
rows cost more than they bring."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from exo.worker.engines.torch.decoding.speculative_drafts import (
    NO_DRAFT,
    Draft,
    DraftRequest,
    NgramDraftSource,
)
from exo.worker.engines.torch.decoding.speculative_policy import (
    PROBE_INTERVAL,
    PROBE_STEPS,
    AutoSwitch,
    DraftLength,
    SpeculationSettings,
    best_draft_length,
    expected_tokens,
)
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    ScriptedDrafts,
    load,
    plain_references,
    request,
    run,
    speculation,
)

# --- the n-gram source --------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    source = NgramDraftSource(max_ngram=3, min_ngram=2)
    # "5 6" occurs at 1 (followed by 7 8) and at 6 (followed by 9 1): the latest wins.
    tokens = [4, 5, 6, 7, 8, 4, 5, 6, 9, 1, 2, 5, 6]
    assert source.propose([DraftRequest("r", tokens, 3)]) == [Draft((9, 1, 2))]
    # The longest suffix with a match wins: "4 5 6" (3 tokens) over "5 6".
    tokens = [4, 5, 6, 7, 8, 1, 5, 6, 9, 3, 4, 5, 6]
    assert source.propose([DraftRequest("s", tokens, 2)]) == [Draft((7, 8))]


def test_ngram_proposes_nothing_without_a_match_and_stops_at_the_text_end() -> None:
    source = NgramDraftSource(max_ngram=3, min_ngram=2)
    assert source.propose([DraftRequest("r", [1, 2, 3, 4, 5], 4)]) == [NO_DRAFT]
    # A repeating pattern: the continuation runs into the suffix and stops at the end.
    assert source.propose([DraftRequest("p", [7, 8, 7, 8], 5)]) == [Draft((7, 8))]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramDraftSource(max_ngram=1, min_ngram=2)


def test_ngram_index_grown_step_by_step_proposes_as_a_fresh_one() -> None:
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(0, 6, (300,), generator=generator).tolist()
    grown = NgramDraftSource()
    for length in range(1, len(text) + 1):
        fresh = NgramDraftSource()
        wanted = DraftRequest("r", text[:length], 4)
        assert grown.propose([wanted]) == fresh.propose([wanted]), length
    grown.forget("r")
    assert grown._indexes == {}


# --- the policy ---------------------------------------------------------------------------


def test_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection() -> None:
    length = DraftLength(minimum=1, maximum=6, current=3)
    length.update(drafted=3, accepted=3)
    assert length.current == 5
    length.update(drafted=5, accepted=5)
    assert length.current == 6  # capped
    for _ in range(10):
        length.update(drafted=6, accepted=0)
    assert length.current == 1  # floored
    length.update(drafted=0, accepted=0)  # no draft: unchanged
    assert length.current == 1
    with pytest.raises(ValueError, match="draft length bounds"):
        SpeculationSettings(draft_min=4, draft_max=3)
    assert SpeculationSettings(default=False).mode_of(None) is False
    assert SpeculationSettings(default=False).mode_of("auto") == "auto"


def test_auto_switch_turns_off_where_drafts_cost_more_than_they_gain_and_probes() -> None:
    switch = AutoSwitch()
    assert not switch.allows(1)  # no plain step measured yet: a reference step
    switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)  # a plain step: 100 tok/s
    assert switch.allows(1) and not switch.probing
    # Drafts of 6: the step costs 1.5x and yields 1.2 tokens: 80 tok/s.
    for _ in range(20):
        switch.observe(requests=1, rows=7, emitted=1, seconds=0.015)
    assert not switch.enabled and switch.gain is not None and switch.gain < 1

    def steps(count: int) -> list[bool]:  # `count` steps, the plain ones measured
        allowed = []
        for _ in range(count):
            allowed.append(switch.allows(1))
            if not allowed[-1]:
                switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)
        return allowed

    # Off: the last PROBE_STEPS steps of PROBE_INTERVAL draft, then probes back off.
    allowed = steps(PROBE_INTERVAL)
    assert allowed.count(True) == PROBE_STEPS and all(allowed[-PROBE_STEPS:])
    allowed = steps(2 * PROBE_INTERVAL)
    assert allowed.count(True) == PROBE_STEPS and all(allowed[-PROBE_STEPS:])
    # The probes find the text copyable now: 5 tokens per 1.5x step.
    for _ in range(20):
        switch.observe(requests=1, rows=7, emitted=5, seconds=0.015)
    assert switch.enabled and switch.allows(1)


def test_the_draft_length_is_the_one_with_the_most_tokens_per_second_of_step_time() -> None:
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0

    def linear(rows: int) -> float:  # a step costs 10 ms, and 5 ms more per row
        return 0.010 + 0.005 * rows

    # Likely drafts pay for long rows; unlikely ones for none.
    assert best_draft_length(0.95, 6, 1, linear) == 6
    assert best_draft_length(0.2, 6, 1, linear) == 0
    assert 0 < best_draft_length(0.6, 6, 1, linear) < 6
    assert best_draft_length(0.2, 6, 1, lambda rows: None) == 6  # nothing measured: try
    length = DraftLength(minimum=1, maximum=6)
    assert length.acceptance is None
    length.update(drafted=4, accepted=4)
    length.update(drafted=4, accepted=2)
    assert length.acceptance == pytest.approx((0.9 * 4 + 2) / (0.9 * 4 + 2 + 1))


def test_drafting_stops_where_its_rows_cost_more_than_they_bring(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    params = [request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative="auto")]
    reference = plain_references(engine, params)
    drafts = ScriptedDrafts(reference, engine.vocab_size)
    speculation(engine).source = drafts
    # A step's time grows faster than its rows: no draft, even one always accepted (the
    # first round's), brings tokens as fast as plain steps.
    speculation(engine).step_cost = lambda rows: float(rows) ** 1.5
    speculation(engine).auto_switch._steps = PROBE_STEPS  # past the first probe: none here
    state = engine.build_request(params[0], None, "r0")
    run(engine, [state], [0])
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    # The first draft (no acceptance known yet) is verified, then none.
    assert drafts.rounds == 1
    # A request that asks for speculation drafts whatever the costs.
    forced = engine.build_request(params[0].model_copy(update={"speculative": True}), None, "r1")
    drafts.reference["r1"] = reference["r0"]
    run(engine, [forced], [0])
    assert forced.generated_ids == state.generated_ids and drafts.rounds > 4
