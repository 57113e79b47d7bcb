"""A request's sampling settings, resolved once from its fields and the model card's defaults."""

from __future__ import annotations

from dataclasses import dataclass

from exo.shared.types.models import SamplingDefaults
from exo.shared.types.text_generation import TextGenerationTaskParams

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily: `logits / temperature` leaves float32's range
below ~1e-37 (a NaN softmax), and long before that the draw is the argmax anyway. The
threshold is vLLM's sampling epsilon (`_SAMPLING_EPS` in vllm/sampling_params.py, 1e-5),
under which vLLM also treats a request as greedy."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Fully resolved sampling settings for one request.

    `temperature < GREEDY_TEMPERATURE` (0 included) or `top_k == 1` is greedy; `top_k == 0`,
    `top_p == 1`, `min_p == 0` disable a filter; `seed=None` draws a random seed.
    `presence_penalty == frequency_penalty == 0` and `repetition_penalty == 1` disable the
    penalties (see `TokenPenalties`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    repetition_window: int | None = None  # the last N tokens; None: all of them

    @property
    def is_greedy(self) -> bool:
        """The argmax is drawn: no random number, no division by the temperature."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


def resolve_sampling_params(
    params: TextGenerationTaskParams, defaults: SamplingDefaults
) -> SamplingParams:
    """Fill the request's unset (None) sampling fields from the model card's defaults."""
    return SamplingParams(
        temperature=defaults.temperature if params.temperature is None else params.temperature,
        top_k=defaults.top_k if params.top_k is None else params.top_k,
        top_p=defaults.top_p if params.top_p is None else params.top_p,
        min_p=defaults.min_p if params.min_p is None else params.min_p,
        seed=params.seed,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=(
            1.0 if params.repetition_penalty is None else params.repetition_penalty
        ),
        repetition_window=params.repetition_window,
    )
