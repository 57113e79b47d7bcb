"""Penalties, log probabilities and constrained draws of the sampler, on crafted logits."""

from __future__ import annotations

import math

import pytest
import torch

from exo.shared.types.chunks import MIN_LOGPROB
from exo.shared.types.common import ModelId
from exo.shared.types.models import SamplingDefaults
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.decoding.logit_adjustments import TokenPenalties
from exo.worker.engines.torch.decoding.sampling import (
    NoAllowedTokenError,
    Sampler,
    TokenChooser,
    step_logprobs,
)
from exo.worker.engines.torch.decoding.sampling_params import (
    SamplingParams,
    resolve_sampling_params,
)

GREEDY = SamplingParams(temperature=0.0)


def penalties(**fields: float) -> TokenPenalties:
    return TokenPenalties(SamplingParams(**fields), vocab_size=4)  # type: ignore[arg-type]


def test_no_penalty_settings_mean_no_penalties() -> None:
    assert not SamplingParams().has_penalties
    assert SamplingParams(presence_penalty=0.5).has_penalties
    assert SamplingParams(frequency_penalty=-0.5).has_penalties
    assert SamplingParams(repetition_penalty=1.2).has_penalties


def test_resolve_reads_penalties_and_none_repetition_is_off() -> None:
    params = TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content="x"),),
        presence_penalty=0.25, frequency_penalty=0.5,
    )  # fmt: skip
    resolved = resolve_sampling_params(params, SamplingDefaults())
    assert (resolved.presence_penalty, resolved.frequency_penalty) == (0.25, 0.5)
    assert resolved.repetition_penalty == 1.0 and resolved.has_penalties
    assert not resolve_sampling_params(params.model_copy(update={
        "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0,
    }), SamplingDefaults()).has_penalties  # fmt: skip


def test_presence_penalty_subtracts_once_per_seen_token() -> None:
    state = penalties(presence_penalty=1.5)
    for token in (0, 0, 0, 2):
        state.observe(token)
    logits = torch.tensor([5.0, 4.0, 3.0, 1.0])
    assert state.apply(logits).tolist() == [3.5, 4.0, 1.5, 1.0]
    assert logits.tolist() == [5.0, 4.0, 3.0, 1.0]  # the raw logits stay intact


def test_frequency_penalty_subtracts_per_occurrence() -> None:
    state = penalties(frequency_penalty=0.5, presence_penalty=0.25)
    for token in (0, 0, 0, 2):
        state.observe(token)
    scores = state.apply(torch.tensor([5.0, 4.0, 3.0, 1.0]))
    assert scores.tolist() == [5.0 - 0.25 - 1.5, 4.0, 3.0 - 0.25 - 0.5, 1.0]


def test_presence_and_frequency_ignore_prompt_tokens() -> None:
    state = penalties(presence_penalty=2.0, frequency_penalty=2.0)
    state.observe_prompt([0, 0, 1])
    logits = torch.tensor([5.0, 4.0, 3.0, 1.0])
    assert torch.equal(state.apply(logits), logits)


def test_repetition_penalty_divides_positive_multiplies_negative() -> None:
    state = penalties(repetition_penalty=2.0)
    state.observe_prompt([0, 1])  # prompt tokens count
    state.observe(3)
    scores = state.apply(torch.tensor([4.0, -1.0, 3.0, -2.0]))
    assert scores.tolist() == [2.0, -2.0, 3.0, -4.0]


def test_a_repetition_window_counts_only_the_last_tokens_of_prompt_and_reply() -> None:
    """`repetition_window` 2 (Ollama's `repeat_last_n`): a token leaves the penalised set
    once two later tokens pushed it out, and a token twice in the window stays until both
    copies left."""
    logits = torch.tensor([4.0, 4.0, 4.0, 4.0])
    state = penalties(repetition_penalty=2.0, repetition_window=2)
    state.observe_prompt([0, 1, 2])  # the window holds 1, 2
    assert state.apply(logits).tolist() == [4.0, 2.0, 2.0, 4.0]
    state.observe(2)  # 2, 2
    assert state.apply(logits).tolist() == [4.0, 4.0, 2.0, 4.0]
    state.observe(3)  # 2, 3
    assert state.apply(logits).tolist() == [4.0, 4.0, 2.0, 2.0]
    state.observe(9)  # 3 and an id outside the vocabulary
    assert state.apply(logits).tolist() == [4.0, 4.0, 4.0, 2.0]
    whole = penalties(repetition_penalty=2.0)
    whole.observe_prompt([0, 1, 2])
    whole.observe(3)
    assert whole.apply(logits).tolist() == [2.0, 2.0, 2.0, 2.0]


def test_repetition_penalty_below_one_favours_repeats() -> None:
    state = penalties(repetition_penalty=0.5)
    state.observe(0)
    assert state.apply(torch.tensor([2.0, -2.0, 0.0, 0.0])).tolist() == [4.0, -2.0, 0.0, 0.0]


def test_penalties_change_the_greedy_choice() -> None:
    logits = torch.tensor([3.0, 2.9, 0.0, -1.0])
    chooser = TokenChooser(Sampler(GREEDY), penalties(presence_penalty=0.5))
    assert chooser.choose(logits) == 0
    chooser.observe(0)
    assert chooser.choose(logits) == 1  # 3.0 - 0.5 < 2.9
    chooser.observe(1)
    assert chooser.choose(logits) == 0  # both penalised once: 2.5 > 2.4


