"""A pipeline's last rank chooses tokens itself instead of shipping whole logits rows.

Each logit row of a pipeline step carries a `RowSampling` in the step header (rank 0 fills
it from the row's request): what the last rank sends back to rank 0 for that row.

- A lean row (a request whose `TokenChooser` has no penalties, logit bias or constraint:
  `needs_logits` False) travels with its sampling settings (temperature, top-k, top-p,
  min-p) and, when it samples, the key rank 0 drew from the request's seeded generator
  (`Sampler.key`). The last rank picks the token with the same function rank
  0 would (`sampling.sample_unconstrained`), so sharded == single holds for greedy and
  seeded requests, and sends back the token id, plus its logprob and `top_logprobs`
  alternatives (`step_logprobs`) only when the request asked for logprobs: 1, or
  3 + 2 x top_logprobs, float32 values instead of `vocab`.
- A full row (penalties, logit bias, a JSON / JSON-schema / tool-call constraint, or the
  test seam's scripted reply) still gets its whole `[vocab]` float32 logits: their state
  (token counts, the grammar's position, the constraint's vocabulary) lives with the
  request on rank 0, which applies them as on a single node. Moving them to the last rank
  would mean mirroring that state there (penalty counts and grammar state advanced with
  every token); not done.

Speculative decoding: the k + 1 rows of a lean request's deterministic draft (n-gram, or
any draft of a greedy request; `speculation.remote_rows`) are lean rows too. Row i
carries the draft token it is checked against (`draft_token`; -1 on the last row, whose
token is the bonus) and the key of the request's i-th next draw
(`Sampler.key(i)`). A draft token t is a point mass (q(t) = 1), so the rejection rule of
Leviathan et al. 2023 / Chen et al. 2023 reduces to: accept t with probability p(t), else
draw from p with t removed and renormalised, and after k acceptances draw the bonus from p.
Drawing x ~ p with the row's key and accepting iff x == t does exactly that
(`RequestState.accept_drafts`), and it is what the last rank does: it picks each row's
token in position order (a micro-batch keeps the step's logit order:
`rank_steps.split_micro_batches`) and, at the first row whose token differs from its draft
token (the
rejection: that token is the correction), skips the rest of the draft's rows (their
answers are `REJECTED_ROW` and zeros, neither sampled nor given logprobs). Rank 0 feeds the
tokens to `accept_drafts`, which stops at that same row and uses up one key per row it
took (`Sampler.forwarded`); the keys of the skipped rows stay for the next draws. So a
seeded request draws the very keys, in the same order, that one process decoding
plainly or speculatively would, and picks the same tokens from the same logits. What comes
back per draft row: 4 bytes (the token) without logprobs, 4 x (3 + 2 x top_logprobs) with
them, where whole logits were 4 x vocab bytes (~600 KB at a 151,936-token vocabulary). A
draft model's drafts of a sampling request still come back whole: their tokens were drawn
from a whole distribution q, and the general rule needs q and p at each row.

The generator stays on rank 0 (one place for a request's state, which pre-emption and
cancellation already handle); a key drawn for a step whose row is then skipped (the
request pre-empted meanwhile) is kept for the next draw, so the sequence of draws is the
single node's.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch

from exo.worker.engines.torch.batching.request_state import RequestState
from exo.worker.engines.torch.decoding.sampling import (
    SampledToken,
    StepLogprobs,
    sample_unconstrained,
    step_logprobs,
)
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams

# Token ids travel as float32 values in the answer: exact below 2**24.
LARGEST_EXACT_ID = 1 << 24
# The token of a draft's row the last rank skipped after a rejection (never a token id).
REJECTED_ROW = -1


def _float_bits(value: float) -> int:
    """The float64 `value`'s bits as an int64 (the step header is int64)."""
    (bits,) = struct.unpack("<q", struct.pack("<d", value))
    return int(bits)


def _bits_float(bits: int) -> float:
    (value,) = struct.unpack("<d", struct.pack("<q", bits))
    return float(value)


@dataclass(frozen=True, slots=True)
class RowSampling:
    """What the last rank answers for one logit row (see the module docstring).

    Attributes:
        lean: False: the row's `[vocab]` logits; True: the token the settings below pick.
        top_logprobs: -1: no logprobs; else the token's logprob and this many alternatives
            (sent as: token, logprob, count, count ids, count logprobs).
        temperature / top_k / top_p / min_p: the request's `SamplingParams` filters.
        key: the draw's key (`Sampler.key`; 0 when greedy).
        draft_token: a speculative draft's row: the draft token its chosen token is checked
            against (the rows after a mismatch are skipped); -1: none (a plain row, or a
            draft's last row, which ends the draft's rows).
    """

    lean: bool
    top_logprobs: int = -1
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    key: int = 0
    draft_token: int = -1

    WIDTH: ClassVar[int] = 8  # int64 values per row in the header

    @classmethod
    def of(cls, state: RequestState, ahead: int = 0, draft_token: int = -1) -> RowSampling:
        """Rank 0: a row of `state`'s (draws its key when lean and not greedy).

        Args:
            ahead: how many of the request's draws come before this row's (a draft's row
                i: i; `Sampler.key`).
            draft_token: the draft token the row's choice is checked against, -1 for none.
        """
        chooser = state.chooser
        if chooser.needs_logits:
            return FULL_ROW
        params = chooser.sampler.params
        key = 0 if params.is_greedy else chooser.sampler.key(ahead)
        top = -1 if state.top_logprobs is None else state.top_logprobs
        return cls(
            True, top, params.temperature, params.top_k, params.top_p, params.min_p, key,
            draft_token,
        )  # fmt: skip

    def encode(self) -> list[int]:
        return [
            int(self.lean), self.top_logprobs, self.top_k, _float_bits(self.temperature),
            _float_bits(self.top_p), _float_bits(self.min_p), self.key, self.draft_token,
        ]  # fmt: skip

    @classmethod
    def decode(cls, values: Sequence[int]) -> RowSampling:
        lean, top, top_k, temperature, top_p, min_p, key, draft_token = values
        return cls(
            bool(lean), top, _bits_float(temperature), top_k, _bits_float(top_p),
            _bits_float(min_p), int(key), draft_token,
        )  # fmt: skip

    def answer_size(self, vocab_size: int) -> int:
        """float32 values the last rank sends for this row."""
        if not self.lean:
            return vocab_size
        return 1 if self.top_logprobs < 0 else 3 + 2 * min(self.top_logprobs, vocab_size)


