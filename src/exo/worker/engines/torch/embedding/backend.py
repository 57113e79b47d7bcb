"""The protocol every embedding model implements for the runner: decoder models pooled
(`decoder.DecoderEmbeddingBackend`) and encoder models alike.

The runner tokenizes text inputs through `tokenize` (token-id inputs skip it), checks
each input against `max_input_tokens` (truncating or refusing), starts one
`EmbeddingWork` per batch of requests (`start_embedding`; a reranker's per request,
`start_scoring`) and runs it a piece at a time between the decode steps of the streams
running on the same instance, then cuts each vector to the request's `dimensions` and
L2-normalizes it. `embed` and `score_pairs` run a work to its end in pieces of no bound.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import torch


class EmbeddingWork(Protocol):
    """The forward passes of one batch of inputs, run a piece at a time.

    A piece is either a group of whole inputs (longest first, their padded tokens within
    the piece's budget) or the next chunk of one input longer than the budget, where the
    model can prefill an input in chunks (a decoder through exo's forward); otherwise (an
    encoder's bidirectional attention, transformers' forward) such an input is one piece.

    Attributes:
        rows: the number of inputs.
        tokens: their tokens, summed (what the request is charged).
    """

    rows: int
    tokens: int

    @property
    def done(self) -> bool:
        """Every input not dropped has its result."""
        ...

    def run_piece(self, budget: int | None) -> int:
        """Run the next piece of at most `budget` tokens (None: no bound, the model's own
        batching; an input is never cut). Returns the tokens it computed (0 once done)."""
        ...

    def drop(self, rows: Iterable[int]) -> None:
        """Nobody waits for `rows` any more: they are skipped, and a chunked input among
        them is abandoned with its scratch cache."""
        ...

    def result(self) -> torch.Tensor:
        """`[rows, dimensions]` float32 pooled vectors (not normalized; a reranker's work:
        `[rows]` scores); a dropped row's values are undefined.

        Raises:
            RuntimeError: the work is not done.
        """
        ...


# Memory left to the rest of the node when an input's scratch memory is checked against the
# memory free now (`check_scratch_memory`): the runner's own activations for a piece, the
# tokenizer, other processes' growth meanwhile.
SCRATCH_MEMORY_MARGIN_BYTES = 512 * 1024 * 1024


class ScratchMemoryError(ValueError):
    """An input whose scratch memory (`EmbeddingBackend.scratch_bytes`) would not fit the
    memory free on the node; the message says how much it needs and how much is free."""


def free_memory_bytes() -> int:
    """Memory the node can give now without swapping (`psutil`'s `available`), in bytes."""
    import psutil

    return int(psutil.virtual_memory().available)


def check_scratch_memory(needed: int, tokens: int) -> None:
    """Raises ScratchMemoryError when an input of `tokens` whose embedding holds `needed`
    bytes would leave less than `SCRATCH_MEMORY_MARGIN_BYTES` of the memory free now."""
    free = free_memory_bytes()
    if needed > free - SCRATCH_MEMORY_MARGIN_BYTES:
        raise ScratchMemoryError(
            f"an input of {tokens} tokens needs {needed / 2**30:.2f} GiB of scratch KV cache "
            f"to embed in chunks; {free / 2**30:.2f} GiB of memory is free on this node"
        )


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

    def scratch_bytes(self, tokens: int) -> int:
        """Bytes of memory beyond the weights that embedding one input of `tokens` holds
        across its pieces (a decoder's chunked prefill: its scratch KV cache), 0 where
        nothing grows with the input between pieces."""
        ...

    def start_embedding(self, token_ids: Sequence[Sequence[int]]) -> EmbeddingWork:
        """The work of pooling each input (`embed`'s vectors, a piece at a time).

        Raises:
            ValueError: an empty input (or one the model cannot take: named).
        """
        ...

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> EmbeddingWork | None:
        """The work of scoring each (query, document) (`score_pairs`), None if the model is
        no reranker."""
        ...

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[B, dimensions]` float32: the model's pooling (and its dense projection) applied,
        not L2-normalized."""
        ...

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        """`[B]` float32 relevance of each (query, document) for a reranker; None if the
        model is not one."""
        ...


def run_to_end(work: EmbeddingWork) -> torch.Tensor:
    """Run `work` in pieces of no bound and return its result."""
    while not work.done:
        work.run_piece(None)
    return work.result()
