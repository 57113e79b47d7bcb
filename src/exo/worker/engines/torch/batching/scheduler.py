"""Continuous batching on one rank: which requests run in each step, and the step itself
(its rows laid out by `step_layout.py`).

Every `step()` runs ONE forward pass (`batch_attention.forward_batch`) over one new token of
each decoding request plus a chunk of prompt tokens of the requests still prefilling, so a
long new prompt never stalls the running streams (chunked prefill, as in Agrawal et al. 2024,
"Sarathi-Serve"). The chunk is sized from measured step times (`chunk_sizer`: the most prompt
tokens that keep a step within a multiple of a decode-only step; `PREFILL_TOKENS_PER_STEP`
until steps have been measured, and always where steps are launched rather than run, whose
times are not measured); with no request streaming tokens yet
(nothing decoding, or only requests awaiting their first token from a step in flight),
prompts are prefilled `PREFILL_TOKENS_PER_IDLE_STEP` tokens at a time. Requests join at any
step and leave when they finish or are cancelled (iteration-level scheduling, Yu et al. 2022,
"Orca").

Memory: the KV of running requests and of the prefix cache share one budget in tokens
(`budget_tokens`, from the KV-cache memory budget), each sequence counted by the positions
its layers hold (`kv_footprint.KVFootprint`: a sliding-window layer holds about its window,
so on such a model a token costs less than one budget token once a sequence outgrows the
window). A waiting request is admitted, first
come first served, when a slot is free (`max_running`) and its known tokens fit beside the
running ones (the prefix cache gives way). When the running requests outgrow the budget
mid-decode, the most recently admitted one is pre-empted: its KV is dropped and it goes back
to the front of the queue, to be recomputed later from its prompt and the tokens it already
generated (vLLM's recompute pre-emption); its streamed output is unaffected. A request
alone always fits: the engine caps its tokens at the budget.

Steps in flight (a pipeline of ranks): with `max_in_flight` > 1 the forward pass is
launched (`BatchLaunch`) and its logits collected later, so up to `max_in_flight` steps,
each over its own requests, are in the ranks at once: while rank 1 runs step t's rows,
rank 0 runs step t+1's over the other requests (the schedule of GPipe's micro-batches,
Huang et al. 2019, carried across decode steps). A request whose token is still to be
sampled waits out of later steps; the decoding requests are spread over `max_in_flight`
steps (at most ceil(decoding / max_in_flight) rows each), and a prompt's next chunk may go
while its previous one is in flight (every rank runs the steps in launch order, so its KV is
written first). Cache operations (admissions, releases) are recorded in that same order, so
every rank applies them between the same two steps.

Speculative decoding (`speculation.py`, `decoding/speculative_drafts.py`, a draft model's
`draft_model.py`): a decoding request may carry a draft of k guessed tokens, on a single
rank and on a split instance alike (rank 0's scheduler drafts; the draft rows travel in
the step like any decode rows). Its step then holds k + 1 decode rows, the fed token
and the draft tokens at the next positions, laid out from the last position down
(`step_layout.py`): every one is a decode row to the attention (`BatchPlan.repeated_slots`;
the native decode layer takes a run of one slot's ascending positions for a prompt chunk,
attended by another kernel), so each position's logits come from the same kernels as a
plain decode step's. The step's rows
stay within `Speculation.max_decode_rows` (the quantized linears switch kernel above it),
drafts go only into steps without prompt rows, and drafts are dropped before anything is
pre-empted for their KV. The request verifies its rows in order (`RequestState.
accept_drafts`); the KV of rejected positions is rolled back by committing only the accepted
length (`SlotKVCache.commit`; later steps overwrite those positions), so the prefix cache
stores only verified tokens. With steps in flight (a pipeline) a drafting request has one
step in flight, as every request: its next draft needs the verified tokens, while the
other requests' steps keep the ranks busy. A greedy request's rows, and a sampling
request's rows of an n-gram draft, come back as the tokens the pipeline's last rank chose
(with the request's keys, up to the first rejection; and their logprobs where
asked), as a plain row's; a sampling request's draft-model rows, or those of a request
with penalties, bias or a constraint, as whole logits (`speculation.remote_rows`); and
until they are verified its slot holds the draft positions for moves and growths
(`SlotKVCache.hold_unverified`: other requests may leave or grow the cache meanwhile). A
launched step is timed from its launch to its logits' arrival, for the automatic switch
(the ranks' overlap with other steps included, alike for steps with and without drafts).
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from loguru import logger
from transformers import PreTrainedModel

from exo.worker.engines.torch.batching.batch_attention import BatchPlan, forward_batch
from exo.worker.engines.torch.batching.chunk_sizer import (
    DEFAULT_INITIAL_CHUNK,
    FixedChunkSizer,
    PrefillChunkSizer,
)
from exo.worker.engines.torch.batching.kv_footprint import KVFootprint, first_hit_length
from exo.worker.engines.torch.batching.prefix_cache import PrefixCache
from exo.worker.engines.torch.batching.prompt_images import align_chunk, cache_key_tokens
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.speculation import RemoteRow, Speculation, remote_rows
from exo.worker.engines.torch.batching.step_layout import RunningRequest, draft_rows, lay_out_step
from exo.worker.engines.torch.decoding.sampling import SampledToken
from exo.worker.engines.torch.decoding.speculative_drafts import NO_DRAFT, Draft

# Prompt tokens prefilled per step, over all prefilling requests, while other requests are
# decoding, until step times have been measured (then `PrefillChunkSizer` sizes the chunk).
# 8 kept a running stream's median gap within the speed issue's bound (3x idle) when it was
# chosen (figures: docs/benchmarks/engine-design-figures.md#schedulerpy).
PREFILL_TOKENS_PER_STEP = DEFAULT_INITIAL_CHUNK
# With no request decoding there is no stream to protect: larger chunks prefill faster
# (fewer steps, better matmul shapes) while bounding activation memory ([chunk,
# intermediate] MLP activations, [heads, chunk, keys] attention scores).
PREFILL_TOKENS_PER_IDLE_STEP = 512

StepOutput = tuple[str, GeneratedPiece | Exception]

# `forward_batch`'s signature: (model, plan, input_ids [1, T], position_ids [1, T],
# logit_rows [R]) -> [R, vocab] float32 logits. A multi-rank engine passes its own (it tells
# the other ranks the step's plan, then runs its part of the model).
BatchForward = Callable[
    [PreTrainedModel, BatchPlan, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]
# Per logit row, its [vocab] logits, or the token another rank chose (`SampledToken`).
StepLogits = torch.Tensor | Sequence[torch.Tensor | SampledToken]

# The same arguments and, per logit row, its `RemoteRow`, or None for a row whose whole
# logits are wanted (a draft-model draft's rows of a sampling request: rank 0 verifies
# them); starts the forward pass and returns the function that waits for its logits (a
# pipeline's rank 0: its layers run before it returns, the other ranks' after; its last
# rank may choose a row's token itself).
BatchLaunch = Callable[
    [
        PreTrainedModel,
        BatchPlan,
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        list[RemoteRow | None],
    ],
    Callable[[], StepLogits],
]


@dataclass(eq=False, slots=True)
class _Launched:
    """A step whose forward pass has started: `sampled[i]` takes the next
    `len(drafts[i]) + 1` logits rows (one without a draft). The first `decoding` of
    `sampled` were decoding; `seconds` is the time of the forward pass where it was run
    here (None: launched, then timed from `started`, a `time.perf_counter` value, to its
    logits' arrival), `draft_seconds` that of its drafts' proposal (before `started`; a
    draft model's prompt catch-up included), and `decode_only` whether the step had no
    prompt rows."""

    sampled: list[RunningRequest]
    logits: Callable[[], StepLogits]
    drafts: list[Draft]
    decoding: int = 0
    seconds: float | None = None
    decode_only: bool = False
    started: float = 0.0
    draft_seconds: float = 0.0


class BatchScheduler:
    """Runs the requests of one single-rank engine in batched steps.

    Args:
        model: the whole model (switched to `BATCHED_ATTENTION`).
        cache: the slots' KV (`cache.slots` = most requests running at once).
        windows: per layer, the sliding window in tokens or None.
        layer_of: `batch_attention.attention_layers(model)`.
        budget_tokens: KV budget over running requests and the prefix cache, in tokens.
        prefix_cache: where finished requests' KV is kept (None: no reuse).
        device: where inputs go.
        forward: runs one step's forward pass (None: `forward_batch`, looked up at each
            step).
        launch: starts one step's forward pass instead (overrides `forward`).
        max_in_flight: steps launched and not yet sampled, at most (1: each `step` runs
            its forward pass to the end).
        footprint: how the budget counts a sequence (None: `windows`, the cache's trim).
            A pipeline's rank 0 holds some layers only and counts every layer as full.
        prefix_windows: the windows a prefix hit must respect, over the whole model's
            layers (None: `windows`; a pipeline's rank 0 adds the other stages' window).
        speculation: drafts and their bookkeeping (None: no speculation), with `forward`
            or `launch` alike (see the module docstring).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        cache: SlotKVCache,
        windows: Sequence[int | None],
        layer_of: dict[int, int],
        budget_tokens: int,
        prefix_cache: PrefixCache | None,
        device: torch.device,
        forward: BatchForward | None = None,
        launch: BatchLaunch | None = None,
        max_in_flight: int = 1,
        footprint: KVFootprint | None = None,
        prefix_windows: Sequence[int | None] | None = None,
        speculation: Speculation | None = None,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be at least 1")
        self.footprint = footprint or KVFootprint(
            tuple(windows), cache.trim_slack, cache.trim_chunk
        )
        self._prefix_windows = tuple(windows if prefix_windows is None else prefix_windows)
        if prefix_cache is not None and prefix_cache.cost is None:
            prefix_cache.cost = self.footprint.entry_tokens
        self._model = model
        self._cache = cache
        self._windows = windows
        self._layer_of = layer_of
        self.budget_tokens = budget_tokens
        self.prefix_cache = prefix_cache
        self._device = device
        self._forward = forward
        self.launch = launch
        self.max_in_flight = max_in_flight
        self._in_flight: deque[_Launched] = deque()
        self._waiting: deque[RequestState] = deque()
        self._running: list[RunningRequest] = []
        # Requests that finished in a step whose KV still waits in their slots to enter the
        # prefix cache (`store_finished`, once the step's outputs are out).
        self._finished: list[RunningRequest] = []
        self._admissions = itertools.count()
        self.preemptions = 0
        # The engine's test seam only (`testing_seam`): seconds each step with a prefill
        # chunk sleeps before its forward pass; 0 on every production model.
        self.prefill_chunk_seconds = 0.0
        self.decode_step_seconds = 0.0  # the test seam's (`testing_seam`), as the above
        # Prompt tokens per step beside decodes, from the measured forward passes (a fixed
        # chunk where a benchmark or test sets one).
        self.chunk_sizer: PrefillChunkSizer | FixedChunkSizer = PrefillChunkSizer(
            maximum=PREFILL_TOKENS_PER_IDLE_STEP, initial=PREFILL_TOKENS_PER_STEP
        )
        self.speculation = speculation

    @property
    def max_running(self) -> int:
        return self._cache.slots

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._in_flight)

    @property
    def in_flight(self) -> int:
        """Steps launched and not yet sampled."""
        return len(self._in_flight)

    @property
    def running_ids(self) -> list[str]:
        return [running.state.request_id for running in self._running]

    @property
    def waiting_ids(self) -> list[str]:
        return [state.request_id for state in self._waiting]

    def add(self, state: RequestState) -> None:
        """Queue a request (admitted at a later `step`)."""
        self._waiting.append(state)

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request and free its slot; False if unknown. A running
        request's KV so far (its prompt as far as prefilled, the tokens it generated) goes
        into the prefix cache first, as a finished request's does: a client that stops a
        reply and asks again (a dashboard's Stop, then Regenerate) does not prefill the
        whole prompt again."""
        for state in self._waiting:
            if state.request_id == request_id:
                self._waiting.remove(state)
                return True
        for running in self._running:
            if running.state.request_id == request_id:
                self._release(running, keep_prefix=True)
                self.store_finished()
                return True
        return False

    def kv_tokens(self) -> int:
        """Budget tokens of KV held now by running requests and by finished ones waiting
        for `store_finished` (`KVFootprint.tokens`; the prefix cache not counted)."""
        tokens = self.footprint.tokens
        return sum(
            tokens(running.computed) for running in itertools.chain(self._running, self._finished)
        )

    def store_finished(self) -> int:
        """Copy the KV of the requests that finished in the last step into the prefix cache
        and free their slots; how many requests. `step` does it first; a caller that has
        sent a step's outputs calls it sooner, so a request's last piece never waits for the
        copy (tens of ms for a long prompt: a fresh mapping's page faults; figures:
        docs/benchmarks/engine-design-figures.md#schedulerpy)."""
        stored = len(self._finished)
        while self._finished:
            running = self._finished.pop(0)
            assert self.prefix_cache is not None
            kv = self._cache.read(running.slot, running.computed)
            reached = self._cache.reached[running.slot]
            cache = self._cache
            first_hit = first_hit_length(
                reached, self._prefix_windows, cache.trim_slack, cache.trim_chunk
            )
            keyed = cache_key_tokens(running.tokens[: running.computed], running.state.images)
            self.prefix_cache.insert(keyed, kv, reached, first_hit)
            self._free(running)
        return stored

    # -- one step ---------------------------------------------------------------------

    def step(self) -> list[StepOutput]:
        """Admit what fits, launch one forward pass over the requests not waiting for a
        token, and sample the oldest step in flight once `max_in_flight` are (or nothing
        more could be launched).

        Returns:
            `(request_id, piece)` per streamed piece (a request may finish here), or
            `(request_id, error)` for a request that failed on its own (e.g. its constraint
            allows no token); the other requests go on. Empty while steps fill the pipeline.

        Raises:
            Exception: the step failed: a forward pass, or laying out or sampling the
                batch (every running request is dropped, and every step in flight with
                them, so a request that breaks a step never breaks the next one).
        """
        self.store_finished()
        try:
            self._admit()
            launched = self._launch_step()
            if self._in_flight and (not launched or len(self._in_flight) >= self.max_in_flight):
                return self._complete_step(self._in_flight.popleft())
        except Exception:
            self._drop_everything()
            raise
        return []

    def _launch_step(self) -> bool:
        """Start one step's forward pass; False if no request can take part."""
        if not self._running:
            return False
        decoding, prefill, drafts = self._schedule()
        if not decoding and not prefill:
            return False
        if prefill and self.prefill_chunk_seconds:
            time.sleep(self.prefill_chunk_seconds)
        if decoding and self.decode_step_seconds:
            time.sleep(self.decode_step_seconds)
        layout = lay_out_step(
            decoding, prefill, drafts, self._cache, self._windows, self._layer_of, self._device
        )
        arguments = (
            self._model,
            layout.plan,
            layout.input_ids,
            layout.position_ids,
            layout.logit_rows,
        )
        seconds: float | None = None
        started = time.perf_counter()
        logits: Callable[[], StepLogits]
        if self.launch is not None:
            row_requests = [
                row
                for running, drafted in zip(layout.sampled, layout.drafts, strict=True)
                for row in remote_rows(running.state, drafted)
            ]
            logits = self.launch(*arguments, row_requests)
        else:
            started = time.perf_counter()
            computed = (self._forward or forward_batch)(*arguments)
            seconds = time.perf_counter() - started
            self.chunk_sizer.observe(
                len(layout.plan.decode_slots), sum(length for _, length in prefill), seconds
            )
            logits = lambda: computed  # noqa: E731
        # The KV of these rows is written (on every rank, before any later step's).
        for running in decoding:
            running.computed += 1
        for running, length in prefill:
            running.computed += length
        for running in itertools.chain(decoding, (running for running, _ in prefill)):
            if not running.state.generated_ids:  # the prompt's progress, until its first token
                running.state.prefilled_tokens = min(
                    running.computed, len(running.state.prompt_ids)
                )
        # A draft model's forward passes and catch-up are part of the step's cost (n-gram:
        # ~0), measured apart from the forward pass so a plain step's time stays plain.
        draft_seconds = 0.0 if self.speculation is None else self.speculation.take_draft_seconds()
        for running in layout.sampled:
            running.awaiting = True
        launched = _Launched(
            layout.sampled, logits, layout.drafts, len(decoding), seconds, not prefill, started,
            draft_seconds,
        )  # fmt: skip
        self._in_flight.append(launched)
        return True

    def _complete_step(self, launched: _Launched) -> list[StepOutput]:
        """Sample a launched step's rows (skipping requests cancelled or pre-empted since)."""
        logits = launched.logits()
        seconds = launched.seconds
        if seconds is None:  # launched: from its launch to its logits (see `step_measured`)
            seconds = time.perf_counter() - launched.started
        outputs: list[StepOutput] = []
        speculation = self.speculation
        emitted_by_decoding = 0
        row = 0
        for index, running in enumerate(launched.sampled):
            drafted = launched.drafts[index]
            draft = drafted.tokens
            first, row = row, row + len(draft) + 1
            running.awaiting = False
            if running not in self._running:
                continue
            state = running.state
            before = len(state.generated_ids)
            try:
                if draft:
                    pieces, accepted = state.accept_drafts(
                        draft_rows(logits, first, row), draft, drafted.probabilities
                    )
                else:
                    pieces, accepted = state.accept(logits[first]), 0
            except Exception as error:  # this request's own failure (its constraint)
                self._release(running, keep_prefix=False)
                outputs.append((state.request_id, error))
                continue
            emitted = len(state.generated_ids) - before
            running.tokens.extend(state.generated_ids[before:])
            if draft:
                # The fed token's KV was counted at launch; the accepted drafts' is kept,
                # the rejected positions' is dropped (overwritten by later steps).
                running.computed += emitted - 1
                self._cache.commit_verified(running.slot, running.computed)
                assert speculation is not None
                speculation.verified(state.request_id, len(draft), accepted)
            if index < launched.decoding:
                emitted_by_decoding += emitted
                if speculation is not None:
                    speculation.decoded(emitted)
            outputs.extend((state.request_id, piece) for piece in pieces)
            if state.finished:
                self._release(running, keep_prefix=True)
        if speculation is not None and launched.decode_only:
            speculation.step_measured(
                launched.decoding, row, emitted_by_decoding, seconds, launched.draft_seconds
            )
        return outputs

    def _drop_everything(self) -> None:
        """After a failed forward pass: free every running request and forget the steps in
        flight (their logits will never come)."""
        self._in_flight.clear()
        for running in list(self._running):
            self._release(running, keep_prefix=False)

    def _schedule(
        self,
    ) -> tuple[list[RunningRequest], list[tuple[RunningRequest, int]], dict[int, Draft]]:
        """This step's decoding requests (slot order), prefill chunks and drafts (by
        `id` of the decoding request), within the KV budget (evicting prefix-cache entries,
        then dropping the drafts, then pre-empting, to make room). Requests awaiting a
        token from a step in flight take no part; the decoding ones are spread over
        `max_in_flight` steps."""
        auto_allowed: bool | None = None
        while True:
            streams = [running for running in self._running if not running.prefilling]
            decoding = sorted(
                (running for running in streams if not running.awaiting),
                key=lambda running: running.slot,
            )[: math.ceil(len(streams) / self.max_in_flight)]
            prefill: list[tuple[RunningRequest, int]] = []
            # Small chunks protect the gaps of streams that already stream tokens; one
            # awaiting its first token (in flight) has no gap yet.
            streaming = any(running.state.generated_ids for running in streams)
            prefilling = sorted(
                (running for running in self._running if running.prefilling),
                key=lambda running: running.admitted,
            )
            room = PREFILL_TOKENS_PER_IDLE_STEP
            if streaming and prefilling:
                # Launched steps are not timed: the sizer would never learn their costs.
                room = (
                    self.chunk_sizer.chunk(len(decoding))
                    if self.launch is None and decoding
                    else PREFILL_TOKENS_PER_STEP
                )
            for running in prefilling:
                if room <= 0:
                    break
                length = min(room, len(running.tokens) - running.computed)
                # Never end a chunk inside an image (its tokens attend both ways).
                length = align_chunk(running.computed, length, running.state.images)
                prefill.append((running, length))
                room -= length
            drafts: dict[int, Draft] = {}
            if decoding and not prefill and self.speculation is not None:
                if auto_allowed is None:
                    states = [running.state for running in self._running]
                    auto_allowed = self.speculation.auto_allowed(states, len(decoding))
                drafts = self._drafts(decoding, auto_allowed)
            tokens = self.footprint.tokens
            while True:
                added = {
                    id(running): 1 + len(drafts.get(id(running), NO_DRAFT).tokens)
                    for running in decoding
                }
                for running, length in prefill:
                    added[id(running)] = length
                needed = sum(
                    tokens(running.computed + added.get(id(running), 0))
                    for running in itertools.chain(self._running, self._finished)
                )
                if self._make_room(needed):
                    return decoding, prefill, drafts
                if not drafts:
                    break
                drafts = {}  # the drafts' KV does not fit: plain decoding first
            self._preempt_latest()

    def _drafts(self, decoding: list[RunningRequest], auto_allowed: bool) -> dict[int, Draft]:
        """`Speculation.drafts` of the decoding requests, by `id` of the request (none in
        a step where a request with multimodal rotary positions decodes: those rows are
        laid out one per decoding request)."""
        assert self.speculation is not None
        if any(running.state.positions is not None for running in decoding):
            return {}
        pairs = [(running.state, running.tokens) for running in decoding]
        drafts = self.speculation.drafts(pairs, auto_allowed)
        return {
            id(running): draft
            for running, draft in zip(decoding, drafts, strict=True)
            if draft.tokens
        }

    def _make_room(self, needed_tokens: int) -> bool:
        """Whether `needed_tokens` of running KV fit the budget, evicting prefix-cache
        entries as needed."""
        if needed_tokens > self.budget_tokens:
            return False
        if self.prefix_cache is not None:
            self.prefix_cache.evict(self.budget_tokens - needed_tokens)
        return True

    def _preempt_latest(self) -> None:
        victim = max(self._running, key=lambda running: running.admitted)
        if len(self._running) == 1:  # the engine caps one request's tokens at the budget
            raise RuntimeError("a lone request outgrew the KV budget")
        logger.info(
            "KV budget full: pre-empting {} ({} tokens, recomputed later)",
            victim.state.request_id, victim.computed,
        )  # fmt: skip
        self.preemptions += 1
        self._release(victim, keep_prefix=False)
        self._waiting.appendleft(victim.state)

    def _admit(self) -> None:
        while self._waiting and len(self._running) < self._cache.slots:
            state = self._waiting[0]
            tokens = state.known_tokens
            match = None
            if self.prefix_cache is not None:  # first: a hit is then the last one evicted
                keyed = cache_key_tokens(tokens, state.images)  # images by their bytes
                match = self.prefix_cache.lookup(keyed, limit=len(tokens) - 1)
            # Room for its known tokens and one more beside what runs now.
            if not self._make_room(self.kv_tokens() + self.footprint.tokens(len(tokens) + 1)):
                return
            self._waiting.popleft()
            slot = self._cache.allocate()
            computed = 0
            if match is not None:
                self._cache.write(slot, match.kv, match.length, match.reached)
                computed = match.length
                if not state.generated_ids:  # a first admission, not a recompute
                    state.cached_tokens = computed
            if not state.generated_ids:
                state.prefilled_tokens = computed
            self._running.append(
                RunningRequest(state, slot, list(tokens), computed, next(self._admissions))
            )

    def _release(self, running: RunningRequest, keep_prefix: bool) -> None:
        """Take the request out of the batch and free its slot; with `keep_prefix` (and a
        prefix cache) the slot is kept for `store_finished` to copy its KV first."""
        self._running.remove(running)
        if self.speculation is not None:
            self.speculation.forget(running.state.request_id)
        if keep_prefix and self.prefix_cache is not None and running.computed > 0:
            self._finished.append(running)
            return
        self._free(running)

    def _free(self, running: RunningRequest) -> None:
        """Free `running`'s slot; the request whose slot moves into it (the last one) is
        told its new slot number."""
        moved = self._cache.free(running.slot)
        if moved is not None:
            for other in itertools.chain(self._running, self._finished):
                if other.slot == moved:
                    other.slot = running.slot
                    break
