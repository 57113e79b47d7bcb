"""Mid-stream failover (`exo.api.serving.failover`) behind the real app and a real server:
a stream whose instance is lost after the client got chunks continues under a new command
with the streamed tokens forced, and the client of every dialect — raw SSE and the official
SDKs — sees one unbroken answer (no text twice or missing, Responses / Claude indices and
ids going on, usage of the original request); a loss with no instance to go to, or one loss
too many, ends the stream with the lost stream's error in the dialect's shape; a client
that leaves during the failover cancels the new command.

The stand-in cluster streams one token per chunk and loses the first commands' instance
after `LOST_AFTER` chunks; a continued command starts where its forced tokens end (what a
runner does, `test_forced_prefix.py` checks the engine side). Every wait has a deadline.
The failover's pure decisions and `StreamProgress` are checked without a server in
`test_failover_decisions.py`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import anthropic
import anyio
import httpx
import openai
import pytest

from exo.api.serving import failover
from exo.api.serving.cluster_client import CommandRejectedError
from exo.api.serving.failover import (
    MAX_FAILOVERS,
)
from exo.api.tests.serving import scripted_app, serving
from exo.shared.types.chunks import (
    INSTANCE_UNAVAILABLE,
    Chunk,
    ErrorChunk,
    PrefillProgressChunk,
    TokenChunk,
    Usage,
)
from exo.shared.types.commands import CancelGeneration, GenerateText
from exo.shared.types.common import CommandId, NodeId
from exo.shared.types.instances import Instance
from exo.shared.types.runners import RunnerLoading, RunnerReady
from exo.shared.types.state import InstanceUnavailable
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.testing.scripted_cluster import ScriptedCluster

DEADLINE_SECONDS = 20.0
WORDS = (
    "Once",
    " upon",
    " a",
    " time",
    ",",
    " a",
    " keeper",
    " watched",
    " the",
    " sea",
    " all",
    ".",
)
TOKENS = tuple(range(101, 101 + len(WORDS)))
ANSWER = "".join(WORDS)
LOST_AFTER = 6
PROMPT_TOKENS = 5
CACHED_TOKENS = 3
LOST = "instance i-1 of SmolLM2 is unavailable: node n-1 left; re-placing"


class FailingOverCluster(ScriptedCluster):
    """Streams `WORDS`, one token per chunk, from where a command's forced tokens end; the
    first `losses` commands lose their instance after `LOST_AFTER` chunks of the answer
    (`lose_at_once`: a continued one before any). `refuse_resubmissions`: the master has
    no instance for a re-submission (503, none recovering). `hold_resubmissions`: a
    re-submission is never answered (`held` is set when it is sent)."""

    def __init__(
        self,
        losses: int = 1,
        lose_at_once: bool = False,
        refuse_resubmissions: bool = False,
        hold_resubmissions: bool = False,
        silent_continuations: bool = False,
        known_route: bool = False,
        routed: Instance | None = None,
    ) -> None:
        super().__init__()
        self.losses = losses
        self.lose_at_once = lose_at_once
        self.refuse_resubmissions = refuse_resubmissions
        self.hold_resubmissions = hold_resubmissions
        self.silent_continuations = silent_continuations
        self.known_route = known_route
        self.routed = routed
        self.node_gone = False
        self.held = threading.Event()
        self.state_changed = anyio.Event()
        self.resubmitted_at: list[float] = []
        self.lost = threading.Event()
        self.state_at_loss: Any = None
        """The state the master would have made of the loss (set with the loss chunk)."""
        (instance,) = self.state.instances.values()
        runners = {
            runner_id: (self.node_id, RunnerReady())
            for runner_id in instance.shard_assignments.runner_to_shard
        }
        self.state = make_state(instances=[instance], runners=runners)

    def routed_placement(self, command_id: CommandId) -> Instance | None:
        """The placement the stream ran on: `routed` when given (the instance placed again
        since), the one instance when `known_route` (its runner died: no other may
        continue), else unknown (any healthy instance may)."""
        if self.routed is not None:
            return self.routed
        return next(iter(self.state.instances.values())) if self.known_route else None

    def placement_lost_a_node(self, instance: Instance) -> bool:
        """Whether the links say a node of `instance` is gone (`node_gone`, before the
        master marks it) or the state does."""
        nodes = instance.shard_assignments.node_to_runner
        return self.node_gone or any(node in self.state.lost_nodes for node in nodes)

    async def submit(self, command: Any, timeout: float = 0.0) -> None:
        await super().submit(command, timeout)
        if len(self.submitted) > 1:
            self.resubmitted_at.append(time.monotonic())
        if len(self.submitted) > 1 and self.refuse_resubmissions:
            raise CommandRejectedError("no instance of the model can take it", 503)
        if len(self.submitted) > 1 and self.hold_resubmissions:
            self.held.set()
            await anyio.sleep(DEADLINE_SECONDS)

    async def _answer(self, command_id: CommandId) -> AsyncIterator[Chunk]:
        position = [item.command_id for item in self.submitted].index(command_id)
        command: GenerateText = self.submitted[position]
        model = command.params.model
        start = len(command.params.forced_token_ids)
        assert command.params.forced_token_ids == TOKENS[:start]
        continued = position > 0
        if continued and self.silent_continuations:
            await anyio.sleep(DEADLINE_SECONDS)
        if continued:  # a runner reports its (new) prefill before the first token
            yield PrefillProgressChunk(
                command_id=command_id, model=model, prompt_tokens=PROMPT_TOKENS,
                cached_tokens=0, prefilled_tokens=PROMPT_TOKENS,
            )  # fmt: skip
        lost_after = 0 if continued and self.lose_at_once else LOST_AFTER
        for sent, index in enumerate(range(start, len(WORDS))):
            if position < self.losses and sent == lost_after:
                if self.state_at_loss is not None:
                    self.state = self.state_at_loss
                self.lost.set()
                yield ErrorChunk(
                    command_id=command_id, model=model, error_message=LOST, status_code=503,
                    error_code=INSTANCE_UNAVAILABLE,
                )  # fmt: skip
                return
            last = index == len(WORDS) - 1
            yield TokenChunk(
                command_id=command_id,
                model=model,
                text=WORDS[index],
                token_ids=(TOKENS[index],),
                finish_reason="stop" if last else None,
                usage=Usage(
                    prompt_tokens=PROMPT_TOKENS,
                    completion_tokens=len(WORDS),
                    cached_tokens=0 if continued else CACHED_TOKENS,
                )
                if last
                else None,
                prompt_tokens=PROMPT_TOKENS if sent == 0 else None,
                cached_tokens=(0 if continued else CACHED_TOKENS) if sent == 0 else None,
            )
            await anyio.sleep(0.001)


@pytest.fixture(autouse=True)
def quick_pause(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failover, "RESUBMIT_PAUSE_SECONDS", 0.05)


def node(cluster: FailingOverCluster) -> Iterator[str]:
    with serving(scripted_app(cluster)) as (base_url, _port):
        yield base_url


MESSAGES: Any = [{"role": "user", "content": "Tell me a story"}]  # the SDKs' typed params


def sse_events(base_url: str, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON of every `data:` line of a streamed answer (`[DONE]` left out)."""
    with (
        httpx.Client(base_url=base_url, timeout=DEADLINE_SECONDS) as client,
        client.stream("POST", path, json=body) as response,
    ):
        assert response.status_code == 200
        return [
            json.loads(line.removeprefix("data: "))
            for line in response.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"
        ]


