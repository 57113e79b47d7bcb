"""Embeddings and rerank scores from a decoder (causal LM) shard held whole on one rank.

Pooling reads the final norm's hidden states (`model.model(...).last_hidden_state`, the
states the LM head reads):
- "last": the last token's state (Qwen3-Embedding, whose tokenizer appends
  `<|endoftext|>`; it is appended here too where a tokenizer does not);
- "mean": the mean over the input's tokens (any chat model asked for embeddings;
  llama-server pools a chat model the same way by default, `--pooling mean`).
Reranking (`yes_no`): Qwen3-Reranker's documented prompt (system line, `<Instruct>`,
`<Query>`, `<Document>`, an empty thinking section) and score = softmax over the logits
of "no" and "yes" at the last position, taking "yes" (the model card's usage example).

The forward is exo's own (`lean_states.LeanFinalStates`: the lean step a generation's
prefill runs, over a scratch KV cache, each input causal on its own) wherever the model has
a lean step; elsewhere (`EXO_LEAN_FORWARD=0`, a part the lean forward does not run)
transformers' forward over the loaded modules (`model.model(...)`), inputs right-padded to
the longest (a causal model's states at real positions never see the padding after them).
Either way inputs run in sub-batches of at most `BATCH_TOKENS` padded tokens, longest first,
so one long input does not pad many short ones (the lean step packs them unpadded, and the
bound holds its scratch cache, one slot of the longest input's length per input).

The runner runs that work a piece at a time (`DecoderWork`, the `EmbeddingWork` protocol)
so that streams decoding on the same instance keep their pace: a piece is a group of
whole inputs within the piece's token budget, or, for an input longer than the budget,
its next chunk, prefilled over its own scratch cache as a generation's long prompt is
(`lean_states.ChunkedInput`; transformers' forward runs such an input whole). A work run
in pieces of no bound (`embed`, `score_pairs`) groups inputs exactly as before.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from exo.shared.types.models import EmbeddingPooling
from exo.worker.engines.torch.embedding.backend import run_to_end
from exo.worker.engines.torch.embedding.lean_states import (
    ChunkedInput,
    LeanFinalStates,
    lean_final_states,
)

# Padded tokens in one forward pass of an embedding batch: bounds its activations
# (a [BATCH_TOKENS, hidden] float32 state per layer; the lean step's scratch keys and
# values) while keeping short texts batched.
BATCH_TOKENS = 8192
# Reranked documents whose yes/no logits one LM-head call computes (`[rows, vocab]` float32).
HEAD_ROWS = 64

RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the "
    'Instruct provided. Note that the answer can only be "yes" or "no".'
)
RERANK_INSTRUCTION = "Given a web search query, retrieve relevant passages that answer the query"
"""Qwen3-Reranker's default task instruction (its model card's usage example)."""
RERANK_PREFIX = f"<|im_start|>system\n{RERANK_SYSTEM}<|im_end|>\n<|im_start|>user\n"
RERANK_SUFFIX = "<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


class DecoderEmbeddingBackend:
    """`EmbeddingBackend` over a loaded causal LM (`model`: a transformers `*ForCausalLM`
    whose `model` attribute is the decoder with its final norm, weights loaded).

    Args:
        pooling: "last" or "mean" (module docstring).
        context_length: the model's context in tokens (`max_input_tokens`).
        matryoshka_dimensions: the card's Matryoshka widths, or None.
        reranker: score pairs Qwen3-Reranker's way (`score_pairs`); False: None.
        kv_dtype: a chunked input's scratch KV cache's dtype (`lean_states`; the runner's).

    Raises:
        ValueError: a reranker whose tokenizer has no single "yes" and "no" tokens.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        device: torch.device,
        pooling: EmbeddingPooling,
        context_length: int,
        matryoshka_dimensions: tuple[int, ...] | None = None,
        reranker: bool = False,
        kv_dtype: torch.dtype = torch.float32,
    ) -> None:
        self._model = model
        self._tokenizer = tokenizer
        self._device = device
        self.pooling: EmbeddingPooling = pooling
        self.max_input_tokens = context_length
        self.dimensions = int(model.config.get_text_config().hidden_size)
        self.matryoshka_dimensions = matryoshka_dimensions
        self._end_token = _end_of_text_token(tokenizer) if pooling == "last" else None
        self._yes_no: tuple[int, int] | None = None
        # exo's forward where the model has a lean step, else None: transformers' forward.
        self._lean: LeanFinalStates | None = lean_final_states(model, device, kv_dtype)
        if reranker:
            self._yes_no = (_single_token(tokenizer, "no"), _single_token(tokenizer, "yes"))

    @property
    def runs_exo_forward(self) -> bool:
        """True where inputs run through exo's own forward (the lean step), False where
        through transformers' forward over the loaded modules."""
        return self._lean is not None

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids with the tokenizer's own special tokens; "last" pooling ends each
        with `<|endoftext|>` (added only where the tokenizer did not)."""
        encoded = [list(self._tokenizer.encode(text)) for text in texts]
        if self._end_token is not None:
            encoded = [ids if ids and ids[-1] == self._end_token else [*ids, self._end_token]
                       for ids in encoded]  # fmt: skip
        return encoded

    def scratch_bytes(self, tokens: int) -> int:
        """See `EmbeddingBackend.scratch_bytes`: a chunked input's scratch KV cache
        (`LeanFinalStates.scratch_bytes`); 0 on transformers' forward, which runs an input
        whole and keeps nothing between pieces."""
        return 0 if self._lean is None else self._lean.scratch_bytes(tokens)

    def start_embedding(self, token_ids: Sequence[Sequence[int]]) -> DecoderWork:
        """The pooling's work over `token_ids` (`DecoderWork`).

        Raises:
            ValueError: an empty input.
        """
        return DecoderWork(self, token_ids, self.pooling)

    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[B, hidden]` float32 pooled final-norm states, not normalized.

        Raises:
            ValueError: an empty input.
        """
        return run_to_end(self.start_embedding(token_ids))

    def start_scoring(self, pairs: Sequence[tuple[str, str]]) -> DecoderWork | None:
        """The work of `score_pairs` (last-token states, then the yes/no softmax), or None
        when this model is no reranker."""
        if self._yes_no is None:
            return None
        prefix = self._tokenizer.encode(RERANK_PREFIX, add_special_tokens=False)
        suffix = self._tokenizer.encode(RERANK_SUFFIX, add_special_tokens=False)
        room = self.max_input_tokens - len(prefix) - len(suffix)
        rows: list[list[int]] = []
        for query, document in pairs:
            body = f"<Instruct>: {RERANK_INSTRUCTION}\n<Query>: {query}\n<Document>: {document}"
            ids = self._tokenizer.encode(body, add_special_tokens=False)[: max(room, 1)]
            rows.append([*prefix, *ids, *suffix])
        return DecoderWork(self, rows, "last", finish=self._yes_probability)

    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        """`[B]` float32 P("yes") of each (query, document) under Qwen3-Reranker's prompt;
        None when this model is no reranker. A document too long for the context is cut
        (its end dropped) so the prompt's suffix still fits."""
        work = self.start_scoring(pairs)
        return None if work is None else run_to_end(work)

    @torch.inference_mode()
    def _yes_probability(self, last: torch.Tensor) -> torch.Tensor:
        """`[b]` P("yes") from `[b, hidden]` float32 last-token final-norm states: the LM
        head's "no" and "yes" logits, softmaxed (`HEAD_ROWS` rows at a time: a
        `[rows, vocab]` logits matrix each)."""
        assert self._yes_no is not None
        no, yes = self._yes_no
        head: Any = self._model.lm_head
        weight = getattr(head, "weight", None)
        head_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
        scores = torch.empty(last.shape[0], dtype=torch.float32)
        for start in range(0, last.shape[0], HEAD_ROWS):
            rows = last[start : start + HEAD_ROWS].to(self._device)
            if head_dtype is not None and head_dtype.is_floating_point:
                rows = rows.to(head_dtype)
            logits = head(rows.unsqueeze(1))[:, 0].float()  # [rows, vocab]
            pair = torch.stack([logits[:, no], logits[:, yes]], dim=-1)
            scores[start : start + HEAD_ROWS] = torch.softmax(pair, dim=-1)[:, 1].cpu()
        return scores

    def _chunked(self, token_ids: Sequence[int], pooling: EmbeddingPooling) -> ChunkedInput | None:
        """One input to prefill in chunks, or None where inputs run whole (transformers'
        forward)."""
        return None if self._lean is None else self._lean.chunked(token_ids, pooling)

    @torch.inference_mode()
    def _pooled(
        self, token_ids: Sequence[Sequence[int]], pooling: EmbeddingPooling
    ) -> torch.Tensor:
        """`[b, hidden]` the pooling's vectors of one sub-batch (on the model's device)."""
        if pooling == "last":
            return self._last_states(token_ids).float()
        if self._lean is not None:
            residual, offsets = self._lean.residual(token_ids)
            states = self._lean.norm(residual)  # [T, hidden]
            lengths = offsets.diff()
            owner = torch.repeat_interleave(torch.arange(len(token_ids)), lengths)
            sums = states.new_zeros(len(token_ids), states.shape[1])
            sums.index_add_(0, owner.to(states.device), states)
            return sums / lengths.to(states.device, torch.float32).unsqueeze(-1)
        padded, lengths = self._final_states(token_ids)
        states = padded.float()
        valid = _valid_mask(lengths, states.shape[1]).unsqueeze(-1).to(states.device)
        return (states * valid).sum(dim=1) / lengths.to(states.device).unsqueeze(-1)

    def _last_states(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[b, hidden]` the final norm's state at each input's last token (on the model's
        device; float32 from the lean step, the model's dtype from transformers')."""
        if self._lean is not None:
            residual, offsets = self._lean.residual(token_ids)
            return self._lean.norm(residual[(offsets[1:] - 1).to(residual.device)])
        states, lengths = self._final_states(token_ids)
        rows = torch.arange(len(token_ids), device=states.device)
        return states[rows, (lengths - 1).to(states.device)]

    def _final_states(
        self, token_ids: Sequence[Sequence[int]]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Transformers' forward (where the model has no lean step): `([b, L, hidden],
        [b])`, the final norm's states of right-padded inputs (on the model's device, in
        its dtype) and their lengths (CPU)."""
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.long)
        width = int(lengths.max())
        input_ids = torch.zeros(len(token_ids), width, dtype=torch.long)
        for row, ids in enumerate(token_ids):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        # Rows of one length need no padding mask: plain causal attention, whose kernels
        # never hold a [length, length] score matrix (a long input runs alone).
        mask = None if bool((lengths == width).all()) else _valid_mask(lengths, width).long()
        output = self._model.model(
            input_ids=input_ids.to(self._device),
            attention_mask=None if mask is None else mask.to(self._device),
            use_cache=False,
        )
        return output.last_hidden_state, lengths


def _valid_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """`[b, width]` bool: True at each row's real positions."""
    return torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)


class DecoderWork:
    """`EmbeddingWork` over a decoder: the inputs longest first, in groups of whole inputs
    whose padded tokens stay within `BATCH_TOKENS` and the piece's budget, an input longer
    than the budget prefilled in chunks (`lean_states.ChunkedInput`) where the backend runs
    exo's forward.

    Args:
        backend: the model.
        token_ids: the inputs (each non-empty).
        pooling: "mean" or "last".
        finish: applied to the `[rows, hidden]` pooled states by `result` (a reranker's
            scores), None: they are the result.

    Raises:
        ValueError: an empty input.
    """

    def __init__(
        self,
        backend: DecoderEmbeddingBackend,
        token_ids: Sequence[Sequence[int]],
        pooling: EmbeddingPooling,
        finish: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        if any(len(ids) == 0 for ids in token_ids):
            raise ValueError("an input has no tokens")
        self._backend = backend
        self._inputs = [list(ids) for ids in token_ids]
        self._pooling: EmbeddingPooling = pooling
        self._finish = finish
        self.rows = len(self._inputs)
        self.tokens = sum(len(ids) for ids in self._inputs)
        self._out = torch.zeros(self.rows, backend.dimensions, dtype=torch.float32)
        # Rows not yet started, longest first (a stable sort: ties keep their order).
        self._waiting = deque(sorted(range(self.rows), key=lambda row: -len(self._inputs[row])))
        self._dropped: set[int] = set()
        self._chunked: tuple[int, ChunkedInput] | None = None  # the input being chunked

    @property
    def done(self) -> bool:
        return self._chunked is None and not self._waiting

    def run_piece(self, budget: int | None) -> int:
        """See `EmbeddingWork.run_piece`."""
        if self._chunked is not None:
            return self._advance_chunked(budget)
        while self._waiting and self._waiting[0] in self._dropped:
            self._waiting.popleft()
        if not self._waiting:
            return 0
        longest = len(self._inputs[self._waiting[0]])
        if budget is not None and longest > max(budget, 1):
            row = self._waiting[0]
            chunked = self._backend._chunked(self._inputs[row], self._pooling)
            if chunked is not None:
                self._waiting.popleft()
                self._chunked = (row, chunked)
                return self._advance_chunked(budget)
        limit = BATCH_TOKENS if budget is None else max(min(budget, BATCH_TOKENS), 1)
        group = [self._waiting.popleft()]
        while self._waiting and longest * (len(group) + 1) <= limit:
            row = self._waiting.popleft()
            if row not in self._dropped:
                group.append(row)
        states = self._backend._pooled([self._inputs[row] for row in group], self._pooling)
        self._out[torch.tensor(group)] = states.float().cpu()
        return sum(len(self._inputs[row]) for row in group)

    def _advance_chunked(self, budget: int | None) -> int:
        assert self._chunked is not None
        row, chunked = self._chunked
        computed = chunked.advance(chunked.length if budget is None else budget)
        if chunked.done:
            self._out[row] = chunked.pooled().float().cpu()
            self._chunked = None
        return computed

    def drop(self, rows: Iterable[int]) -> None:
        """See `EmbeddingWork.drop`."""
        self._dropped.update(rows)
        if self._chunked is not None and self._chunked[0] in self._dropped:
            self._chunked = None  # its scratch cache goes with it
        self._waiting = deque(row for row in self._waiting if row not in self._dropped)

    def result(self) -> torch.Tensor:
        """See `EmbeddingWork.result`."""
        if not self.done:
            raise RuntimeError("the embedding work is not done")
        return self._out if self._finish is None else self._finish(self._out)


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"a reranker's tokenizer must hold {text!r} as one token")
    return int(ids[0])


def _end_of_text_token(tokenizer: Any) -> int | None:
    """`<|endoftext|>`'s id (Qwen's), else the tokenizer's EOS token, else None."""
    if "<|endoftext|>" in tokenizer.get_vocab():
        return int(tokenizer.convert_tokens_to_ids("<|endoftext|>"))
    eos = getattr(tokenizer, "eos_token_id", None)
    return eos if isinstance(eos, int) else None
