"""Embedding and reranker models with no decoder: an `EmbeddingBackend` over exo's own encoder
forward (`encoder.py`: BERT, NomicBERT, XLM-RoBERTa; `gemma_encoder.py`: EmbeddingGemma), the
sentence-transformers head of the model folder (`sentence_modules.py`) and, for a cross-encoder
reranker (bge-reranker-v2-m3), its classification head.

`load_encoder_model(directory)` reads the folder the download fetched (config, safetensors,
tokenizer, `modules.json` and its module folders) into memory as float32; no quantized format.
bge-m3's sparse and ColBERT outputs (its `sparse_linear.pt` / `colbert_linear.pt`) are left out:
only its dense CLS embedding is computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from exo.chat_protocol.tokenizer_loading import load_tokenizer
from exo.worker.engines.torch.embedding.backend import run_to_end
from exo.worker.engines.torch.embedding.encoder import (
    ENCODER_MODEL_TYPES,
    ClassificationHead,
    Encoder,
    encoder_geometry,
)
from exo.worker.engines.torch.embedding.gemma_encoder import (
    GEMMA_MODEL_TYPE,
    GemmaEncoder,
    gemma_config,
)
from exo.worker.engines.torch.embedding.sentence_modules import SentenceHead, read_sentence_head
from exo.worker.engines.torch.embedding.weights import (
    EmbeddingModelError,
    read_json,
    read_safetensors,
)

# One forward's inputs: sorted by length (few pad tokens computed), at most this many rows and
# padded tokens (rows x longest), so that a batch of long inputs does not hold every
# activation at once; a single input longer than the token bound is one forward of its own.
_BATCH_ROWS = 64
_BATCH_TOKENS = 16384
_DEFAULT_POOLING = {GEMMA_MODEL_TYPE: "mean", "xlm-roberta": "cls"}

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""`(ids [B, S], mask [B, S] bool) -> hidden [B, S, hidden]`."""


