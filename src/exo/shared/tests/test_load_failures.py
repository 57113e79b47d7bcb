"""A model that cannot load, as state: the master's deletion after runner failures says
whether a failure was the model's own (`InstanceDeleted.load_failure`), the state remembers
it per model (bounded) until the model is added or downloaded again or loads, and event
logs written before these fields replay to the same state and the same digests."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest

from exo.master.main import MAX_INSTANCE_FAILURES, failed_instances
from exo.node.event_log import EventLog, encode_record, event_digest
from exo.shared.apply import apply, apply_all
from exo.shared.types.common import ModelId, NodeId, RunnerId
from exo.shared.types.events import (
    CustomModelAdded,
    CustomModelDeleted,
    Event,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    NodeDownloadProgress,
    RunnerStatusUpdated,
)
from exo.shared.types.nodes import DownloadCompleted, DownloadOngoing
from exo.shared.types.runners import RunnerFailed, RunnerReady, RunnerStatus
from exo.shared.types.state import MAX_LOAD_FAILURES, LoadFailure, State
from exo.testing.builders import SMOLLM2, indexed, make_card, make_instance

NODES = [NodeId("n0"), NodeId("n1")]
PAIR = make_instance(NODES, instance_id="pair")
RANK0, RANK1 = RunnerId("pair-rank0"), RunnerId("pair-rank1")
SHAPE = "loading failed: tensor lm_head.weight has shape (64, 63), this rank's model expects"
FAILURE = LoadFailure(reason=SHAPE, failed_at=1_800_000_000.0)


def then(state: State, *events: Event) -> State:
    for event in events:
        state = apply(state, IndexedEvent(idx=state.last_event_applied_idx + 1, event=event))
    return state


def report(runner_id: RunnerId, status: RunnerStatus) -> RunnerStatusUpdated:
    return RunnerStatusUpdated(runner_id=runner_id, node_id=NODES[0], status=status)


def placed() -> State:
    return apply_all(State(), indexed([InstanceCreated(instance=PAIR)]))


@pytest.mark.parametrize("permanent_rank", [RANK0, RANK1])
def test_the_deletion_names_a_rank_s_own_load_failure(permanent_rank: RunnerId) -> None:
    """Rank 0 warms up and fails for good; the other rank, whose peer left, fails in a way
    that may pass: whichever failure reaches the limit, the instance's is the model's own."""
    other = RANK1 if permanent_rank == RANK0 else RANK0
    state = then(
        placed(), report(permanent_rank, RunnerFailed(error_message=SHAPE, permanent=True))
    )
    for _ in range(MAX_INSTANCE_FAILURES - 1):
        state = then(state, report(other, RunnerFailed(error_message="process group failed")))
    [deleted] = failed_instances(state, 1_800_000_000.0)
    assert deleted == InstanceDeleted(instance_id=PAIR.instance_id, load_failure=FAILURE)
    state = then(state, deleted)
    assert state.load_failures == {SMOLLM2: FAILURE} and state.instances == {}


def test_failures_that_may_pass_delete_without_a_load_failure() -> None:
    state = placed()
    for _ in range(MAX_INSTANCE_FAILURES):
        state = then(state, report(RANK0, RunnerFailed(error_message="loading failed: OOM")))
    [deleted] = failed_instances(state, 1_800_000_000.0)
    assert deleted == InstanceDeleted(instance_id=PAIR.instance_id)
    assert then(state, deleted).load_failures == {}


def failed() -> State:
    return then(placed(), InstanceDeleted(instance_id=PAIR.instance_id, load_failure=FAILURE))


@pytest.mark.parametrize(
    "event",
    [
        CustomModelAdded(card=make_card()),
        CustomModelDeleted(model_id=SMOLLM2),
        NodeDownloadProgress(
            node_id=NODES[1], model_id=SMOLLM2, status=DownloadCompleted(path="/m")
        ),
    ],
    ids=["added again", "deleted", "downloaded"],
)
def test_the_failure_is_forgotten_when_the_model_changes(event: Event) -> None:
    assert then(failed(), event).load_failures == {}


def test_the_failure_is_kept_through_other_events_and_forgotten_once_the_model_loads() -> None:
    progress = NodeDownloadProgress(
        node_id=NODES[0], model_id=SMOLLM2, status=DownloadOngoing(message="preparing")
    )
    again = make_instance(NODES, instance_id="again")
    state = then(failed(), progress, InstanceCreated(instance=again))
    state = then(state, report(RunnerId("again-rank0"), RunnerReady()))
    assert state.load_failures == {SMOLLM2: FAILURE}  # one rank ready is not the instance
    state = then(state, report(RunnerId("again-rank1"), RunnerReady()))
    assert state.load_failures == {}


def test_the_state_keeps_the_newest_failures_only() -> None:
    state = State()
    for number in range(MAX_LOAD_FAILURES + 3):
        card = make_card(model_id=ModelId(f"org/model-{number}"))
        instance = make_instance(NODES[0], card=card, instance_id=f"i{number}")
        failure = LoadFailure(reason=SHAPE, failed_at=float(number))
        state = then(
            state,
            InstanceCreated(instance=instance),
            InstanceDeleted(instance_id=instance.instance_id, load_failure=failure),
        )
    assert len(state.load_failures) == MAX_LOAD_FAILURES
    assert next(iter(state.load_failures)) == ModelId("org/model-3")


# Events as the versions before `load_failure` and `permanent` wrote them (field order and
# all): `event_digest` of the parsed event must be the digest of these bytes, or a node
# that replays its old log would take its history for another than the master's.
OLD_EVENTS = [
    f'{{"kind":"InstanceCreated","instance":{PAIR.model_dump_json()},"command_id":null}}',
    '{"kind":"RunnerStatusUpdated","runner_id":"pair-rank0","node_id":"n0",'
    '"status":{"kind":"RunnerFailed","error_message":"warm-up failed: boom"}}',
    '{"kind":"InstanceDeleted","instance_id":"pair","command_id":null}',
]


def old_record(idx: int, event: str) -> bytes:
    """A log line of an older version: checksum, then the indexed event's JSON."""
    body = f'{{"idx":{idx},"event":{event},"origin":null,"origin_session":null,"origin_idx":null}}'
    return f"{zlib.crc32(body.encode()):08x} {body}\n".encode()


def test_an_old_log_replays_with_the_same_bytes_and_digests(tmp_path: Path) -> None:
    path = tmp_path / "event_log.jsonl"
    written = b"".join(old_record(idx, event) for idx, event in enumerate(OLD_EVENTS))
    path.write_bytes(written)
    log = EventLog(path)
    state = log.load()
    assert state.instances == {} and state.load_failures == {}
    assert state.last_event_applied_idx == len(OLD_EVENTS) - 1
    assert path.read_bytes() == written  # kept byte for byte
    for event in log.events_from(0, len(OLD_EVENTS)):  # as a master replays to a follower
        assert encode_record(event) == old_record(event.idx, OLD_EVENTS[event.idx])
        assert log.digest_at(event.idx) == event_digest(event)
    deleted = log.events_from(2, 1)[0].event
    assert isinstance(deleted, InstanceDeleted) and deleted.load_failure is None


def test_a_state_snapshot_without_load_failures_reads_as_none_remembered() -> None:
    older = json.loads(failed().model_dump_json())
    del older["load_failures"]
    assert State.model_validate_json(json.dumps(older)).load_failures == {}