FULL_ROW = RowSampling(False)


def answer_rows(logits: torch.Tensor, samplings: Sequence[RowSampling]) -> torch.Tensor:
    """The last rank: its answer for a (micro-)batch's logit rows, one float32 vector of
    every row's values in order (`RowSampling.answer_size`). A speculative draft's rows
    after its first rejected draft token, up to and with the draft's last row, are not
    chosen: each answers `REJECTED_ROW` followed by zeros (see the module docstring).

    Args:
        logits: `[R, vocab]` the rows' logits (float32 or the model's dtype).
        samplings: one per row.

    Raises:
        ValueError: a vocabulary too large for token ids in float32.
    """
    vocab_size = int(logits.shape[-1])
    if vocab_size > LARGEST_EXACT_ID:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit float32 token ids")
    parts: list[torch.Tensor] = []
    rejected = False  # a draft token of the current draft's rows was rejected
    for row, sampling in enumerate(samplings):
        if not sampling.lean:
            parts.append(logits[row].float().cpu())
            rejected = False
            continue
        if rejected:
            skipped = torch.zeros(sampling.answer_size(vocab_size), dtype=torch.float32)
            skipped[0] = REJECTED_ROW
            parts.append(skipped)
            rejected = sampling.draft_token >= 0  # the draft's last row ends the skip
            continue
        scores = logits[row].float()
        params = SamplingParams(
            temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=sampling.min_p,
        )  # fmt: skip
        token = sample_unconstrained(scores, params, sampling.key)
        rejected = sampling.draft_token >= 0 and token != sampling.draft_token
        values = [float(token)]
        if sampling.top_logprobs >= 0:
            step = step_logprobs(scores, token, sampling.top_logprobs)
            values += [step.logprob, float(len(step.top_ids))]
            values += [float(token_id) for token_id in step.top_ids] + list(step.top_logprobs)
        parts.append(torch.tensor(values, dtype=torch.float32))
    if not parts:
        return torch.empty(0, dtype=torch.float32)
    return torch.cat(parts)


def read_answer(
    answer: torch.Tensor, samplings: Sequence[RowSampling], vocab_size: int
) -> list[torch.Tensor | SampledToken]:
    """Rank 0: `answer_rows`'s vector back into one entry per row: a full row's `[vocab]`
    logits, a lean row's `SampledToken` (`SampledToken(REJECTED_ROW)` for a draft's row
    after its rejection, which the last rank did not choose and verification never reads)."""
    rows: list[torch.Tensor | SampledToken] = []
    cursor = 0
    for sampling in samplings:
        size = sampling.answer_size(vocab_size)
        values = answer[cursor : cursor + size]
        cursor += size
        if not sampling.lean:
            rows.append(values)
            continue
        token = int(values[0].item())
        logprobs = None
        if sampling.top_logprobs >= 0 and token != REJECTED_ROW:
            listed = values.tolist()
            count = int(listed[2])
            ids = tuple(int(value) for value in listed[3 : 3 + count])
            top = tuple(listed[3 + count : 3 + 2 * count])
            logprobs = StepLogprobs(token, listed[1], ids, top)
        rows.append(SampledToken(token, logprobs))
    return rows


@dataclass(slots=True)
class PipelineTraffic:
    """Rank 0's count of what came back from the last rank: logit rows answered whole and
    lean, float32 values received, and of them the lean rows checked against a draft
    token (`RowSampling.draft_token`; a draft's last row counts as a plain lean row) and
    their values."""

    full_rows: int = 0
    lean_rows: int = 0
    values: int = 0
    lean_draft_rows: int = 0
    lean_draft_values: int = 0

    def count(self, samplings: Sequence[RowSampling], vocab_size: int) -> None:
        for sampling in samplings:
            size = sampling.answer_size(vocab_size)
            if sampling.lean:
                self.lean_rows += 1
                if sampling.draft_token >= 0:
                    self.lean_draft_rows += 1
                    self.lean_draft_values += size
            else:
                self.full_rows += 1
            self.values += size