class EncoderEmbeddingModel:
    """An `EmbeddingBackend` over an encoder (or EmbeddingGemma) forward.

    Attributes:
        max_input_tokens: tokens one input may have (the folder's `max_seq_length`, else the
            model's positions).
        dimensions: width of `embed`'s vectors (the last dense projection's, else hidden).
        matryoshka_dimensions: truncations the model supports, else None.
        tokenizer: the folder's tokenizer (transformers).
        weight_bytes: bytes of every tensor held (float32), for the runner's report.
    """

    def __init__(
        self,
        forward: Forward,
        head: SentenceHead,
        tokenizer: Any,
        max_input_tokens: int,
        dimensions: int,
        matryoshka_dimensions: tuple[int, ...] | None,
        classifier: ClassificationHead | None,
        vocab_size: int,
        weight_bytes: int = 0,
    ) -> None:
        self._forward = forward
        self.weight_bytes = weight_bytes
        self._vocab_size = vocab_size
        self._head = head
        self.tokenizer = tokenizer
        self._classifier = classifier
        self.max_input_tokens = max_input_tokens
        self.dimensions = dimensions
        self.matryoshka_dimensions = matryoshka_dimensions

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids with the model's special tokens (BERT `[CLS] .. [SEP]`, XLM-R
        `<s> .. </s>`, Gemma `<bos> .. <eos>`); never truncated (the runner decides)."""
        if not texts:
            return []
        encoded = self.tokenizer(list(texts), add_special_tokens=True)["input_ids"]
        return [list(ids) for ids in encoded]

    def _check(self, token_ids: Sequence[Sequence[int]]) -> None:
        """Raises ValueError: no inputs, an empty input, one over `max_input_tokens`, or a
        token id outside the vocabulary (named by its index)."""
        if not token_ids:
            raise ValueError("no inputs")
        for index, ids in enumerate(token_ids):
            if not ids:
                raise ValueError(f"input {index} has no tokens")
            if len(ids) > self.max_input_tokens:
                raise ValueError(
                    f"input {index} has {len(ids)} tokens, over the model's {self.max_input_tokens}"
                )
            if min(ids) < 0 or max(ids) >= self._vocab_size:
                raise ValueError(
                    f"input {index} has a token id outside the vocabulary [0, {self._vocab_size})"
                )

    def scratch_bytes(self, tokens: int) -> int:
        """See `EmbeddingBackend.scratch_bytes`: 0, an encoder runs each input whole
        within its context in one piece and keeps nothing between pieces."""
        return 0

    def start_embedding(self, token_ids: Sequence[Sequence[int]]) -> EncoderWork:
        """`embed`'s work, one length group per piece (`EncoderWork`).

        Raises:
            ValueError: as `embed`.
        """
        self._check(token_ids)
        return EncoderWork(self._forward, token_ids, self._head)

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[B, dimensions]` float32: pooled (and projected), not normalized.

        Raises:
            ValueError: no inputs, an empty input, one over `max_input_tokens`, or a token id
                outside the vocabulary (named by its index).
        """
        return run_to_end(self.start_embedding(token_ids))

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> EncoderWork | None:
        """`score_pairs`'s work (None when the model has no classification head)."""
        if self._classifier is None:
            return None
        classifier = self._classifier
        encoded: list[list[int]] = []
        if pairs:
            queries = [query for query, _ in pairs]
            documents = [document for _, document in pairs]
            encoded = self.tokenizer(
                queries, documents, truncation=True, max_length=self.max_input_tokens
            )["input_ids"]
            self._check(encoded)
        return EncoderWork(
            self._forward, encoded, lambda hidden, _mask: classifier.logits(hidden), torch.sigmoid
        )

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        """`[B]` float32 relevance in (0, 1): the sigmoid of the classification head's one
        logit over each `(query, document)` tokenized as a pair (truncated longest-first to
        `max_input_tokens`); None when the model has no such head.

        The sigmoid is what sentence-transformers' CrossEncoder applies to a one-label model
        and what Hugging Face TEI's `/rerank` returns unless `raw_scores` is asked, and it puts
        the scores on the 0..1 scale Jina's and Cohere's `relevance_score` use (and exo's
        Qwen3-Reranker scoring)."""
        work = self.start_scoring(pairs)
        return None if work is None else run_to_end(work)


