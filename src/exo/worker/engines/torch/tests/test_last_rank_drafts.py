"""A pipeline's last rank verifies a sampling request's n-gram drafts (issue 43): the rows
of a deterministic draft travel lean (`last_rank_sampling.py`), each with the request's
next keys in order; the last rank picks each row's token, skips the draft's rows
after its first rejection, and rank 0's verification takes the same tokens and uses up the
same numbers as one process verifying the whole logits. No process group: the last rank's
side runs here on the rows' logits, through the step header's encoding.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import pytest
import torch

from exo.shared.types.chunks import TokenLogprob
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.batching.speculation import RemoteRow, remote_rows
from exo.worker.engines.torch.decoding.logit_adjustments import LogitBias
from exo.worker.engines.torch.decoding.sampling import SampledToken, StepLogprobs, step_logprobs
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.speculative_drafts import Draft
from exo.worker.engines.torch.parallel.last_rank_sampling import (
    REJECTED_ROW,
    PipelineTraffic,
    RowSampling,
    answer_rows,
    read_answer,
)
from exo.worker.engines.torch.parallel.rank_steps import (
    STEP,
    StepHeader,
    micro_batch_count,
    split_micro_batches,
)
from exo.worker.engines.torch.tests.speculative_builders import (
    BigramModel,
    bare_state,
    chi_square_p_value,
)


def _state(params: SamplingParams, max_tokens: int = 2) -> RequestState:
    """`speculative_builders.bare_state`, its logprobs taken from raw logits or from the
    logprobs another rank computed."""

    def logprob_of(logits: torch.Tensor | StepLogprobs, token: int, top: int) -> TokenLogprob:
        step = logits if isinstance(logits, StepLogprobs) else step_logprobs(logits, token, top)
        return TokenLogprob(token=f"<{token}>", token_id=token, logprob=step.logprob)

    state = bare_state(params, max_tokens)
    state.logprob_of = logprob_of
    return state


def _logprobs(pieces: Sequence[GeneratedPiece]) -> list[float]:
    return [entry.logprob for piece in pieces for entry in piece.logprobs]


def _draft_samplings(state: RequestState, draft: Sequence[int]) -> tuple[RowSampling, ...]:
    """Rank 0: the rows of `draft` as the pipeline's launch fills them (row i: the i-th
    next key, checked against draft token i; the last row ends the draft)."""
    return tuple(
        RowSampling.of(state, row, draft[row] if row < len(draft) else -1)
        for row in range(len(draft) + 1)
    )


def _through_the_last_rank(
    state: RequestState, rows: torch.Tensor, draft: Sequence[int], traffic: PipelineTraffic
) -> tuple[list[GeneratedPiece], int]:
    """One verify step of `state` as a pipeline runs it: samplings in the header (encoded,
    decoded), the last rank's answer on `rows` `[k + 1, vocab]`, rank 0's verification.
    Returns `accept_drafts`'s pieces and drafts accepted."""
    samplings = _draft_samplings(state, draft)
    header = StepHeader(STEP, logit_rows=tuple(range(len(samplings))), samplings=samplings)
    received = StepHeader.decode(header.encode()).row_samplings
    assert received == samplings
    vocab_size = int(rows.shape[-1])
    traffic.count(samplings, vocab_size)
    answer = answer_rows(rows, received)
    assert answer.numel() == sum(sampling.answer_size(vocab_size) for sampling in samplings)
    entries = read_answer(answer, samplings, vocab_size)
    before = len(state.generated_ids)
    pieces, accepted = state.accept_drafts(entries, draft)
    added = state.generated_ids[before:]
    # The rows after the rejection were skipped, the ones before it chosen.
    tokens = [entry.token_id for entry in entries if isinstance(entry, SampledToken)]
    taken = accepted + 1
    assert tokens[:taken] == added[:taken] or state.finished
    assert all(token == REJECTED_ROW for token in tokens[taken:])
    return pieces, accepted


