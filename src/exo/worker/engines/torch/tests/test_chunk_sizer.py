"""`PrefillChunkSizer`: prompt tokens per step beside decodes, from reported step times
(synthetic times here: the rule, not this machine's speed)."""

from __future__ import annotations

import pytest

from exo.worker.engines.torch.batching.chunk_sizer import COST_WINDOW, PrefillChunkSizer


def test_one_step_without_prompt_tokens_measures_the_decode_rows_alone() -> None:
    sizer = PrefillChunkSizer(maximum=512, initial=8)
    assert sizer.chunk(0) == 8  # no decode rows: nothing to measure
    assert sizer.chunk(2) == 0  # the probe, once
    assert sizer.chunk(2) == 8  # not measured yet (say, the probe step failed): no second
    sizer.observe(2, 0, 0.004)
    assert sizer.decode_seconds(2) == pytest.approx(0.004)


def test_the_initial_chunk_until_both_costs_are_measured() -> None:
    sizer = PrefillChunkSizer(maximum=512, initial=8)
    sizer.observe(1, 0, 0.004)
    assert sizer.chunk(1) == 8
    sizer.observe(1, 8, 0.010)  # a chunk step before any decode-only one: no base to subtract
    assert sizer.chunk(1) == 8
    assert sizer.decode_seconds(1) == pytest.approx(0.004)
    assert sizer.chunk(1) == 8  # still no per-token cost


def test_the_chunk_keeps_a_step_within_the_gap_ratio() -> None:
    # Decode-only steps of 4 ms, prompt tokens of 0.1 ms each beyond them: at 2.5x the
    # step may take 10 ms, so 6 ms of prompt = 60 tokens (reached by doubling from 8).
    sizer = PrefillChunkSizer(maximum=512, gap_ratio=2.5, initial=8)
    sizer.observe(2, 0, 0.004)
    assert sizer.chunk(2) == 8
    sizer.observe(2, 8, 0.004 + 8 * 0.0001)
    assert [sizer.chunk(2) for _ in range(4)] == [16, 32, 60, 60]
    # Prompt tokens getting dearer (a longer prompt's attention) shrink the chunk at once.
    for _ in range(30):
        sizer.observe(2, 60, 0.004 + 60 * 0.0003)
    assert sizer.chunk(2) == 20


def test_decode_times_are_kept_per_row_count_and_the_nearest_stands_in() -> None:
    sizer = PrefillChunkSizer(maximum=512, gap_ratio=3.0, initial=4)
    sizer.observe(1, 0, 0.002)
    sizer.observe(8, 0, 0.010)
    assert sizer.chunk(8) == 4
    assert sizer.decode_seconds(2) == pytest.approx(0.002)
    assert sizer.decode_seconds(6) == pytest.approx(0.010)
    sizer.observe(8, 4, 0.010 + 4 * 0.001)  # 1 ms per prompt token
    assert sizer.chunk(8) == 8  # doubling from the last chunk (4) towards 20
    assert sizer.chunk(8) == 16
    assert sizer.chunk(8) == 20
    assert sizer.chunk(1) == 4  # 2 ms x (3 - 1) / 1 ms


def test_bounds_and_free_prompt_tokens() -> None:
    sizer = PrefillChunkSizer(maximum=32, initial=8)
    sizer.observe(1, 0, 0.005)
    assert sizer.chunk(1) == 8
    sizer.observe(1, 8, 0.004)  # faster than the decode-only average: costs nothing
    assert [sizer.chunk(1) for _ in range(3)] == [16, 32, 32]
    slow = PrefillChunkSizer(maximum=32, initial=8)
    slow.observe(1, 0, 0.001)
    slow.observe(1, 8, 1.0)
    assert slow.chunk(1) == 1  # never below one token
    slow.observe(0, 8, 0.5)  # no decode rows: ignored
    slow.observe(1, 0, 0.0)  # no time: ignored
    assert slow.decode_seconds(1) == pytest.approx(0.001)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="gap_ratio"):
        PrefillChunkSizer(maximum=8, gap_ratio=1.0)
    with pytest.raises(ValueError, match="at least one token"):
        PrefillChunkSizer(maximum=0)


def test_a_fixed_cost_per_chunk_step_is_fitted_apart_from_the_per_token_cost() -> None:
    # Decode-only steps of 10 ms; a chunk step costs 6 ms more whatever its size, plus 1 ms
    # per prompt token. At 2.5x the step may take 25 ms: 15 ms beyond decode, 6 of them
    # fixed, so 9 tokens.
    sizer = PrefillChunkSizer(maximum=512, gap_ratio=2.5, initial=4)
    sizer.observe(1, 0, 0.010)
    assert sizer.chunk(1) == 4
    sizer.observe(1, 4, 0.010 + 0.006 + 4 * 0.001)
    # One chunk size so far: no slope to fit, every second charged to the tokens
    # (2.5 ms a token: 6 tokens).
    assert sizer.costs() == pytest.approx((0.0, 0.0025))
    assert sizer.chunk(1) == 6
    sizer.observe(1, 6, 0.010 + 0.006 + 6 * 0.001)
    fixed, per_token = sizer.costs() or (0.0, 0.0)
    assert fixed == pytest.approx(0.006) and per_token == pytest.approx(0.001)
    assert sizer.chunk(1) == 9
    sizer.observe(1, 9, 0.010 + 0.006 + 9 * 0.001)
    assert sizer.chunk(1) == 9


def test_the_fit_follows_recent_chunk_steps_and_rejects_a_negative_fixed_cost() -> None:
    sizer = PrefillChunkSizer(maximum=512, gap_ratio=3.0, initial=8)
    sizer.observe(1, 0, 0.010)
    for tokens in (2, 4, 8):  # early in a prompt: 1 ms a token
        sizer.observe(1, tokens, 0.010 + tokens * 0.001)
    assert sizer.costs() == pytest.approx((0.0, 0.001))
    for _ in range(COST_WINDOW):  # later: 2 ms a token, one chunk size
        sizer.observe(1, 5, 0.010 + 5 * 0.002)
    assert sizer.costs() == pytest.approx((0.0, 0.002))
    assert sizer.chunk(1) == 10
    # Costs falling faster than the tokens (a negative intercept): charged to the tokens.
    sizer.observe(1, 20, 0.010 + 0.001)
    fixed, per_token = sizer.costs() or (1.0, 1.0)
    assert fixed == 0.0 and per_token > 0.0
