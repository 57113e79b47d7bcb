"""Token sampling: penalties, temperature, top-k, top-p (nucleus), min-p, per-request seed,
optional constraints on which tokens may be drawn, and log probabilities.

Penalties come first (on the model's logits), then the filters in the order Hugging Face
transformers' logits processors use: temperature, then top-k, then top-p, then min-p
(min-p: Nguyen et al. 2024, "Turning Up the Heat").
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from exo.shared.types.chunks import MIN_LOGPROB
from exo.shared.types.models import SamplingDefaults
from exo.shared.types.text_generation import TextGenerationTaskParams


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Fully resolved sampling settings for one request.

    `temperature == 0` is greedy; `top_k == 0`, `top_p == 1`, `min_p == 0` disable a filter;
    `seed=None` draws a random seed. `presence_penalty == frequency_penalty == 0` and
    `repetition_penalty == 1` disable the penalties (see `TokenPenalties`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

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
    )


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Apply temperature, top-k, top-p and min-p to one step's logits.

    Args:
        logits: `[vocab]` float scores.
        params: the sampling settings; temperature must be > 0.

    Returns:
        `[vocab]` float32 logits with filtered-out tokens at -inf (at least one token kept).
    """
    scores = logits.float() / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth_largest = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth_largest, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=True)
        sorted_probs = torch.softmax(sorted_scores, dim=-1)
        # Keep a token while the mass of the tokens before it is still below top_p, so the
        # most likely token always survives.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        remove_sorted = mass_before >= params.top_p
        remove = torch.zeros_like(remove_sorted).scatter(0, sorted_indices, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    if params.min_p > 0.0:
        probs = torch.softmax(scores, dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return scores


class Sampler:
    """Draws tokens for one request with its own random generator, so a seed reproduces the
    same tokens regardless of other requests.

    Args:
        params: resolved sampling settings.
        device: where the logits live (the generator must be on the same device).
    """

    __slots__ = ("_generator", "params", "seed")

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.seed = params.seed if params.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator(device=device)
        self._generator.manual_seed(self.seed)

    def sample(self, logits: torch.Tensor) -> int:
        """Pick the next token.

        Args:
            logits: `[vocab]` scores of the last position.

        Returns:
            The token id.
        """
        if self.params.is_greedy:
            return int(torch.argmax(logits).item())
        probs = torch.softmax(filter_logits(logits, self.params), dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator).item())
