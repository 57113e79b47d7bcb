import pytest
import torch

from exo.shared.types.common import ModelId
from exo.shared.types.models import SamplingDefaults
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.decoding.logit_adjustments import LogitBias
from exo.worker.engines.torch.decoding.sampling import (
    Sampler,
    TokenChooser,
    argmax_token,
    filter_logits,
)
from exo.worker.engines.torch.decoding.sampling_params import (
    SamplingParams,
    resolve_sampling_params,
)


def random_logits(seed: int = 0, vocab: int = 1000) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, generator=generator) * 3


def test_temperature_zero_is_argmax() -> None:
    logits = random_logits()
    sampler = Sampler(SamplingParams(temperature=0.0, seed=1))
    assert sampler.sample(logits) == int(logits.argmax())


@pytest.mark.parametrize(
    "scores",
    [
        random_logits(3, vocab=262_144),
        torch.tensor([1.0, 3.0, 3.0, -float("inf")]),  # the first of equals
        torch.tensor([1.0, float("nan"), 3.0, float("nan")]),  # NaN counts as the largest
        torch.full((5,), -float("inf")),
        random_logits(4).reshape(10, 100)[:, 7],  # a strided view
        random_logits(5).to(torch.bfloat16),  # torch's argmax
    ],
    ids=["gemma-vocab", "ties", "nan", "all-inf", "strided", "bfloat16"],
)
def test_argmax_token_is_torch_argmax(scores: torch.Tensor) -> None:
    assert argmax_token(scores) == int(torch.argmax(scores))


def test_top_k_one_equals_greedy() -> None:
    for seed in range(5):
        logits = random_logits(seed)
        sampler = Sampler(SamplingParams(temperature=1.5, top_k=1, seed=seed))
        assert sampler.sample(logits) == int(logits.argmax())


def test_same_seed_reproduces_tokens() -> None:
    logits = random_logits()
    params = SamplingParams(temperature=1.0, seed=1234)
    first = [Sampler(params).sample(logits) for _ in range(1)]
    sampler_a, sampler_b = Sampler(params), Sampler(params)
    run_a = [sampler_a.sample(logits) for _ in range(50)]
    run_b = [sampler_b.sample(logits) for _ in range(50)]
    assert run_a == run_b
    assert run_a[0] == first[0]
    assert len(set(run_a)) > 1  # temperature 1 over 1000 tokens really samples


def test_different_seeds_differ() -> None:
    logits = random_logits()
    runs = {
        tuple(Sampler(SamplingParams(temperature=1.0, seed=seed)).sample(logits) for _ in range(1))
        for seed in range(20)
    }
    assert len(runs) > 1


def test_top_k_keeps_exactly_k_tokens() -> None:
    logits = random_logits()
    filtered = filter_logits(logits, SamplingParams(temperature=1.0, top_k=7))
    kept = torch.isfinite(filtered)
    assert int(kept.sum()) == 7
    assert set(kept.nonzero().flatten().tolist()) == set(logits.topk(7).indices.tolist())


def test_top_p_keeps_smallest_set_reaching_mass() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    filtered = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    assert torch.isfinite(filtered).tolist() == [True, True, False, False]
    filtered = filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))
    assert torch.isfinite(filtered).tolist() == [True, False, False, False]


def _sorted_filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The filters by a full sort of the vocabulary (what `filter_logits` did before the
    nucleus was searched among the top candidates, its sums now in float64): the
    reference."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth_largest = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores.double(), dim=-1)  # float64 sums
        remove_sorted = torch.cumsum(sorted_probs, dim=-1) - sorted_probs >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


@pytest.mark.parametrize("vocab", [50, 255, 256, 257, 3000, 49152])
def test_candidates_equal_a_full_sort(vocab: int) -> None:
    """The nucleus found among the top candidates (doubled while short of top_p: flat
    logits need thousands) is the full sort's, with every filter combination; fixed seeds."""
    settings = [
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=0.7, top_p=0.95, top_k=40),
        SamplingParams(temperature=1.3, top_p=0.5, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=300),
        SamplingParams(temperature=1.0, min_p=0.1),
        SamplingParams(temperature=2.0, top_p=0.99, top_k=vocab - 1),
    ]
    generator = torch.Generator().manual_seed(vocab)
    for spread in (0.01, 1.0, 8.0):  # nearly flat (a huge nucleus) to peaked
        logits = torch.randn(vocab, generator=generator) * spread
        for params in settings:
            expected = _sorted_filter(logits, params)
            got = filter_logits(logits, params)
            assert torch.equal(torch.isfinite(got), torch.isfinite(expected)), (spread, params)
            finite = torch.isfinite(expected)
            assert torch.equal(got[finite], expected[finite])


def test_draws_follow_the_distribution() -> None:
    """20,000 seeded draws from known probabilities (with zero-probability tokens first,
    between and last, which must never come out) land within 4 standard deviations."""
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.15, 0.05, 0.0])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=11))
    logits = torch.log(probs)
    draws = 20_000
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits) for _ in range(draws)]), minlength=len(probs)
    )
    assert counts[probs == 0].sum() == 0
    for token, probability in enumerate(probs.tolist()):
        deviation = 4 * (draws * probability * (1 - probability)) ** 0.5
        assert abs(counts[token].item() - draws * probability) <= deviation


class _AllowSet:
    """A constraint allowing a fixed set of token ids (`sampling.TokenFilter`)."""

    def __init__(self, allowed: set[int]) -> None:
        self._allowed = allowed

    def allowed(self, token_id: int) -> bool:
        return token_id in self._allowed

    def allowed_tokens(self) -> list[int]:
        return sorted(self._allowed)