def chat_text(events: list[dict[str, Any]]) -> str:
    """The content of a streamed chat's events, joined."""
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])


def check_continued(cluster: FailingOverCluster, failovers: int = 1) -> None:
    """The first command, then `failovers` re-submissions forcing what the client got."""
    assert len(cluster.submitted) == 1 + failovers
    assert cluster.submitted[0].params.forced_token_ids == ()
    assert cluster.submitted[-1].params.forced_token_ids == TOKENS[:LOST_AFTER]
    assert len({command.command_id for command in cluster.submitted}) == 1 + failovers


def test_chat_raw_sse_continues_as_one_unbroken_answer() -> None:
    cluster = FailingOverCluster()
    for base_url in node(cluster):
        body = {"model": SMOLLM2, "messages": MESSAGES, "stream": True}
        body["stream_options"] = {"include_usage": True}
        events = sse_events(base_url, "/v1/chat/completions", body)
    check_continued(cluster)
    text = "".join(
        event["choices"][0]["delta"].get("content") or "" for event in events if event["choices"]
    )
    assert text == ANSWER
    assert len({event["id"] for event in events}) == 1
    finishes = [
        choice["finish_reason"]
        for event in events
        for choice in event["choices"]
        if choice["finish_reason"]
    ]
    assert finishes == ["stop"]
    (usage,) = [event["usage"] for event in events if event.get("usage")]
    assert usage["prompt_tokens"] == PROMPT_TOKENS
    assert usage["completion_tokens"] == len(WORDS)
    assert usage["prompt_tokens_details"]["cached_tokens"] == CACHED_TOKENS
    assert cluster.generation_aliases == {}


