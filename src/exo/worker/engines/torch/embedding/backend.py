"""The protocol every embedding model implements for the runner: decoder models pooled
(`decoder.DecoderEmbeddingBackend`) and encoder models alike.

The runner tokenizes text inputs through `tokenize` (token-id inputs skip it), checks
each input against `max_input_tokens` (truncating or refusing), calls `embed` once per
batch of requests, then cuts each vector to the request's `dimensions` and L2-normalizes
it. Rerankers answer `score_pairs`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class EmbeddingBackend(Protocol):
    max_input_tokens: int
    """The model's context for one input, in tokens (special tokens included)."""
    dimensions: int
    """Width of the pooled vector `embed` returns."""
    matryoshka_dimensions: tuple[int, ...] | None
    """Truncated widths the model was trained to support, else None."""

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's token ids, with the model's own special tokens; never truncated."""
        ...

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[B, dimensions]` float32: the model's pooling (and its dense projection) applied,
        not L2-normalized."""
        ...

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        """`[B]` float32 relevance of each (query, document) for a reranker; None if the
        model is not one."""
        ...
