"""Mid-stream failover: a streamed generation whose instance is lost after the client got
chunks continues on another instance of the model, in the same response.

When the chunk stream of a streamed generation ends with an `INSTANCE_UNAVAILABLE` error
(its instance lost a node, or its runner died: `ClusterClient._end_streams_of_lost_instances`,
the supervisor's crash report), the API node sends the request again under a new command
with the token ids of every chunk the client was given as `forced_token_ids`. The new
instance prefills prompt + those tokens and decodes on from there; its runner advances the
stop matcher, penalties, grammar, seeded sampler (`RequestState.force`) and the tool-call /
reasoning parser (`replay_forced_pieces`) over them without streaming anything for them,
so the client's renderer — the same one, its Responses / Claude indices and ids going on —
receives the rest: no text twice, none missing. Usage stays the original request's: the
prompt's tokens once (the prefix-cached part as reported when the stream opened), every
generated token (forced ones included) as completion tokens.

What is promised about the text after the failover (the runner's token-chunk grouping and
held-back text never matter: the forced tokens are always whole streamed pieces):
- greedy decoding: the continuation is the one a fresh greedy run gives with the same forced
  prefix; on float32 weights and KV it is token for token the unbroken run (the engine's
  prefill and decode of the same positions agree; `test_forced_prefix.py`). With bfloat16
  KV (the default model's) a near-tie may be decided the other way than in the unbroken
  run, whose KV was written in decode steps rather than one prefill.
- seeded sampling without a constraint: the sampler skips one draw per forced token, so the
  continuation draws with the very numbers the unbroken run would have used: the same
  tokens where the logits are the same (float32). Under a constraint (JSON, forced tool
  call) a draw may have taken several numbers; the continuation is then a sample from the
  same distribution, not the same tokens. Unseeded sampling: a sample from the same
  distribution.

Where: a healthy instance of the model (not unavailable, no node lost, every runner ready)
other than the lost one as it was — the lost instance placed again on other nodes counts,
the same placement whose runner died does not (`healthy_instance_exists`); when none can
appear (a lone instance's runner died) the error goes out at once.

Bounded: at most `MAX_FAILOVERS` re-submissions per stream; each loss is given up after
`FAILOVER_DEADLINE_SECONDS` without an instance taking the request — after
`FAILOVER_LOADING_DEADLINE_SECONDS` while an instance of the model is coming up on nodes
that are all there (`failover_deadline`: the lost one placed again and loading or fetching
its files, as after its node restarted), and a re-submission
silent for `CONTINUATION_FIRST_CHUNK_SECONDS` is cancelled; then the client gets the error
of today (the lost stream's 503 in the dialect's in-band error shape). A client that leaves during
the failover cancels the new command (the response's cancel names the command running
now). A request pinned to an instance (`INSTANCE_HEADER`) never moves.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from loguru import logger

from exo.api.wire.errors import ApiError
from exo.shared.types.chunks import (
    INSTANCE_UNAVAILABLE,
    Chunk,
    ErrorChunk,
    PrefillProgressChunk,
    TokenChunk,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.common import ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerFailed, RunnerReady, RunnerRunning, RunnerShutdown
from exo.shared.types.state import State

MAX_FAILOVERS = 4
"""Re-submissions one stream may make after losing its instance. A node loss takes one; a
re-submission the master routed just before it saw the loss fails at once and takes
another; more than a few losses within one answer mean the cluster is falling apart, and
the client is better served by the error than by a longer wait."""
FAILOVER_DEADLINE_SECONDS = 30.0
"""How long one loss may hold the stream before the error goes out while no instance of
the model is coming up (else `FAILOVER_LOADING_DEADLINE_SECONDS`): the master marks a lost
node within a few seconds (zenoh liveliness, `master.recovery`) and places its instance
again at once, so a wait with nothing under way past this has nothing to wait for."""
FAILOVER_LOADING_DEADLINE_SECONDS = 120.0
"""How long one loss may hold the stream while an instance of the model is coming up
(`failover_deadline`): as long as a request lost before its first chunk waits for its
model's instance placed again (`accepted_generation.RETRY_WAIT_SECONDS`). A small model
placed again on a node that must fetch it, or back on its own node restarted within
seconds (`master.recovery.replacements_nearer_files`), loads within this; SSE streams
send a heartbeat every few seconds meanwhile (`early_stream.KEEPALIVE_SECONDS`), so
proxies and agents see no silence."""
CONTINUATION_FIRST_CHUNK_SECONDS = 120.0
"""How long a re-submission may take to send its first chunk (its prompt + forced tokens
prefilled on a CPU, or the instance's runner loading again after it died) before the
stream is given up and the re-submission cancelled: as long as a request lost before its
first chunk waits for its model to serve again (`accepted_generation.RETRY_WAIT_SECONDS`)."""
RESUBMIT_PAUSE_SECONDS = 0.5
"""Before a second or later re-submission for the same loss: at most this long waiting for
the cluster state to change (the master to mark the lost instance), so a re-submission that
failed at once is not repeated into the same state."""


@dataclass(slots=True)
class StreamProgress:
    """What the client of one streamed generation was given, and how the chunks of a
    continued stream are adjusted so the client sees one unbroken stream.

    Attributes:
        token_ids: the generated token ids of every chunk given to the client, in order.
        prompt_tokens: the prompt's size as the first token chunk reported it (None before).
        cached_tokens: the prefix-cached part reported beside it.
        opened: a token or tool-call chunk was given (the dialect opened its answer).
        continued: the chunks now come from a re-submission.
        chunks_given: how many chunks were given.
    """

    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    opened: bool = False
    continued: bool = False
    chunks_given: int = 0

    def given(self, chunk: Chunk) -> None:
        """Record `chunk` as given to the client."""
        self.chunks_given += 1
        match chunk:
            case TokenChunk():
                self.token_ids.extend(chunk.token_ids)
                if self.prompt_tokens is None and chunk.prompt_tokens is not None:
                    self.prompt_tokens = chunk.prompt_tokens
                    self.cached_tokens = chunk.cached_tokens
                self.opened = True
            case ToolCallChunk():
                self.token_ids.extend(chunk.token_ids)
                self.opened = True
            case _:
                pass

    def adapt(self, chunk: Chunk) -> Chunk | None:
        """`chunk` as the client should see it (None: drop it). A continued stream's prefill
        progress is dropped once the answer opened, its prompt size (already reported) is
        not repeated, and its final usage keeps the prefix-cached count reported when the
        stream opened (the new instance's prefill of prompt + forced tokens is not the
        client's prompt)."""
        if not self.continued:
            return chunk
        match chunk:
            case PrefillProgressChunk() if self.opened:
                return None
            case TokenChunk():
                update: dict[str, object] = {}
                if self.prompt_tokens is not None:
                    update["prompt_tokens"] = None
                    update["cached_tokens"] = None
                if chunk.usage is not None:
                    update["usage"] = self._usage(chunk.usage)
                return chunk.model_copy(update=update) if update else chunk
            case ToolCallChunk() if chunk.usage is not None:
                return chunk.model_copy(update={"usage": self._usage(chunk.usage)})
            case _:
                return chunk

    def _usage(self, usage: Usage) -> Usage:
        if self.cached_tokens is None:
            return usage
        return usage.model_copy(
            update={"cached_tokens": min(self.cached_tokens, usage.prompt_tokens)}
        )


def healthy_instance_exists(state: State, model: ModelId, lost: Instance | None) -> bool:
    """Whether an instance of `model` can continue a stream now: not unavailable, none of its
    nodes lost, every runner of its placement ready or running, and not `lost` as it was
    when the stream lost it (the same placement; placed again on other nodes, it is
    another)."""
    for instance in state.instances_of_model(model):
        assignments = instance.shard_assignments
        if (
            instance.instance_id in state.unavailable_instances
            or any(node in state.lost_nodes for node in assignments.node_to_runner)
            or (lost is not None and assignments == lost.shard_assignments)
        ):
            continue
        if all(
            isinstance(state.runners.get(runner_id), RunnerReady | RunnerRunning)
            for runner_id in assignments.runner_to_shard
        ):
            return True
    return False


def instance_coming_up(state: State, model: ModelId, lost: Instance | None) -> bool:
    """Whether an instance of `model` other than `lost` as it was is on its way to serve:
    every node of it there, not waiting for room, none of its runners failed or shut down
    (runners loading, warming up, or not started yet while their node fetches the files)."""
    for instance in state.instances_of_model(model):
        assignments = instance.shard_assignments
        unavailable = state.unavailable_instances.get(instance.instance_id)
        if (
            (lost is not None and assignments == lost.shard_assignments)
            or (unavailable is not None and unavailable.waiting_for_room)
            or any(node in state.lost_nodes for node in assignments.node_to_runner)
        ):
            continue
        if not any(
            isinstance(state.runners.get(runner_id), RunnerFailed | RunnerShutdown)
            for runner_id in assignments.runner_to_shard
        ):
            return True
    return False


def failover_deadline(
    state: State, model: ModelId, lost: Instance | None, deadline: float, loading_deadline: float
) -> float:
    """The deadline in force for a failover waiting for an instance of `model`:
    `loading_deadline` (the later) while one is coming up (`instance_coming_up`), else
    `deadline`. A loss that the cluster is visibly repairing waits for the repair; one with
    nothing under way is given up on sooner."""
    return loading_deadline if instance_coming_up(state, model, lost) else deadline


def instance_may_come(
    state: State, model: ModelId, lost: Instance | None, node_lost: bool = False
) -> bool:
    """Whether a healthy instance other than `lost` as it was may still appear: another
    instance of `model` exists (`lost` placed again under its id is another), or `lost` is
    unavailable or, `node_lost`, lost a node the master has not marked yet: it will be
    placed again on the nodes that remain. False after a lone instance's runner died (its
    nodes all there, its placement unchanged)."""
    return any(
        lost is None
        or instance.shard_assignments != lost.shard_assignments
        or instance.instance_id in state.unavailable_instances
        or (node_lost and instance.instance_id == lost.instance_id)
        for instance in state.instances_of_model(model)
    )


Resubmit = Callable[[tuple[int, ...], float, float], Awaitable[AsyncIterator[Chunk]]]
"""Sends the generation again with these forced token ids, waiting for an instance to take
it at most until the deadline, or the loading deadline while one is coming up
(`failover_deadline`; both `clock` seconds); returns the new command's chunks. Raises
ApiError when no instance took it in time (`Generation.fail_over`)."""


def is_instance_loss(chunk: Chunk) -> bool:
    """Whether `chunk` ends its stream because the instance became unavailable."""
    return isinstance(chunk, ErrorChunk) and chunk.error_code == INSTANCE_UNAVAILABLE


async def with_failover(
    chunks: AsyncIterator[Chunk],
    resubmit: Resubmit,
    *,
    state_changed: Callable[[], Awaitable[None]],
    cancel: Callable[[], None],
    clock: Callable[[], float] = anyio.current_time,
) -> AsyncIterator[Chunk]:
    """`chunks`, continued on another instance whenever the stream loses its instance (the
    module docstring says what holds, and the bounds).

    Args:
        chunks: the generation's chunk stream as the client would get it.
        resubmit: sends the generation again with the given forced token ids, by the
            given deadline and loading deadline.
        state_changed: returns when the cluster state next changes (awaited at most
            `RESUBMIT_PAUSE_SECONDS` before a repeated re-submission).
        cancel: cancels the command running now (a re-submission whose first chunk did
            not come within `CONTINUATION_FIRST_CHUNK_SECONDS`).
        clock: monotonic seconds.

    Yields:
        The chunks for the client's renderer; a loss given up on ends with the lost
        stream's error chunk.
    """
    progress = StreamProgress()
    failovers = 0
    deadline = loading_deadline = 0.0
    given_at_resume = 0
    lost: ErrorChunk | None = None
    while True:
        first_by = clock() + CONTINUATION_FIRST_CHUNK_SECONDS if progress.continued else None
        while True:
            if first_by is None:
                chunk = await anext(chunks, None)
            else:
                waited: list[Chunk | None] = []
                with anyio.move_on_after(max(0.0, first_by - clock())):
                    waited.append(await anext(chunks, None))
                if not waited:
                    logger.warning("api: a continued stream sent nothing in time; giving up")
                    cancel()
                    assert lost is not None
                    yield lost
                    return
                chunk, first_by = waited[0], None
            if chunk is None:
                return
            if is_instance_loss(chunk):
                assert isinstance(chunk, ErrorChunk)
                lost = chunk
                break
            adapted = progress.adapt(chunk)
            if adapted is not None:
                progress.given(adapted)
                yield adapted
        assert lost is not None
        # A re-submission that lost its instance before giving anything continues the
        # same loss (routed before the master saw it): its deadline, after a pause.
        if not (progress.continued and progress.chunks_given == given_at_resume):
            deadline = clock() + FAILOVER_DEADLINE_SECONDS
            loading_deadline = clock() + FAILOVER_LOADING_DEADLINE_SECONDS
        elif clock() < loading_deadline:
            with anyio.move_on_after(min(RESUBMIT_PAUSE_SECONDS, loading_deadline - clock())):
                await state_changed()
        # The outer bound; `resubmit` applies the one in force (`failover_deadline`).
        if failovers >= MAX_FAILOVERS or clock() >= loading_deadline:
            yield lost
            return
        failovers += 1
        logger.info(
            f"api: a stream lost its instance after {len(progress.token_ids)} tokens; "
            f"continuing elsewhere (failover {failovers} of at most {MAX_FAILOVERS})"
        )
        try:
            chunks = await resubmit(tuple(progress.token_ids), deadline, loading_deadline)
        except ApiError as error:
            logger.info(f"api: the failover found no instance: {error}")
            yield lost
            return
        progress.continued, given_at_resume = True, progress.chunks_given
