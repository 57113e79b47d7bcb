"""The sampler's Gumbel-max race (`decoding/gumbel_race.py`): its hash is splitmix64, the
native kernel gives the torch reference's perturbed scores bit for bit on each of its paths,
the race samples softmax(logits / T) (chi-square over fixed keys), a constrained draw
samples the restricted distribution, and a seeded draw survives the tiny logit changes of
another computation path (the cumulative-sum draw it replaced did not)."""

from __future__ import annotations

import math

import pytest
import torch

from exo.worker.engines.torch.decoding.gumbel_race import (
    _hash31,
    key_uniform,
    native_gumbel_kernel,
    race_index,
    race_probabilities,
    reference_gumbel_scores,
    splitmix64,
)
from exo.worker.engines.torch.decoding.sampling import Sampler
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel
from exo.worker.engines.torch.tests.speculative_builders import chi_square_p_value

native_int4_kernel()  # loads exo's native library and hands the sampler its race kernel

# Keys spread over the 63 bits (a fixed sequence: the tests are deterministic).
KEYS = [splitmix64(2026, draw) >> 1 for draw in range(20_000)]


def test_the_hash_is_splitmix64() -> None:
    """The torch hash's 31 bits are the top of the 32-bit half `id % 2` of splitmix64's
    output `id // 2 + 1` for the key, checked against Python integers (Vigna's splitmix64.c
    gives 0xE220A8397B1DCDAF first for seed 0, which the Python function reproduces)."""
    assert splitmix64(0, 1) == 0xE220A8397B1DCDAF
    ids = torch.tensor([0, 1, 2, 3, 49151, 262143, 2**40 + 1], dtype=torch.int64)
    for key in (0, 1, 2**63 - 1, KEYS[7]):
        expected = [
            (splitmix64(key, int(token) // 2 + 1) >> (32 * (int(token) % 2)) & 0xFFFFFFFF) >> 1
            for token in ids
        ]
        assert _hash31(key, ids).tolist() == expected
    uniforms = [key_uniform(key) for key in KEYS[:2000]]
    assert min(uniforms) >= 0.0 and max(uniforms) < 1.0
    assert abs(sum(uniforms) / len(uniforms) - 0.5) < 0.02


def _built_widths() -> list[int]:
    kernel = native_gumbel_kernel()
    if kernel is None:
        return []
    widths = []
    for width in (512, 256, 1):
        try:
            kernel(torch.zeros(1), None, 0, width)
        except RuntimeError:  # this path is not built here
            continue
        widths.append(width)
    return widths


@pytest.mark.parametrize("size", [1, 15, 16, 17, 1000, 49_152, 262_144])
def test_the_native_kernel_equals_the_torch_reference_bit_for_bit(size: int) -> None:
    """Every built path (512-bit, 256-bit, scalar), with and without candidate ids, over
    tails shorter than a vector: the same float32 bits, so the same winner."""
    widths = _built_widths()
    if not widths:
        pytest.skip("exo's native kernels are not built here")
    kernel = native_gumbel_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(size)
    scores = torch.randn(size, generator=generator) * 4
    scores[0] = float("-inf")  # a filtered-out token stays -inf
    ids = torch.randperm(300_000, generator=generator)[:size]
    for key in (0, 2**63 - 1, *KEYS[:3]):
        for candidate_ids in (None, ids):
            expected = reference_gumbel_scores(scores, candidate_ids, key)
            for width in widths:
                got = kernel(scores, candidate_ids, key, width)
                assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), width
                assert int(got.argmax()) == int(expected.argmax())


def test_the_noise_is_gumbel_to_float32_precision() -> None:
    """G against -log(-log U) in float64 from the same 31 bits: within 2e-6."""
    ids = torch.arange(100_000, dtype=torch.int64)
    noise = reference_gumbel_scores(torch.zeros(len(ids)), ids, KEYS[0]).double()
    bits = _hash31(KEYS[0], ids).double()
    exact = -torch.log(-torch.log1p(-(bits + 0.5) / 2**31))
    assert float((noise - exact).abs().max()) < 2e-6


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_race_samples_the_softmax_chi_square(temperature: float) -> None:
    """20,000 draws over a 6-token vocabulary (fixed keys): counts fit softmax(logits / T)."""
    logits = torch.tensor([2.0, 1.5, 0.3, 0.0, -1.0, -2.5])
    expected = torch.softmax(logits / temperature, dim=-1).tolist()
    counts = [0] * len(logits)
    for key in KEYS:
        counts[race_index(logits / temperature, None, key)] += 1
    assert chi_square_p_value(counts, [share * len(KEYS) for share in expected]) > 1e-3


def test_the_race_over_probabilities_and_a_subset_samples_them_chi_square() -> None:
    """`Sampler.draw`'s race over given probabilities (zeros never drawn), and a
    constrained draw (the race's best allowed token) follow the renormalised distribution."""
    probs = torch.tensor([0.3, 0.0, 0.25, 0.05, 0.4], dtype=torch.float64)
    counts = [0] * len(probs)
    for key in KEYS[:10_000]:
        counts[race_probabilities(probs, key)] += 1
    assert counts[1] == 0
    shares = [float(p) * 10_000 for p in probs]
    assert (
        chi_square_p_value(
            [c for c, s in zip(counts, shares, strict=True) if s > 0], [s for s in shares if s > 0]
        )
        > 1e-3
    )

    class OddTokens:
        def allowed(self, token_id: int) -> bool:
            return token_id % 2 == 1

        def allowed_tokens(self) -> list[int]:
            return [1, 3, 5]

    logits = torch.tensor([3.0, 1.0, 2.5, 0.5, 2.0, 0.0])
    allowed = torch.softmax(logits[[1, 3, 5]], dim=-1).tolist()
    counts = [0] * len(logits)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    for _ in range(6000):
        counts[sampler.sample(logits, OddTokens())] += 1
    assert counts[0] == counts[2] == counts[4] == 0
    assert chi_square_p_value([counts[1], counts[3], counts[5]], [6000 * p for p in allowed]) > 1e-3


def test_a_constrained_draw_takes_the_unconstrained_token_when_allowed_and_one_key() -> None:
    """Where the race's winner is allowed the constraint changes nothing, and a rejection
    takes no extra key: the next draws stay the unconstrained run's."""
    logits = 2 * torch.randn(2000, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.8, seed=9)
    free, bound = Sampler(params), Sampler(params)

    class AllButOne:
        def __init__(self, banned: int) -> None:
            self.banned = banned

        def allowed(self, token_id: int) -> bool:
            return token_id != self.banned

        def allowed_tokens(self) -> list[int]:
            return [token for token in range(2000) if token != self.banned]

    for step in range(40):
        token = free.sample(logits)
        banned = token if step % 4 == 0 else -1
        constrained = bound.sample(logits, AllButOne(banned))
        assert (constrained == token) == (banned != token)


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_seeded_draw_survives_tiny_logit_changes(temperature: float, top_p: float) -> None:
    """The defect: the same seed on logits that moved by ~1e-4 relative (another
    computation path: a prefix-cache hit, a batch, a split). The cumulative-sum draw changed
    ~19 % of such draws over a 49,152-token vocabulary; the race changes one only where
    two perturbed scores lie within the change, here none of 300."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(49_152, generator=generator) * 2.5
    moved = logits * (1 + 1e-4 * torch.randn(49_152, generator=generator))
    changed = 0
    for seed in range(300):
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=seed)
        changed += Sampler(params).sample(logits) != Sampler(params).sample(moved)
    assert changed == 0


def test_the_race_is_keyed_by_token_id_not_candidate_position() -> None:
    """A token's noise is the same whatever the filters left: the race over a candidate
    subset (any order) picks the subset's best perturbed score of the whole vocabulary."""
    scores = torch.randn(5000, generator=torch.Generator().manual_seed(2))
    ids = torch.randperm(5000, generator=torch.Generator().manual_seed(3))[:700]
    for key in KEYS[:50]:
        whole = reference_gumbel_scores(scores, None, key)
        subset = int(ids[race_index(scores[ids], ids, key)])
        assert subset == int(ids[int(whole[ids].argmax())])
        assert math.isfinite(float(whole[subset]))