# Constrained draws follow the filtered distribution restricted to the allowed tokens:
# with candidates (top_k) and without (every token kept); the allowed set holds likely
# tokens (found by a few draws) and unlikely ones (found only after MAX_REJECTIONS).
@pytest.mark.parametrize("top_k", [0, 6])
def test_constrained_draws_follow_the_restricted_distribution(top_k: int) -> None:
    probs = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.05])
    allowed = {1, 3, 5, 6}  # 6 is outside the top 6
    params = SamplingParams(temperature=1.0, top_k=top_k, seed=17)
    kept = probs.clone()
    if top_k:
        kept[probs.argsort(descending=True)[top_k:]] = 0.0
    expected = torch.zeros_like(probs)
    for token in allowed:
        expected[token] = kept[token]
    expected /= expected.sum()
    sampler = Sampler(params)
    logits = torch.log(probs)
    draws = 20_000
    counts = torch.bincount(
        torch.tensor([sampler.sample(logits, _AllowSet(allowed)) for _ in range(draws)]),
        minlength=len(probs),
    )
    assert counts[expected == 0].sum() == 0
    for token, probability in enumerate(expected.tolist()):
        deviation = 4 * (draws * probability * (1 - probability)) ** 0.5
        assert abs(counts[token].item() - draws * probability) <= deviation, token


def test_constrained_draws_beyond_the_rejection_limit_stay_in_the_allowed_set() -> None:
    """An allowed token behind more than MAX_REJECTIONS likelier ones is still drawn from
    the restricted distribution; where the filters left no allowed token, the most likely
    allowed token of the unfiltered scores is taken."""
    logits = random_logits(8, vocab=2000)
    order = logits.argsort(descending=True).tolist()
    allowed = {order[100], order[500]}
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    drawn = {sampler.sample(logits, _AllowSet(allowed)) for _ in range(200)}
    assert drawn <= allowed and order[100] in drawn
    filtered = Sampler(SamplingParams(temperature=1.0, top_k=10, seed=3))
    assert filtered.sample(logits, _AllowSet(allowed)) == order[100]


@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_a_constraint_that_allows_the_token_keeps_the_seeded_draw(top_p: float) -> None:
    """Same seed: a constraint that rejects nothing gives the unconstrained tokens."""
    logits = random_logits(9, vocab=500)
    params = SamplingParams(temperature=0.8, top_p=top_p, seed=21)
    free, constrained = Sampler(params), Sampler(params)
    everything = _AllowSet(set(range(500)))
    assert [free.sample(logits) for _ in range(50)] == [
        constrained.sample(logits, everything) for _ in range(50)
    ]


def test_min_p_drops_tokens_below_fraction_of_top() -> None:
    logits = torch.log(torch.tensor([0.6, 0.25, 0.1, 0.05]))
    filtered = filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.2))
    # threshold 0.2 * 0.6 = 0.12: keeps 0.6 and 0.25
    assert torch.isfinite(filtered).tolist() == [True, True, False, False]


def test_filtered_tokens_are_never_sampled() -> None:
    logits = random_logits(3)
    params = SamplingParams(temperature=2.0, top_k=5, seed=9)
    allowed = set(logits.topk(5).indices.tolist())
    sampler = Sampler(params)
    assert {sampler.sample(logits) for _ in range(200)} <= allowed


def test_none_fields_take_card_defaults() -> None:
    defaults = SamplingDefaults(temperature=0.3, top_p=0.8, top_k=40, min_p=0.05)
    params = TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content="x"),), top_k=3, seed=5
    )
    resolved = resolve_sampling_params(params, defaults)
    assert resolved == SamplingParams(temperature=0.3, top_k=3, top_p=0.8, min_p=0.05, seed=5)


@pytest.mark.parametrize("temperature", [0.0, 0.5])
def test_explicit_zero_values_override_defaults(temperature: float) -> None:
    defaults = SamplingDefaults(temperature=0.9, top_k=50)
    params = TextGenerationTaskParams(
        model=ModelId("m"),
        messages=(ChatMessage(role="user", content="x"),),
        temperature=temperature,
        top_k=0,
    )
    resolved = resolve_sampling_params(params, defaults)
    assert resolved.temperature == temperature
    assert resolved.top_k == 0


def test_logit_bias_adds_to_the_named_tokens_only() -> None:
    logits = random_logits()
    biased = LogitBias({3: -100.0, 7: 2.5}, vocab_size=1000).apply(logits)
    expected = logits.clone()
    expected[3] -= 100.0
    expected[7] += 2.5
    assert torch.equal(biased, expected)
    assert not torch.equal(logits, expected)  # the input is left unchanged


def test_logit_bias_bans_and_forces_under_sampling() -> None:
    logits = random_logits()
    best = int(logits.argmax())
    banned = TokenChooser(
        Sampler(SamplingParams(temperature=0.0)), bias=LogitBias({best: -100.0}, 1000)
    )
    assert banned.needs_logits
    assert banned.choose(logits) != best
    forced = TokenChooser(
        Sampler(SamplingParams(temperature=1.0, seed=3)), bias=LogitBias({11: 100.0}, 1000)
    )
    assert [forced.choose(logits) for _ in range(20)] == [11] * 20
    assert not TokenChooser(Sampler(SamplingParams())).needs_logits


def test_logit_bias_outside_the_vocabulary_is_refused() -> None:
    with pytest.raises(ValueError, match="1000, 5000"):
        LogitBias({1000: 1.0, 5000: 1.0, 2: 1.0}, vocab_size=1000)