def test_the_official_sdks_read_one_unbroken_answer() -> None:
    for dialect in ("chat", "responses", "messages"):
        cluster = FailingOverCluster()
        for base_url in node(cluster):
            client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
            if dialect == "chat":
                stream = client.chat.completions.create(
                    model=SMOLLM2, messages=MESSAGES, stream=True
                )
                text = "".join(
                    event.choices[0].delta.content or "" for event in stream if event.choices
                )
            elif dialect == "responses":
                events = list(client.responses.create(model=SMOLLM2, input="Hi", stream=True))
                assert events[-1].type == "response.completed"
                text = events[-1].response.output_text
                usage = events[-1].response.usage
                assert usage is not None and usage.output_tokens == len(WORDS)
                assert usage.input_tokens == PROMPT_TOKENS
                numbers = [event.sequence_number for event in events]
                assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
                deltas = [event for event in events if event.type == "response.output_text.delta"]
                assert "".join(event.delta for event in deltas) == ANSWER
                assert {(e.item_id, e.output_index, e.content_index) for e in deltas} == {
                    (deltas[0].item_id, 0, 0)
                }
                assert [event.type for event in events].count("response.created") == 1
            else:
                claude = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
                with claude.messages.stream(
                    model=SMOLLM2, max_tokens=64, messages=MESSAGES
                ) as claude_stream:
                    events_seen = list(claude_stream)
                    message = claude_stream.get_final_message()
                kinds = [event.type for event in events_seen]
                assert kinds.count("message_start") == 1
                assert kinds.count("content_block_start") == 1
                assert message.usage.output_tokens == len(WORDS)
                assert (
                    message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
                    == PROMPT_TOKENS
                )
                text = "".join(block.text for block in message.content if block.type == "text")
            assert text == ANSWER, dialect
        check_continued(cluster)


def test_ollama_ndjson_continues_as_one_unbroken_answer() -> None:
    cluster = FailingOverCluster()
    for base_url in node(cluster):
        with (
            httpx.Client(base_url=base_url, timeout=DEADLINE_SECONDS) as client,
            client.stream(
                "POST", "/ollama/api/chat", json={"model": SMOLLM2, "messages": MESSAGES}
            ) as response,
        ):
            assert response.status_code == 200
            lines = [json.loads(line) for line in response.iter_lines() if line]
    check_continued(cluster)
    assert "".join(line["message"]["content"] for line in lines) == ANSWER
    assert [line["done"] for line in lines].count(True) == 1
    assert lines[-1]["done"] and lines[-1]["eval_count"] == len(WORDS)
    assert lines[-1]["prompt_eval_count"] == PROMPT_TOKENS


def test_a_resubmission_lost_at_once_is_sent_again() -> None:
    cluster = FailingOverCluster(losses=3, lose_at_once=True)
    for base_url in node(cluster):
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
    check_continued(cluster, failovers=3)
    assert chat_text(events) == ANSWER


@pytest.mark.parametrize(
    "cluster",
    [
        FailingOverCluster(losses=100, lose_at_once=True),
        FailingOverCluster(refuse_resubmissions=True),
    ],
    ids=["every-instance-lost", "no-healthy-instance"],
)
def test_a_failover_with_nowhere_to_go_ends_with_todays_error(
    cluster: FailingOverCluster,
) -> None:
    for base_url in node(cluster):
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
    text = "".join(
        event["choices"][0]["delta"].get("content") or ""
        for event in events
        if event.get("choices")
    )
    assert text == "".join(WORDS[:LOST_AFTER])
    assert events[-1]["error"]["message"] == LOST
    expected = 1 + (MAX_FAILOVERS if cluster.losses == 100 else 1)
    assert len(cluster.submitted) == expected


