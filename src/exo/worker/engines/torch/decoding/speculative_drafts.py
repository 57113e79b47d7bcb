"""Draft tokens for speculative decoding: where guesses of a request's next tokens come from.

Speculative decoding (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding"; Chen et al. 2023, "Accelerating Large Language Model Decoding with
Speculative Sampling") verifies k guessed tokens in one forward pass of the target model
over k + 1 positions: on a CPU, where a decode step is bound by reading the weights, those
positions cost little more than one. The guesses come from a `DraftSource`; the verification
(exact: the output is distributed as the target's) is the scheduler's and the request's
(`batching/scheduler.py`, `RequestState.accept_drafts`).

Sources:
- `NgramDraftSource`: prompt lookup (no extra model). The last n tokens of the request's
  text (prompt and reply so far) are looked up among its earlier text; the tokens that
  followed their latest earlier occurrence are the draft. The longest n in
  `[min_ngram, max_ngram]` with an earlier occurrence wins. This is the idea of llama.cpp's
  n-gram lookup decoding and vLLM's "[ngram]" prompt-lookup proposer (Saxena 2023,
  "Prompt Lookup Decoding"); it wins where the reply copies its context (code edits, quoting,
  answers from retrieved text) and proposes nothing otherwise.
- A draft model (a small model with the target's tokenizer; `draft_model.DraftModelSource`,
  on the target's node): `propose` takes every speculating request of a step at once (one
  batched forward of the draft model per draft position), `forget` frees a request's state
  (its draft KV), and a sampling request's `Draft` carries the draft's own distribution
  (`probabilities`) for the general rejection rule (`RequestState.accept_drafts`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from exo.worker.engines.torch.decoding.sampling_params import SamplingParams

# Longest and shortest n-gram (suffix of the text, in tokens) looked up. Longer suffixes
# are tried first: a match of 3 tokens predicts the continuation better than a match of 1.
# vLLM's prompt lookup takes both bounds as options as well; a 1-token match proposes
# too often on free text (every repeated common token) to be worth its rows.
DEFAULT_MAX_NGRAM = 3
DEFAULT_MIN_NGRAM = 2


@dataclass(frozen=True, slots=True)
class DraftRequest:
    """What a draft source sees of one request at one step.

    Attributes:
        request_id: the request (a source keeps per-request state under it).
        tokens: the request's prompt and generated tokens, the last one being the token this
            step feeds (its KV not yet computed). Read-only: the scheduler's own list.
        max_tokens: the most draft tokens the step has room for (>= 1).
        sampling: the request's sampling settings (None or greedy: a draft model proposes
            its likeliest tokens, without `probabilities`; else it draws them from its own
            distribution under these settings).
        seed: the request's seed (a draft model seeds its own draws from it).
    """

    request_id: str
    tokens: Sequence[int]
    max_tokens: int
    sampling: SamplingParams | None = None
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Draft:
    """Guessed next tokens of one request.

    Attributes:
        tokens: the guesses, in order (empty: no guess; the request decodes plainly).
        probabilities: None for a deterministic guess (n-gram: the draft distribution is one
            token with probability 1), else `[len(tokens), vocab]` float32, the draft
            model's distribution at each guess, for the general acceptance rule (accept
            with probability `min(1, p / q)`, else draw from `max(0, p - q)` renormalised;
            `RequestState.accept_drafts`).
    """

    tokens: tuple[int, ...] = ()
    probabilities: torch.Tensor | None = None


NO_DRAFT = Draft()


class DraftSource(Protocol):
    """Proposes draft tokens for the speculating requests of a step."""

    @property
    def name(self) -> str:
        """Short name for logs and metrics ("ngram", a draft model's id)."""
        ...

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        """One draft per request, in order, each at most its `max_tokens` long."""
        ...

    def forget(self, request_id: str) -> None:
        """The request left the batch: drop what is kept for it."""
        ...


@dataclass(slots=True)
class _NgramIndex:
    """One request's n-grams: for each n in the source's range, each n-gram of its text ->
    the index right after its latest occurrence whose next token is known."""

    indexed: int = 0  # tokens[:indexed] have had every n-gram ending before them recorded
    # n -> n-gram -> start of its continuation
    continuations: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)


class NgramDraftSource:
    """Prompt-lookup drafts (see the module docstring).

    Each request's n-grams are indexed incrementally (the tokens added since the last step
    only), so a step costs O(new tokens x n-gram sizes) dictionary operations per request,
    not a scan of its text.

    Args:
        max_ngram / min_ngram: the suffix lengths tried, longest first.

    Raises:
        ValueError: `min_ngram` < 1 or above `max_ngram`.
    """

    def __init__(
        self, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = DEFAULT_MIN_NGRAM
    ) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"n-gram sizes {min_ngram}..{max_ngram}: need 1 <= min <= max")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexes: dict[str, _NgramIndex] = {}

    @property
    def name(self) -> str:
        return "ngram"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        return [self._propose(request) for request in requests]

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def _propose(self, request: DraftRequest) -> Draft:
        tokens = request.tokens
        index = self._index(request.request_id, tokens)
        length = len(tokens)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            start = index.continuations[n].get(tuple(tokens[length - n :]))
            if start is None:
                continue
            # The continuation may run into the suffix itself (a repeating pattern): it
            # stops at the text's end.
            draft = tuple(tokens[start : min(length, start + request.max_tokens)])
            if draft:
                return Draft(draft)
        return NO_DRAFT

    def _index(self, request_id: str, tokens: Sequence[int]) -> _NgramIndex:
        """The request's index, brought up to `tokens` (rebuilt where the text is not an
        extension of the one indexed: a request id reused)."""
        index = self._indexes.get(request_id)
        if index is None or index.indexed > len(tokens):
            index = _NgramIndex(continuations={n: {} for n in self._sizes()})
            self._indexes[request_id] = index
        # An n-gram ending at position end - 1 is recorded once the token at `end` (its
        # continuation's first) is known: every n-gram of the text but its own suffix.
        for end in range(max(index.indexed, 1), len(tokens)):
            for n in self._sizes():
                if end >= n:
                    index.continuations[n][tuple(tokens[end - n : end])] = end
        index.indexed = max(index.indexed, len(tokens))
        return index

    def _sizes(self) -> range:
        return range(self.min_ngram, self.max_ngram + 1)
