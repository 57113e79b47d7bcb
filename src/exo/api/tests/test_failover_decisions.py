"""The mid-stream failover's pure parts (`exo.api.serving.failover`), without a server:
which instance may continue a stream, which deadline is in force while one is coming up,
and how `StreamProgress` adjusts a continued stream's chunks (the server-side behaviour is
`test_mid_stream_failover.py`)."""

from __future__ import annotations

from typing import Any

from exo.api.serving.failover import (
    StreamProgress,
    failover_deadline,
    healthy_instance_exists,
    instance_coming_up,
    instance_may_come,
)
from exo.shared.types.chunks import PrefillProgressChunk, TokenChunk, Usage
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.runners import RunnerFailed, RunnerLoading, RunnerReady
from exo.shared.types.state import InstanceUnavailable
from exo.testing.builders import SMOLLM2, make_instance, make_state


def test_a_healthy_instance_is_ready_on_live_nodes_and_not_the_lost_placement() -> None:
    first = make_instance(NodeId("node-a"), instance_id="instance-1")
    second = make_instance(NodeId("node-b"), instance_id="instance-2")
    ready = {
        runner_id: (node_id, RunnerReady())
        for instance in (first, second)
        for node_id, runner_id in instance.shard_assignments.node_to_runner.items()
    }
    both = make_state(instances=[first, second], runners=ready)
    assert healthy_instance_exists(both, SMOLLM2, lost=first)
    assert healthy_instance_exists(both, SMOLLM2, lost=None)
    alone = make_state(instances=[first], runners=ready)
    # Its runner died and it keeps its placement: nothing else can come.
    assert not healthy_instance_exists(alone, SMOLLM2, lost=first)
    assert not instance_may_come(alone, SMOLLM2, lost=first)
    # Its node gone by this node's links, not yet marked by the master: it will come.
    assert instance_may_come(alone, SMOLLM2, lost=first, node_lost=True)
    # Unavailable (its node left), it will be placed again: worth waiting for.
    recovering = alone.model_copy(
        update={"unavailable_instances": {first.instance_id: InstanceUnavailable(reason="x")}}
    )
    assert instance_may_come(recovering, SMOLLM2, lost=first)
    # Placed again on another node (new runners): healthy once they are ready.
    moved = make_instance(NodeId("node-c"), instance_id="instance-1", runner_tag="again")
    (moved_runner,) = moved.shard_assignments.runner_to_shard
    on_c = NodeId("node-c")
    loading_status = RunnerLoading(layers_loaded=1, total_layers=30)
    loading = make_state(instances=[moved], runners={moved_runner: (on_c, loading_status)})
    assert not healthy_instance_exists(loading, SMOLLM2, lost=first)
    served = make_state(instances=[moved], runners={moved_runner: (on_c, RunnerReady())})
    assert healthy_instance_exists(served, SMOLLM2, lost=first)
    # A node of the other instance is lost: not healthy.
    lost_node = both.model_copy(update={"lost_nodes": (NodeId("node-b"),)})
    assert not healthy_instance_exists(lost_node, SMOLLM2, lost=first)


def test_the_loading_deadline_holds_while_an_instance_is_coming_up() -> None:
    first = make_instance(NodeId("node-a"), instance_id="instance-1")
    moved = make_instance(NodeId("node-c"), instance_id="instance-1", runner_tag="again")
    (moved_runner,) = moved.shard_assignments.runner_to_shard
    on_c = NodeId("node-c")
    recovering = {first.instance_id: InstanceUnavailable(reason="node node-a left; re-placed")}

    def deadline_of(state: Any) -> float:
        return failover_deadline(state, SMOLLM2, first, deadline=30.0, loading_deadline=120.0)

    # Placed again, its node fetching the files (no runner status yet) or loading.
    fetching = make_state(instances=[moved]).model_copy(
        update={"unavailable_instances": recovering}
    )
    assert instance_coming_up(fetching, SMOLLM2, lost=first) and deadline_of(fetching) == 120.0
    loading_status = RunnerLoading(layers_loaded=1, total_layers=30)
    loading = make_state(instances=[moved], runners={moved_runner: (on_c, loading_status)})
    assert deadline_of(loading) == 120.0
    # Its runner failed, its node is lost, or it waits for room: nothing is coming.
    failed_status = RunnerFailed(error_message="boom")
    failed = make_state(instances=[moved], runners={moved_runner: (on_c, failed_status)})
    assert deadline_of(failed) == 30.0
    assert deadline_of(loading.model_copy(update={"lost_nodes": (on_c,)})) == 30.0
    waiting = InstanceUnavailable(reason="x", waiting_for_room=True)
    unplaced = loading.model_copy(update={"unavailable_instances": {moved.instance_id: waiting}})
    assert deadline_of(unplaced) == 30.0
    # The lost placement itself (its runner died, placement unchanged) never counts.
    alone = make_state(instances=[first], runners={})
    assert not instance_coming_up(alone, SMOLLM2, lost=first) and deadline_of(alone) == 30.0


# -- StreamProgress, without a server -------------------------------------------------------


def token(text: str, ids: tuple[int, ...], **fields: Any) -> TokenChunk:
    return TokenChunk(
        command_id=CommandId("c"), model=ModelId("m"), text=text, token_ids=ids, **fields
    )


def test_a_continued_stream_keeps_what_the_client_was_told_when_it_opened() -> None:
    progress = StreamProgress()
    first = token("a", (1,), prompt_tokens=9, cached_tokens=4)
    assert progress.adapt(first) is first  # nothing changes before a failover
    progress.given(first)
    progress.given(token("b", (2, 3)))
    assert progress.token_ids == [1, 2, 3]
    progress.continued = True
    admitted = PrefillProgressChunk(
        command_id=CommandId("d"), model=ModelId("m"), prompt_tokens=9, cached_tokens=0,
        prefilled_tokens=0,
    )  # fmt: skip
    assert progress.adapt(admitted) is None
    again = progress.adapt(token("c", (4,), prompt_tokens=9, cached_tokens=0))
    assert isinstance(again, TokenChunk)
    assert again.prompt_tokens is None and again.cached_tokens is None and again.text == "c"
    final = progress.adapt(
        token("", (), finish_reason="stop", usage=Usage(prompt_tokens=9, completion_tokens=4))
    )
    assert isinstance(final, TokenChunk) and final.usage is not None
    assert final.usage == Usage(prompt_tokens=9, completion_tokens=4, cached_tokens=4)


def test_a_stream_lost_before_it_opened_keeps_its_first_report() -> None:
    progress = StreamProgress()
    progress.given(
        PrefillProgressChunk(
            command_id=CommandId("c"),
            model=ModelId("m"),
            prompt_tokens=9,
            cached_tokens=0,
            prefilled_tokens=3,
        )
    )
    progress.continued = True
    assert progress.token_ids == [] and not progress.opened
    first = token("a", (1,), prompt_tokens=9, cached_tokens=2)
    assert progress.adapt(first) == first  # the client still needs the prompt's size