# Seeds per setting: enough that each setting's drafts see every accepted count asserted
# below; a whole 4-token draft is accepted for 2.5 % (temperature 1.3, top-p 0.8) to 17.5 %
# (top-k 3) of the seeds (counted over 200), which 80 seeds cover 2-14 times.
SEEDS = 80
SETTINGS = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.8, top_k=3),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.02),
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_last_ranks_verification_gives_one_processs_tokens_seed_by_seed(
    settings: SamplingParams,
) -> None:
    """Per seed and draft (accepted whole, cut at the first token, cut later), generating
    to the budget through the last rank gives the tokens one process gives verifying the
    same drafts on whole logits, which are plain decoding's; and the generator stands at
    the same place afterwards (the same next number)."""
    model = BigramModel(8, seed=3)
    likeliest = model.table.argmax(dim=-1).tolist()

    def chain(fed: int, length: int) -> list[int]:  # the likeliest tokens: often accepted
        tokens = [likeliest[fed]]
        while len(tokens) < length:
            tokens.append(likeliest[tokens[-1]])
        return tokens

    accepted_counts: set[int] = set()
    kinds: tuple[str | list[int], ...] = ("likeliest", [5, 5, 5, 5], [0], [7, 1])
    for seed, kind in itertools.product(range(SEEDS), kinds):
        params = dataclasses.replace(settings, seed=seed)
        single = _state(params, max_tokens=7)
        split = _state(params, max_tokens=7)
        traffic = PipelineTraffic()
        while not single.finished:
            fed = single.generated_ids[-1] if single.generated_ids else 0
            draft = chain(fed, 4) if isinstance(kind, str) else kind
            # The budget caps a draft at the tokens left less one (`Speculation.drafts`).
            cut = list(draft[: single.max_new_tokens - single.completion_tokens - 1])
            pieces, accepted = single.accept_drafts(model.rows(fed, cut), cut)
            split_pieces, accepted_split = _through_the_last_rank(
                split, model.rows(fed, cut), cut, traffic
            )
            assert accepted_split == accepted
            assert split.generated_ids == single.generated_ids, (seed, kind)
            assert _logprobs(split_pieces) == _logprobs(pieces)
            accepted_counts.add(accepted)
        plain = _state(params, max_tokens=7)
        last = 0
        while not plain.finished:
            plain.accept(model.table[last])
            last = plain.generated_ids[-1]
        assert split.generated_ids == plain.generated_ids
        assert split.finished
        assert split.chooser.sampler.key() == single.chooser.sampler.key()
        assert traffic.full_rows == 0
    assert {0, 1, 2, 4} <= accepted_counts  # rejections at the first and later rows, none


def test_a_draft_row_without_logprobs_sends_back_one_value_with_them_few() -> None:
    """4 bytes per draft row without logprobs, 4 x (3 + 2 x top) with them, where a whole
    row is 4 x vocab; the rows after a rejection are neither sampled nor given logprobs."""
    vocab_size = 151_936  # Qwen3's: whole rows of ~600 KB
    logits = torch.randn(4, vocab_size, generator=torch.Generator().manual_seed(0))
    draft = [int(logits[0].argmin()), 11, 12]  # the least likely token: rejected at row 0
    for top, per_row in ((None, 1), (2, 3 + 2 * 2)):
        state = _state(SamplingParams(temperature=0.7, top_p=0.9, seed=1), max_tokens=9)
        state.top_logprobs = top
        samplings = _draft_samplings(state, draft)
        traffic = PipelineTraffic()
        traffic.count(samplings, vocab_size)
        assert traffic.lean_draft_rows == len(draft) and traffic.full_rows == 0
        assert 4 * traffic.lean_draft_values == 4 * per_row * len(draft) < 1024
        answer = answer_rows(logits, samplings)
        assert answer.numel() == per_row * (len(draft) + 1)
        entries = read_answer(answer, samplings, vocab_size)
        assert all(isinstance(entry, SampledToken) for entry in entries)
        first, *skipped = entries
        assert isinstance(first, SampledToken) and first.token_id != draft[0]
        assert (first.logprobs is None) == (top is None)
        for entry in skipped:
            assert isinstance(entry, SampledToken)
            assert entry == SampledToken(REJECTED_ROW)
        _pieces, accepted = state.accept_drafts(entries, draft)
        assert accepted == 0 and state.generated_ids == [first.token_id]