def test_a_client_leaving_during_the_failover_cancels_the_new_command() -> None:
    cluster = FailingOverCluster(hold_resubmissions=True)
    for base_url in node(cluster):
        with (
            httpx.Client(base_url=base_url, timeout=DEADLINE_SECONDS) as client,
            client.stream(
                "POST",
                "/v1/chat/completions",
                json={"model": SMOLLM2, "messages": MESSAGES, "stream": True},
            ) as response,
        ):
            assert response.status_code == 200
            for line in response.iter_lines():
                if cluster.held.is_set():
                    break
                assert line != "data: [DONE]"
            assert cluster.held.wait(DEADLINE_SECONDS)
        deadline = time.monotonic() + DEADLINE_SECONDS
        target = cluster.submitted[-1].command_id
        while not any(
            isinstance(command, CancelGeneration) and command.target_command_id == target
            for command in cluster.sent
        ):
            assert time.monotonic() < deadline, "the new command was not cancelled"
            time.sleep(0.02)
    assert len(cluster.submitted) == 2


def test_a_lone_instance_whose_runner_died_ends_the_stream_at_once() -> None:
    cluster = FailingOverCluster(known_route=True)
    for base_url in node(cluster):
        started = time.monotonic()
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
        assert time.monotonic() - started < failover.FAILOVER_DEADLINE_SECONDS / 2
    assert events[-1]["error"]["message"] == LOST
    assert len(cluster.submitted) == 1  # no instance could take it: nothing sent again


def test_a_continuation_silent_too_long_is_cancelled_and_ends_with_the_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(failover, "CONTINUATION_FIRST_CHUNK_SECONDS", 0.5)
    cluster = FailingOverCluster(silent_continuations=True)
    for base_url in node(cluster):
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
    assert events[-1]["error"]["message"] == LOST
    assert len(cluster.submitted) == 2
    cancels = [command for command in cluster.sent if isinstance(command, CancelGeneration)]
    assert [cancel.target_command_id for cancel in cancels] == [cluster.submitted[1].command_id]


def test_the_failover_waits_for_another_instance_to_be_healthy() -> None:
    """The lost instance (its runner died, same placement) never takes the continuation;
    a second instance still loading does, once its runner is ready."""
    cluster = FailingOverCluster(known_route=True)
    (lost,) = cluster.state.instances.values()
    other = make_instance(NodeId("node-b"), instance_id="instance-2")
    (other_runner,) = other.shard_assignments.runner_to_shard
    lost_runners = {
        runner_id: (cluster.node_id, RunnerReady())
        for runner_id in lost.shard_assignments.runner_to_shard
    }

    def state_with(status: Any) -> Any:
        runners = {**lost_runners, other_runner: (NodeId("node-b"), status)}
        return make_state(instances=[lost, other], runners=runners)

    cluster.state = state_with(RunnerLoading(layers_loaded=1, total_layers=30))
    ready_at: list[float] = []

    def become_ready() -> None:
        time.sleep(0.6)  # the first stream is lost well before (after six chunks)
        ready_at.append(time.monotonic())
        cluster.state = state_with(RunnerReady())

    for base_url in node(cluster):
        helper = threading.Thread(target=become_ready, daemon=True)
        helper.start()
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
        helper.join(timeout=DEADLINE_SECONDS)
    check_continued(cluster)
    assert cluster.resubmitted_at and ready_at and cluster.resubmitted_at[0] >= ready_at[0]
    assert chat_text(events) == ANSWER


def _continue_on_the_re_placed_instance(
    cluster: FailingOverCluster, changes: list[tuple[float, Any]]
) -> list[dict[str, Any]]:
    """Stream a chat while `changes` (seconds from the start, the state then) happen on
    another thread; the continuation's events."""

    def apply() -> None:
        started = time.monotonic()
        for at, state in changes:
            time.sleep(max(0.0, started + at - time.monotonic()))
            cluster.state = state

    for base_url in node(cluster):
        helper = threading.Thread(target=apply, daemon=True)
        helper.start()
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
        helper.join(timeout=DEADLINE_SECONDS)
    return events