class EncoderWork:
    """`EmbeddingWork` over an encoder: one length group (`_length_groups`) per piece,
    whatever the budget (bidirectional attention: an input is never cut); `finish` maps the
    stacked results (a reranker's sigmoid).

    Args:
        reduce: `(hidden [b, S, hidden], mask [b, S]) -> [b, ...]` per group (the sentence
            head's pooling, a classifier's logit).
    """

    def __init__(
        self,
        forward: Forward,
        token_ids: Sequence[Sequence[int]],
        reduce: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self._forward = forward
        self._inputs = [list(ids) for ids in token_ids]
        self._reduce = reduce
        self._finish = finish
        self.rows = len(self._inputs)
        self.tokens = sum(len(ids) for ids in self._inputs)
        self._groups = deque(_length_groups([len(ids) for ids in self._inputs]))
        self._results: list[torch.Tensor | None] = [None] * self.rows
        self._dropped: set[int] = set()

    @property
    def done(self) -> bool:
        return not self._groups

    def run_piece(self, budget: int | None) -> int:
        """See `EmbeddingWork.run_piece` (`budget` is not read: one group per piece)."""
        while self._groups:
            group = [index for index in self._groups.popleft() if index not in self._dropped]
            if group:
                return self._run_group(group)
        return 0

    @torch.inference_mode()
    def _run_group(self, group: list[int]) -> int:
        length = len(self._inputs[group[-1]])
        batch_ids = torch.zeros(len(group), length, dtype=torch.long)
        mask = torch.zeros(len(group), length, dtype=torch.bool)
        for row, index in enumerate(group):
            ids = self._inputs[index]
            batch_ids[row, : len(ids)] = torch.tensor(ids)
            mask[row, : len(ids)] = True
        reduced = self._reduce(self._forward(batch_ids, mask), mask)
        for row, index in enumerate(group):
            self._results[index] = reduced[row]
        return sum(len(self._inputs[index]) for index in group)

    def drop(self, rows: Iterable[int]) -> None:
        """See `EmbeddingWork.drop`."""
        self._dropped.update(rows)

    def result(self) -> torch.Tensor:
        """See `EmbeddingWork.result` (no rows: an empty tensor)."""
        if not self.done:
            raise RuntimeError("the embedding work is not done")
        template = next((result for result in self._results if result is not None), None)
        if template is None:  # no rows, or every row dropped
            return torch.empty(0)
        stacked = torch.stack(
            [torch.zeros_like(template) if result is None else result for result in self._results]
        ).float()
        return stacked if self._finish is None else self._finish(stacked)


def _length_groups(lengths: Sequence[int]) -> list[list[int]]:
    """Input indices grouped for one forward each: ascending length, each group at most
    `_BATCH_ROWS` rows and `_BATCH_TOKENS` padded tokens (its last, longest input's length
    times its rows), a lone input exceeding that on its own."""
    groups: list[list[int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) >= _BATCH_ROWS
            or (len(group) + 1) * lengths[index] > _BATCH_TOKENS
        ):
            groups.append([index])
        else:
            group.append(index)
    return groups


def load_encoder_model(
    directory: Path, matryoshka_dimensions: tuple[int, ...] | None = None
) -> EncoderEmbeddingModel:
    """The embedding (or reranker) model in `directory`.

    Args:
        matryoshka_dimensions: the widths the model supports truncation to (its card's, or
            `MATRYOSHKA_DIMENSIONS`); None: none.

    Raises:
        EmbeddingModelError: a model type that is neither an encoder nor EmbeddingGemma, or a
            file or tensor the model needs is missing or unsupported (named).
    """
    origin = str(directory / "config.json")
    config = read_json(directory / "config.json")
    model_type = str(config.get("model_type"))
    tensors = read_safetensors(directory)
    forward: Forward
    if model_type == GEMMA_MODEL_TYPE:
        parsed = gemma_config(config, origin)
        gemma = GemmaEncoder(parsed, tensors, origin)
        forward, vocab_size = gemma.forward, int(gemma.embed.shape[0])
        hidden_size = int(parsed.hidden_size)
        max_positions = int(parsed.max_position_embeddings)
    elif model_type in ENCODER_MODEL_TYPES:
        geometry = encoder_geometry(config, origin)
        encoder = Encoder.from_tensors(geometry, tensors)
        forward, vocab_size = encoder.forward, int(encoder.word.shape[0])
        hidden_size, max_positions = geometry.hidden_size, geometry.max_positions
    else:
        raise EmbeddingModelError(
            f"{origin}: model_type {model_type!r} is not an embedding model exo computes "
            f"({', '.join((*ENCODER_MODEL_TYPES, GEMMA_MODEL_TYPE))})"
        )
    architectures = config.get("architectures") or []
    classifier = None
    if any(str(name).endswith("ForSequenceClassification") for name in architectures):
        classifier = ClassificationHead.from_tensors(tensors)
    head = read_sentence_head(directory, _DEFAULT_POOLING.get(model_type, "mean"))
    dimensions = int(head.projections[-1].weight.shape[0]) if head.projections else hidden_size
    if matryoshka_dimensions is not None and any(
        width > dimensions or width <= 0 for width in matryoshka_dimensions
    ):
        raise EmbeddingModelError(
            f"matryoshka dimensions {matryoshka_dimensions} do not fit the model's {dimensions}"
        )
    limit = min(head.max_seq_length or max_positions, max_positions)
    weight_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
    return EncoderEmbeddingModel(
        forward, head, load_tokenizer(directory), limit, dimensions, matryoshka_dimensions,
        classifier, vocab_size, weight_bytes,
    )  # fmt: skip