def test_tokens_verified_by_the_last_rank_follow_the_target_distribution_chi_square() -> None:
    """`test_speculative_acceptance.py`'s chi-square, through the last rank: two tokens
    after token 0 with the likeliest tokens as drafts, over 6,000 seeds, follow
    p(x1) p(x2 | x1), and the first draft token is accepted with probability p(draft)."""
    vocab, samples = 6, 6_000
    model = BigramModel(vocab, seed=5)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    target = torch.softmax(model.table / 0.8, dim=-1).double()  # [last, next]
    likeliest = [int(target[row].argmax()) for row in range(vocab)]
    draft = [likeliest[0], likeliest[likeliest[0]]][:1]  # the budget (2) allows one draft token
    counts = [0] * (vocab * vocab)
    accepted_first = 0
    traffic = PipelineTraffic()
    for seed in range(samples):
        state = _state(dataclasses.replace(params, seed=seed))
        _pieces, accepted = _through_the_last_rank(state, model.rows(0, draft), draft, traffic)
        accepted_first += int(accepted >= 1)
        while not state.finished:  # a rejection: the last token alone (budget 1 left)
            fed = state.generated_ids[-1]
            _through_the_last_rank(state, model.rows(fed, []), [], traffic)
        first, second = state.generated_ids
        counts[first * vocab + second] += 1
    expected = [
        samples * float(target[0, a] * target[a, b]) for a in range(vocab) for b in range(vocab)
    ]
    assert chi_square_p_value(counts, expected) > 1e-3
    share = accepted_first / samples
    p_draft = float(target[0, draft[0]])
    assert abs(share - p_draft) < 4 * (p_draft * (1 - p_draft) / samples) ** 0.5
    assert traffic.full_rows == 0


def test_the_last_rank_chooses_deterministic_drafts_of_lean_requests_only() -> None:
    """Which draft rows a pipeline's last rank chooses (`remote_rows`): any
    draft of a greedy request and a deterministic (n-gram) draft of a sampling one; not a
    draft model's drawn draft of a sampling request (the general rule needs q and p), nor
    a request whose penalties, bias or constraint rank 0 applies."""
    greedy = _state(SamplingParams(temperature=0.0))
    sampling = _state(SamplingParams(temperature=0.9, seed=1))
    penalised = _state(SamplingParams(temperature=0.9, seed=1))
    penalised.chooser.bias = LogitBias({3: 1.0}, 8, torch.device("cpu"))
    ngram = Draft((1, 2))
    drawn = Draft((1, 2), torch.full((2, 8), 1 / 8))
    chosen = [RemoteRow(greedy, 0, 1), RemoteRow(greedy, 1, 2), RemoteRow(greedy, 2, -1)]
    assert remote_rows(greedy, ngram) == chosen
    assert remote_rows(greedy, drawn) == chosen
    assert remote_rows(sampling, ngram) == [
        RemoteRow(sampling, 0, 1), RemoteRow(sampling, 1, 2), RemoteRow(sampling, 2, -1),
    ]  # fmt: skip
    assert remote_rows(sampling, drawn) == [None] * 3
    assert remote_rows(penalised, ngram) == [None] * 3
    assert remote_rows(penalised, Draft(())) == [RemoteRow(penalised)]  # `RowSampling.of` decides


def test_a_drafts_rows_reach_the_last_rank_in_position_order() -> None:
    """The scheduler lays a draft's rows out last position first and asks for their logits
    in position order; the (single) micro-batch the last rank gets keeps that logit order,
    which its skip after a rejection relies on."""
    state = _state(SamplingParams(temperature=0.9, seed=3))
    samplings = _draft_samplings(state, [4, 5])
    plain = RowSampling.of(_state(SamplingParams(temperature=0.0)))
    step = StepHeader(
        STEP, decode_slots=(1, 0, 0, 0), decode_positions=(7, 12, 11, 10),
        input_ids=(9, 5, 4, 3), position_ids=(7, 12, 11, 10), logit_rows=(0, 3, 2, 1),
        samplings=(plain, *samplings),
    )  # fmt: skip
    (micro_batch,) = split_micro_batches(step, micro_batch_count(step, 2))
    assert micro_batch.header.logit_rows == step.logit_rows
    assert micro_batch.header.samplings == step.samplings
    assert micro_batch.logit_order == (0, 1, 2, 3)