def _re_placed(status: Any) -> Any:
    """The instance placed again under its id on node-c, its new runner in `status`."""
    moved = make_instance(NodeId("node-c"), instance_id="instance-1", runner_tag="again")
    (runner,) = moved.shard_assignments.runner_to_shard
    return make_state(instances=[moved], runners={runner: (NodeId("node-c"), status)})


def test_a_stream_continues_on_its_instance_placed_again_before_the_failover_looked() -> None:
    """The master re-placed the lost instance under its id (new nodes and runners) before
    the stream's failover read the state: the new placement is another, not the lost
    one, and takes the continuation once its runner is ready (was: the failover took the
    new placement for the lost one and gave up once it left the unavailable list)."""
    placed = FailingOverCluster().state
    (routed,) = placed.instances.values()
    cluster = FailingOverCluster(routed=routed)
    cluster.state = _re_placed(RunnerLoading(layers_loaded=1, total_layers=30))
    events = _continue_on_the_re_placed_instance(cluster, [(0.6, _re_placed(RunnerReady()))])
    check_continued(cluster)
    assert chat_text(events) == ANSWER


def test_a_stream_that_sees_its_node_lost_before_the_master_waits_for_the_re_placement() -> None:
    """This node's links say a node of the stream's instance is gone while the state does
    not yet (the master marks it within seconds): the failover waits for the instance
    placed again instead of ending the stream at once (was: "no healthy instance")."""
    cluster = FailingOverCluster(known_route=True)
    (routed,) = cluster.state.instances.values()
    cluster.routed = routed
    cluster.node_gone = True
    marked = cluster.state.model_copy(
        update={"unavailable_instances": {routed.instance_id: InstanceUnavailable(reason="x")}}
    )
    events = _continue_on_the_re_placed_instance(
        cluster,
        [(0.3, marked), (0.5, _re_placed(RunnerLoading(layers_loaded=1, total_layers=30))),
         (0.7, _re_placed(RunnerReady()))],
    )  # fmt: skip
    check_continued(cluster)
    assert chat_text(events) == ANSWER


def test_a_loss_whose_instance_is_coming_up_waits_past_the_short_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lost instance placed again is still loading when the short deadline passes
    (its node fetching the files, or restarted): the failover waits on, up to the loading
    deadline, and the stream continues once it serves (was: the error at the short
    deadline although the cluster was about to serve again)."""
    monkeypatch.setattr(failover, "FAILOVER_DEADLINE_SECONDS", 0.3)
    placed = FailingOverCluster().state
    (routed,) = placed.instances.values()
    cluster = FailingOverCluster(routed=routed)
    loading = _re_placed(RunnerLoading(layers_loaded=1, total_layers=30))
    cluster.state_at_loss = loading.model_copy(
        update={"unavailable_instances": {routed.instance_id: InstanceUnavailable(reason="x")}}
    )
    ready = _re_placed(RunnerReady())

    def serve_again() -> None:  # placed again at the loss, serving well after the deadline
        assert cluster.lost.wait(DEADLINE_SECONDS)
        time.sleep(1.2)
        cluster.state = ready

    for base_url in node(cluster):
        helper = threading.Thread(target=serve_again, daemon=True)
        helper.start()
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
        helper.join(timeout=DEADLINE_SECONDS)
    check_continued(cluster)
    assert chat_text(events) == ANSWER


def test_a_loss_with_nothing_coming_up_keeps_the_short_deadline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The lost instance waits for room no node set has: nothing is coming up, so the short
    deadline ends the stream with the error even though the loading deadline is far."""
    monkeypatch.setattr(failover, "FAILOVER_DEADLINE_SECONDS", 0.3)
    cluster = FailingOverCluster(known_route=True)
    (routed,) = cluster.state.instances.values()
    cluster.routed = routed
    waiting = InstanceUnavailable(reason="x; waiting for room", waiting_for_room=True)
    cluster.state = cluster.state.model_copy(
        update={"unavailable_instances": {routed.instance_id: waiting}}
    )
    for base_url in node(cluster):
        started = time.monotonic()
        events = sse_events(
            base_url,
            "/v1/chat/completions",
            {"model": SMOLLM2, "messages": MESSAGES, "stream": True},
        )
        assert time.monotonic() - started < failover.FAILOVER_LOADING_DEADLINE_SECONDS / 2
    assert events[-1]["error"]["message"] == LOST
    assert len(cluster.submitted) == 1
