"""A scheduler's speculative decoding (a single rank's, or a split instance's rank 0's):
which decoding requests draft in a step and how many tokens, and what their verification
did (`scheduler.py` lays the rows out and verifies them; `decoding/speculative_drafts.py`
proposes, `speculative_policy.py` decides).

A step's drafts stay within `max_decode_rows` decode rows in all: up to that many rows a
block weight's product runs its decode kernel (`quantized_linear.NATIVE_BLOCK_MAX_ROWS`,
native/decode_layer.cpp's `kGemmMinRows` - 1); with more it is the integer GEMM, whose sums
round in another order, so a draft row would no longer be computed as the plain decode row
it stands for. The rows beyond one per decoding request are shared out evenly among the
requests that draft.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from loguru import logger

from exo.worker.engines.torch.batching.request_state import RequestState
from exo.worker.engines.torch.decoding.speculative_drafts import (
    NO_DRAFT,
    Draft,
    DraftRequest,
    DraftSource,
)
from exo.worker.engines.torch.decoding.speculative_policy import (
    AutoSwitch,
    DraftLength,
    SpeculationCounters,
    SpeculationSettings,
    best_draft_length,
)
from exo.worker.engines.torch.quant.quantized_linear import NATIVE_BLOCK_MAX_ROWS


class Speculation:
    """Drafts and their bookkeeping for one scheduler (a single rank's or a split
    instance's rank 0's).

    Args:
        settings: the node's settings (each request's mode, the draft length's bounds).
        source: where drafts come from.

    Attributes:
        max_decode_rows: the most decode rows of a step with drafts (see the module).
        auto_switch: the instance's switch for "auto" requests.
        counters: what speculation did, for `/metrics` and `/state`.
        step_cost: a decode-only step's time in seconds by its rows, None where unknown
            (the switch's measurements; a test fixes it so drafts do not follow the clock).
    """

    def __init__(self, settings: SpeculationSettings, source: DraftSource) -> None:
        self.settings = settings
        self.source = source
        self.max_decode_rows = NATIVE_BLOCK_MAX_ROWS
        self.auto_switch = AutoSwitch()
        self.counters = SpeculationCounters()
        self.step_cost: Callable[[int], float | None] = self.auto_switch.step_seconds
        self._lengths: dict[str, DraftLength] = {}
        # Seconds spent proposing since the last `take_draft_seconds` (a draft model's
        # forward passes: part of a speculating step's cost, for the switch and lengths).
        self._draft_seconds = 0.0

    def auto_allowed(self, states: Sequence[RequestState], requests: int) -> bool:
        """Whether requests in "auto" mode draft this step of `requests` decoding requests
        (`AutoSwitch.allows`, asked only where one of `states` is in "auto" mode, so probes
        count its steps)."""
        modes = (self.settings.mode_of(state.speculative) for state in states)
        return any(mode == "auto" for mode in modes) and self.auto_switch.allows(requests)

    def drafts(
        self, decoding: Sequence[tuple[RequestState, Sequence[int]]], auto_allowed: bool
    ) -> list[Draft]:
        """One draft per decoding request of a step without prompt rows, in order (`NO_DRAFT`
        where it does not draft): each at most its adaptive length and its remaining token
        budget less one, within `max_decode_rows`; drafts shorter than `draft_min` are
        dropped. An "auto" request's is also at most the length whose expected tokens per
        second of measured step time are the most (`best_draft_length`, from its
        acceptance so far), except in the switch's probes (which measure every length's
        steps again); a request that asked for speculation (True) drafts at its adaptive
        length whatever the costs. A source that raises gives no drafts this step and
        forgets these requests (a draft model starts them afresh): decoding goes on.

        Args:
            decoding: each decoding request's state and its prompt and generated tokens.
            auto_allowed: `auto_allowed`'s answer for this step.
        """
        settings = self.settings
        room = self.max_decode_rows - len(decoding)
        wanted: list[tuple[int, int]] = []  # (index in `decoding`, most tokens)
        for index, (state, _tokens) in enumerate(decoding):
            mode = settings.mode_of(state.speculative)
            if mode is False or (mode == "auto" and not auto_allowed):
                continue
            length = self._lengths.get(state.request_id)
            if length is None:
                length = self._lengths[state.request_id] = DraftLength(
                    settings.draft_min, settings.draft_max
                )
            limit = min(length.current, state.max_new_tokens - state.completion_tokens - 1)
            acceptance = length.acceptance
            if mode == "auto" and acceptance is not None and not self.auto_switch.probing:
                # The length that pays for its rows here.
                limit = best_draft_length(acceptance, limit, len(decoding), self.step_cost)
            if limit >= settings.draft_min:
                wanted.append((index, limit))
        requests: list[tuple[int, DraftRequest]] = []
        for order, (index, limit) in enumerate(wanted):
            share = min(limit, -(-room // (len(wanted) - order)) if room > 0 else 0)
            if share < settings.draft_min:
                continue
            room -= share
            state, tokens = decoding[index]
            sampler = state.chooser.sampler
            requests.append(
                (index, DraftRequest(state.request_id, tokens, share, sampler.params, sampler.seed))
            )
        drafts: list[Draft] = [NO_DRAFT] * len(decoding)
        if not requests:
            return drafts
        started = time.perf_counter()
        try:
            proposed = self.source.propose([request for _, request in requests])
        except Exception as error:  # a draft model's failure: this step decodes plainly
            logger.opt(exception=error).warning(
                "draft source {} failed; the step decodes without drafts", self.source.name
            )
            for _, request in requests:  # its state for them may be half-updated
                self.source.forget(request.request_id)
            return drafts
        finally:
            self._draft_seconds += time.perf_counter() - started
        for (index, request), draft in zip(requests, proposed, strict=True):
            drafted_length = min(len(draft.tokens), request.max_tokens)
            if drafted_length >= settings.draft_min:
                probabilities = draft.probabilities
                drafts[index] = Draft(
                    draft.tokens[:drafted_length],
                    None if probabilities is None else probabilities[:drafted_length],
                )
        return drafts

    def take_draft_seconds(self) -> float:
        """The seconds spent proposing since the last call (the step's drafting time, a
        draft model's catch-up included, passed beside its forward pass's to
        `step_measured`)."""
        seconds, self._draft_seconds = self._draft_seconds, 0.0
        return seconds

    def verified(self, request_id: str, drafted: int, accepted: int) -> None:
        """A request verified a draft of `drafted` tokens, `accepted` of them taken."""
        length = self._lengths.get(request_id)
        if length is not None:
            length.update(drafted, accepted)
        self.counters.verify_rounds += 1
        self.counters.drafted_tokens += drafted
        self.counters.accepted_tokens += accepted

    def decoded(self, emitted: int) -> None:
        """A decoding request emitted `emitted` tokens in a step (with or without a draft)."""
        self.counters.decode_rounds += 1
        self.counters.decode_tokens += emitted

    def step_measured(
        self, requests: int, rows: int, emitted: int, seconds: float, draft_seconds: float
    ) -> None:
        """A decode-only step: its forward pass's `seconds` and its proposal's
        `draft_seconds` (`AutoSwitch.observe`)."""
        self.auto_switch.observe(requests, rows, emitted, seconds, draft_seconds)

    def forget(self, request_id: str) -> None:
        """The request left the batch."""
        self._lengths.pop(request_id, None)
        self.source.forget(request_id)


@dataclass(frozen=True, slots=True)
class RemoteRow:
    """A logit row of a launched step whose token another rank may choose (a pipeline's
    last rank, `parallel/last_rank_sampling.py`; `scheduler.BatchLaunch`).

    Attributes:
        state: the row's request.
        ahead: how many of the request's draws come before this row's (a draft's row i:
            i, `Sampler.key`; 0 for a plain row).
        draft_token: the draft token the row's choice is checked against; -1: none (a
            plain row, or a draft's last row, whose token is the bonus or the correction).
    """

    state: RequestState
    ahead: int = 0
    draft_token: int = -1


def remote_rows(state: RequestState, drafted: Draft) -> list[RemoteRow | None]:
    """A launched step's rows of one request (its fed token's and its draft's, in position
    order): each a `RemoteRow`, or None for a row whose whole logits rank 0 wants.

    Another rank may choose a draft's rows where the request's chooser needs no logits
    (no penalties, bias or constraint) and the draft is deterministic for the
    verification (any draft of a greedy request; a draft without a draft distribution,
    n-gram, for a sampling one). That rank picks each row's token as rank 0 would, the
    argmax or the draw with the row's key from the request's generator
    (`RemoteRow.ahead`), and the verification keeps the rows up to the first mismatch and
    uses up their numbers only (`last_rank_sampling.py`). A sampling request's
    draft-model draft comes back whole: its general acceptance rule needs the whole target
    distribution at each row. A row without a draft is always a `RemoteRow` (the other
    rank decides whether its chooser lets it choose: `RowSampling.of`).
    """
    draft = drafted.tokens
    chooser = state.chooser
    deterministic = chooser.sampler.params.is_greedy or drafted.probabilities is None
    if draft and (chooser.needs_logits or not deterministic):
        return [None] * (len(draft) + 1)
    return [
        RemoteRow(state, row, draft[row] if row < len(draft) else -1)
        for row in range(len(draft) + 1)
    ]
