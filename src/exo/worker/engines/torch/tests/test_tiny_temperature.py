"""A temperature above 0 but below 1e-5 (the API takes any value in [0, 2]) is greedy.

Found by a new-user trial (2026-12-07): below ~1e-37, `logits / temperature` left float32's
range, the softmax went NaN and every draw took the vocabulary's last entries
(`"temperature": 1e-38` on the default model answered six `'\\xd3'` tokens instead of
"Hello there! How can I", which 1e-37 and 0 give), in every dialect alike: the decision is
the sampler's (`SamplingParams.is_greedy`)."""

import pytest
import torch

from exo.worker.engines.torch.decoding.sampling import sample_unconstrained
from exo.worker.engines.torch.decoding.sampling_params import GREEDY_TEMPERATURE, SamplingParams


@pytest.mark.parametrize("temperature", [1e-38, 1e-45, 1e-6])
def test_a_tiny_temperature_draws_the_likeliest_token(temperature: float) -> None:
    logits = torch.randn(49152, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=temperature, seed=1)
    assert params.is_greedy
    for key in (0, 3, 2**63 - 1):
        assert sample_unconstrained(logits, params, key) == int(torch.argmax(logits))


def test_a_temperature_at_the_threshold_still_samples() -> None:
    assert not SamplingParams(temperature=GREEDY_TEMPERATURE).is_greedy
