"""Speculative decoding (issue 43), exact verification on one request's state alone (a
bigram "model" whose distribution is known): sampled tokens follow the target's
distribution, and a seed gives plain decoding's tokens whatever the draft."""

from __future__ import annotations

import dataclasses
import itertools
import math

import torch

from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.tests.speculative_builders import (
    BigramModel,
    bare_state,
    chi_square_p_value,
)


def test_sampled_tokens_follow_the_target_distribution_chi_square() -> None:
    """Two tokens after token 0, drafted greedily (the likeliest next tokens, accepted
    part of the time): over 6,000 seeds the pairs follow p(x1) p(x2 | x1) (36 cells), and
    the first draft token is accepted with probability p(draft)."""
    vocab, samples = 6, 6_000
    model = BigramModel(vocab, seed=5)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    target = torch.softmax(model.table / 0.8, dim=-1).double()  # [last, next]
    draft = [int(target[0].argmax()), int(target[int(target[0].argmax())].argmax())]
    counts = [0] * (vocab * vocab)
    accepted_first = 0
    for seed in range(samples):
        state = bare_state(dataclasses.replace(params, seed=seed))
        pieces, accepted = state.accept_drafts(model.rows(0, draft), draft)
        accepted_first += int(accepted >= 1)
        while not state.finished:  # a rejection: the next step drafts the likeliest token
            fed = state.generated_ids[-1]
            guess = [int(target[fed].argmax())]
            pieces, _ = state.accept_drafts(model.rows(fed, guess), guess)
        first, second = state.generated_ids
        counts[first * vocab + second] += 1
        assert pieces[-1].finish_reason == "length"
    expected = [
        samples * float(target[0, a] * target[a, b]) for a in range(vocab) for b in range(vocab)
    ]
    assert chi_square_p_value(counts, expected) > 1e-3
    share = accepted_first / samples
    bound = 4 * math.sqrt(float(target[0, draft[0]]) * (1 - float(target[0, draft[0]])) / samples)
    assert abs(share - float(target[0, draft[0]])) < bound


def test_a_seed_gives_the_tokens_of_plain_decoding_whatever_the_draft() -> None:
    model = BigramModel(8, seed=1)
    for seed, draft in itertools.product(range(40), ([1, 2, 3], [5, 5, 5, 5], [0])):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=0, min_p=0.0, seed=seed)
        plain = bare_state(params, max_tokens=6)
        last = 0
        while not plain.finished:
            plain.accept(model.table[last])
            last = plain.generated_ids[-1]
        speculative = bare_state(params, max_tokens=6)
        while not speculative.finished:
            fed = speculative.generated_ids[-1] if speculative.generated_ids else 0
            speculative.accept_drafts(model.rows(fed, draft), draft)
        assert speculative.generated_ids == plain.generated_ids, (seed, draft)
