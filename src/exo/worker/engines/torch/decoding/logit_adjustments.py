"""Adjustments to a step's logits before sampling: repetition, presence and frequency
penalties over the tokens a request has seen, and per-token logit bias (OpenAI's
`logit_bias`)."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

import torch

from exo.worker.engines.torch.decoding.sampling_params import SamplingParams


class TokenPenalties:
    """Penalty state of one request: counts of the tokens seen so far, kept incrementally
    (one element updated per token) so applying them costs O(vocab) per step, not
    O(tokens).

    - presence / frequency (OpenAI, https://platform.openai.com/docs/advanced-usage, "Frequency
      and presence penalties"): `logit -= presence * (count > 0) + frequency * count`, with
      `count` over the *generated* tokens only.
    - repetition (Keskar et al. 2019, "CTRL", section 4.1, as transformers'
      `RepetitionPenaltyLogitsProcessor` applies it): every token seen in the prompt or the
      output has a positive logit divided by the penalty, a negative one multiplied by it.
      With `repetition_window` N, only the last N tokens of prompt and output count (as
      llama.cpp's and Ollama's `repeat_last_n`): a count per token id over a sliding window.

    Repetition is applied first, then presence/frequency (the order vLLM uses).

    Args:
        params: the request's resolved settings (its three penalty fields are read).
        vocab_size: length of the logits vectors (the model's output size).
        device: where the logits live.
    """

    __slots__ = (
        "_additive",
        "_frequency",
        "_generated_seen",
        "_presence",
        "_recent",
        "_repetition",
        "_seen",
        "_window",
        "_window_counts",
    )

    def __init__(
        self, params: SamplingParams, vocab_size: int, device: torch.device | str = "cpu"
    ) -> None:
        self._presence = params.presence_penalty
        self._frequency = params.frequency_penalty
        self._repetition = params.repetition_penalty
        # presence * (count > 0) + frequency * count, per token id.
        self._additive = torch.zeros(vocab_size, dtype=torch.float32, device=device)  # [vocab]
        # Token ids seen in prompt + output (the repetition penalty's set).
        self._seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)  # [vocab]
        self._generated_seen: set[int] = set()
        # With a window: the window's token ids in order, and how often each id is in it.
        self._window = params.repetition_window
        self._recent: deque[int] = deque()
        self._window_counts: dict[int, int] = {}

    def observe_prompt(self, token_ids: Iterable[int]) -> None:
        """Record the prompt's tokens (they count for the repetition penalty only)."""
        if self._repetition == 1.0:
            return
        if self._window is not None:
            for token_id in list(token_ids)[-self._window :]:
                self._enter_window(token_id)
            return
        ids = torch.tensor(list(token_ids), dtype=torch.long, device=self._seen.device)
        ids = ids[(ids >= 0) & (ids < self._seen.shape[0])]
        self._seen[ids] = True

    def _enter_window(self, token_id: int) -> None:
        """Slide the repetition window over one more token (an id outside the vocabulary
        takes a place in the window but marks nothing)."""
        assert self._window is not None
        self._recent.append(token_id)
        self._count(token_id, 1)
        if len(self._recent) > self._window:
            self._count(self._recent.popleft(), -1)

    def _count(self, token_id: int, change: int) -> None:
        if not 0 <= token_id < self._seen.shape[0]:
            return
        count = self._window_counts.get(token_id, 0) + change
        if count:
            self._window_counts[token_id] = count
        else:
            self._window_counts.pop(token_id, None)
        self._seen[token_id] = count > 0

    def observe(self, token_id: int) -> None:
        """Record one generated token."""
        if self._repetition != 1.0 and self._window is not None:
            self._enter_window(token_id)
        if not 0 <= token_id < self._seen.shape[0]:
            return
        if self._repetition != 1.0 and self._window is None:
            self._seen[token_id] = True
        if self._presence != 0.0 or self._frequency != 0.0:
            increment = self._frequency
            if token_id not in self._generated_seen:
                self._generated_seen.add(token_id)
                increment += self._presence
            self._additive[token_id] += increment

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Penalised copy of one step's logits.

        Args:
            logits: `[vocab]` scores (left unchanged).

        Returns:
            `[vocab]` float32 penalised scores.
        """
        scores = logits.float()
        if self._repetition != 1.0:
            penalised = torch.where(
                scores > 0, scores / self._repetition, scores * self._repetition
            )
            scores = torch.where(self._seen, penalised, scores)
        if self._presence != 0.0 or self._frequency != 0.0:
            scores = scores - self._additive
        return scores


class LogitBias:
    """A request's `logit_bias`: a fixed number added to chosen tokens' logits at every
    step (OpenAI's semantics: after the penalties, before temperature and the filters).

    Args:
        bias: token id -> bias (already range-checked by `TextGenerationTaskParams`).
        vocab_size: length of the logits vectors.
        device: where the logits live.

    Raises:
        ValueError: a token id outside the vocabulary (the request is at fault).
    """

    __slots__ = ("_ids", "_values")

    def __init__(
        self, bias: Mapping[int, float], vocab_size: int, device: torch.device | str = "cpu"
    ) -> None:
        outside = sorted(token_id for token_id in bias if not 0 <= token_id < vocab_size)
        if outside:
            raise ValueError(
                f"logit_bias names token ids outside the model's vocabulary of {vocab_size} "
                f"tokens: {', '.join(str(token_id) for token_id in outside[:5])}"
            )
        self._ids = torch.tensor(list(bias), dtype=torch.long, device=device)  # [biased]
        self._values = torch.tensor(
            list(bias.values()), dtype=torch.float32, device=device
        )  # [biased]

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Biased copy of one step's logits.

        Args:
            logits: `[vocab]` scores (left unchanged).

        Returns:
            `[vocab]` float32 scores with the biases added.
        """
        return logits.float().index_add(0, self._ids, self._values)