def test_frequency_penalty_grows_with_repeats() -> None:
    logits = torch.tensor([3.0, 1.9, 0.0, -1.0])
    chooser = TokenChooser(Sampler(GREEDY), penalties(frequency_penalty=0.6))
    chosen = []
    for _step in range(4):
        token = chooser.choose(logits)
        chooser.observe(token)
        chosen.append(token)
    # 3.0 -> 2.4 (> 1.9) -> 1.8 (< 1.9): token 1 wins; then 1.3 vs 1.8 -> 0 again.
    assert chosen == [0, 0, 1, 0]


def test_repetition_penalty_turns_greedy_away_from_prompt_token() -> None:
    logits = torch.tensor([3.0, 2.0, 0.0, -1.0])
    state = penalties(repetition_penalty=2.0)
    state.observe_prompt([0])
    assert TokenChooser(Sampler(GREEDY), state).choose(logits) == 1  # 3/2 < 2


def test_out_of_range_token_ids_are_ignored() -> None:
    state = penalties(presence_penalty=1.0, repetition_penalty=2.0)
    state.observe_prompt([-1, 7])
    state.observe(9)
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert torch.equal(state.apply(logits), logits)


# --- log probabilities --------------------------------------------------------------------


def test_step_logprobs_equal_log_softmax() -> None:
    logits = torch.randn(500, generator=torch.Generator().manual_seed(1)) * 4
    expected = torch.log_softmax(logits.double(), dim=-1)
    step = step_logprobs(logits, 17, top_n=5)
    assert step.token_id == 17
    assert math.isclose(step.logprob, float(expected[17]), abs_tol=1e-5)
    assert list(step.top_ids) == expected.topk(5).indices.tolist()
    assert list(step.top_logprobs) == sorted(step.top_logprobs, reverse=True)
    for token_id, logprob in zip(step.top_ids, step.top_logprobs, strict=True):
        assert math.isclose(logprob, float(expected[token_id]), abs_tol=1e-5)
    full = step_logprobs(logits, 0, top_n=500)
    assert math.isclose(sum(math.exp(value) for value in full.top_logprobs), 1.0, rel_tol=1e-4)


def test_step_logprobs_without_alternatives_and_clamped() -> None:
    logits = torch.tensor([0.0, -1e9, float("-inf")])
    step = step_logprobs(logits, 2, top_n=0)
    assert step.top_ids == () and step.logprob == MIN_LOGPROB
    assert step_logprobs(logits, 1, top_n=3).top_logprobs == (0.0, MIN_LOGPROB, MIN_LOGPROB)


# --- constrained draws ---------------------------------------------------------------------


class SetFilter:
    """Allows a fixed set of tokens; counts the checks."""

    def __init__(self, allowed: set[int]) -> None:
        self.allowed_set = allowed
        self.checks = 0
        self.full_scans = 0

    def allowed(self, token_id: int) -> bool:
        self.checks += 1
        return token_id in self.allowed_set

    def allowed_tokens(self) -> list[int]:
        self.full_scans += 1
        return sorted(self.allowed_set)


def test_constrained_greedy_is_the_best_allowed_token() -> None:
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(2))
    order = logits.argsort(descending=True).tolist()
    near = SetFilter({order[5], order[900]})
    assert Sampler(GREEDY).sample(logits, near) == order[5]
    assert near.full_scans == 0  # found by masking the argmax
    far = SetFilter({order[900], order[1500]})
    assert Sampler(GREEDY).sample(logits, far) == order[900]
    assert far.full_scans == 1  # past the rejections and the scanned block


def test_constrained_sampling_follows_the_masked_distribution() -> None:
    logits = torch.tensor([4.0, 0.0, math.log(3.0), 0.0, 3.0])
    allowed = SetFilter({1, 2})  # masked distribution: 1/4, 3/4
    sampler = Sampler(SamplingParams(temperature=1.0, seed=5))
    draws = [sampler.sample(logits, allowed) for _ in range(2000)]
    assert set(draws) == {1, 2}
    assert 0.70 < draws.count(2) / len(draws) < 0.80


def test_constrained_sampling_with_rare_allowed_tokens_uses_the_full_set() -> None:
    logits = torch.zeros(5000)
    logits[:100] = 10.0  # the likely tokens are all disallowed
    allowed = SetFilter({4000, 4001})
    sampler = Sampler(SamplingParams(temperature=1.0, seed=1))
    assert {sampler.sample(logits, allowed) for _ in range(20)} <= {4000, 4001}
    assert allowed.full_scans == 20


def test_constrained_sampling_when_filters_remove_every_allowed_token() -> None:
    logits = torch.tensor([5.0, 4.0, 1.0, 2.0])
    sampler = Sampler(SamplingParams(temperature=1.0, top_k=2, seed=0))
    assert sampler.sample(logits, SetFilter({2, 3})) == 3  # best allowed by raw score


def test_constraint_without_allowed_tokens_raises() -> None:
    with pytest.raises(NoAllowedTokenError):
        Sampler(GREEDY).sample(torch.zeros(10), SetFilter(set()))
    with pytest.raises(NoAllowedTokenError):
        Sampler(SamplingParams(temperature=1.0, seed=0)).sample(torch.zeros(10), SetFilter(set()))


def test_seeded_constrained_sampling_is_reproducible() -> None:
    logits = torch.randn(3000, generator=torch.Generator().manual_seed(3))
    allowed = set(range(0, 3000, 7))

    def run() -> list[int]:
        sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
        return [sampler.sample(logits, SetFilter(allowed)) for _ in range(30)]

    first = run()
    assert first == run() and set(first) <= allowed
