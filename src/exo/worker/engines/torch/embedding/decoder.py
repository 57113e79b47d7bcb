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
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from exo.shared.types.models import EmbeddingPooling
from exo.worker.engines.torch.embedding.lean_states import LeanFinalStates, lean_final_states

# Padded tokens in one forward pass of an embedding batch: bounds its activations
# (a [BATCH_TOKENS, hidden] float32 state per layer; the lean step's scratch keys and
# values) while keeping short texts batched.
BATCH_TOKENS = 8192

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
        self._lean: LeanFinalStates | None = lean_final_states(model, device)
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

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[B, hidden]` float32 pooled final-norm states, not normalized.

        Raises:
            ValueError: an empty input.
        """
        if any(len(ids) == 0 for ids in token_ids):
            raise ValueError("an input has no tokens")
        out = torch.empty(len(token_ids), self.dimensions, dtype=torch.float32)
        for rows in _sub_batches(token_ids):
            out[torch.tensor(rows)] = self._pooled([token_ids[row] for row in rows]).cpu()
        return out

    @torch.inference_mode()
    def score_pairs(self, pairs: Sequence[tuple[str, str]]) -> torch.Tensor | None:
        """`[B]` float32 P("yes") of each (query, document) under Qwen3-Reranker's prompt;
        None when this model is no reranker. A document too long for the context is cut
        (its end dropped) so the prompt's suffix still fits."""
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
        scores = torch.empty(len(rows), dtype=torch.float32)
        no, yes = self._yes_no
        head: Any = self._model.lm_head
        weight = getattr(head, "weight", None)
        head_dtype = weight.dtype if isinstance(weight, torch.Tensor) else None
        for batch in _sub_batches(rows):
            last = self._last_states([rows[row] for row in batch])  # [b, hidden]
            if head_dtype is not None and head_dtype.is_floating_point:
                last = last.to(head_dtype)
            logits = head(last.unsqueeze(1))[:, 0].float()  # [b, vocab]
            pair = torch.stack([logits[:, no], logits[:, yes]], dim=-1)
            scores[torch.tensor(batch)] = torch.softmax(pair, dim=-1)[:, 1].cpu()
        return scores

    def _pooled(self, token_ids: Sequence[Sequence[int]]) -> torch.Tensor:
        """`[b, hidden]` the pooling's vectors of one sub-batch (on the model's device)."""
        if self.pooling == "last":
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


def _sub_batches(token_ids: Sequence[Sequence[int]]) -> list[list[int]]:
    """Row indices grouped longest first, each group's padded size within `BATCH_TOKENS`
    (a longer single input runs alone)."""
    order = sorted(range(len(token_ids)), key=lambda row: -len(token_ids[row]))
    groups: list[list[int]] = []
    for row in order:
        if groups and len(token_ids[groups[-1][0]]) * (len(groups[-1]) + 1) <= BATCH_TOKENS:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


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
