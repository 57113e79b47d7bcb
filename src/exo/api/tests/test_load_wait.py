"""`load_wait`: when the API node saw instances become ready, and how long a request that
found none ready waited for one (Ollama's `load_duration`), on built states."""

from exo.api.serving.load_wait import LoadWait, ReadyTimes, model_ready
from exo.shared.apply import apply_event
from exo.shared.types.common import InstanceId, NodeId
from exo.shared.types.events import InstanceReplaced, RunnerStatusUpdated
from exo.shared.types.runners import RunnerLoading, RunnerReady
from exo.shared.types.state import State
from exo.testing.builders import SMOLLM2, make_card, make_instance, make_node_info, make_state

NODE = NodeId("node-a")
SECOND = 1_000_000_000


def with_status(state: State, instance_id: str, status: RunnerReady | RunnerLoading) -> State:
    instance = state.instances[InstanceId(instance_id)]
    for runner_id in instance.shard_assignments.runner_to_shard:
        state = apply_event(
            state, RunnerStatusUpdated(runner_id=runner_id, node_id=NODE, status=status)
        )
    return state


def loading_state() -> State:
    state = make_state(nodes={NODE: make_node_info(4096)}, instances=[make_instance(NODE)])
    return with_status(state, "instance-1", RunnerLoading(layers_loaded=0, total_layers=30))


def test_a_request_that_finds_its_model_ready_waited_for_no_load() -> None:
    times = ReadyTimes()
    state = with_status(loading_state(), "instance-1", RunnerReady())
    times.observe(state, 1 * SECOND)
    assert model_ready(state, SMOLLM2)
    wait = LoadWait(SMOLLM2, 2 * SECOND, None if model_ready(state, SMOLLM2) else times)
    assert wait.duration_ns(3 * SECOND) == 0


def test_the_wait_ends_when_an_instance_of_the_model_is_seen_ready() -> None:
    times = ReadyTimes()
    state = loading_state()
    times.observe(state, 1 * SECOND)
    assert not model_ready(state, SMOLLM2) and not model_ready(state, None)
    wait = LoadWait(SMOLLM2, 2 * SECOND, times)
    # Not seen ready yet: the first chunk bounds the wait.
    assert wait.duration_ns(4 * SECOND) == 2 * SECOND
    state = with_status(state, "instance-1", RunnerReady())
    times.observe(state, 5 * SECOND)
    times.observe(state, 6 * SECOND)  # still ready: the time it became so stays
    assert wait.duration_ns(7 * SECOND) == 3 * SECOND
    # The ready event may arrive after the first token: the wait ends at that token.
    assert wait.duration_ns(4 * SECOND) == 2 * SECOND
    # Another model's readiness ends nothing.
    other = LoadWait(make_card(model_id="test/other").model_id, 2 * SECOND, times)
    assert other.duration_ns(9 * SECOND) == 7 * SECOND


def test_an_instance_placed_again_is_ready_anew() -> None:
    times = ReadyTimes()
    state = with_status(loading_state(), "instance-1", RunnerReady())
    times.observe(state, 1 * SECOND)
    moved = make_instance(NODE, instance_id="instance-1", runner_tag="r9")
    state = apply_event(state, InstanceReplaced(instance=moved, reason="node b left; re-placed"))
    times.observe(state, 2 * SECOND)
    wait = LoadWait(SMOLLM2, 3 * SECOND, None if model_ready(state, SMOLLM2) else times)
    state = with_status(state, "instance-1", RunnerReady())
    times.observe(state, 8 * SECOND)
    assert wait.duration_ns(10 * SECOND) == 5 * SECOND
