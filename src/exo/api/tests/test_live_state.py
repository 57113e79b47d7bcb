"""The dashboard's live state: the JSON Patch diff (checked against the `jsonpatch`
library's RFC 6902 implementation) and the message stream built on it."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import anyio
import jsonpatch
import pytest

from exo.api.serving.live_state import StateChanges, json_patch, server_sent_event, state_stream
from exo.shared.types.common import NodeId
from exo.shared.types.state import State
from exo.testing.builders import make_node_info, make_state

JsonValue = Any


def apply_patch(document: JsonValue, patch: list[dict[str, Any]]) -> JsonValue:
    """RFC 6902 as the `jsonpatch` library implements it (on a copy)."""
    return jsonpatch.apply_patch(copy.deepcopy(document), patch)


def same_json(left: JsonValue, right: JsonValue) -> bool:
    """Equal as JSON texts (so 1 and 1.0 and True differ, as they do in JSON)."""
    return json.dumps(left, sort_keys=True) == json.dumps(right, sort_keys=True)


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({}, {}),
        ({"a": 1}, {"a": 2}),
        ({"a": 1}, {"b": 1}),
        ({"a": {"b": [1, 2, 3]}}, {"a": {"b": [1, 3]}}),
        ({"a": [1]}, {"a": [1, 2, 3, 4]}),
        ({"a": [{"x": 1}, {"x": 2}]}, {"a": [{"x": 1, "y": 0}]}),
        ({"a": 1}, {"a": 1.0}),
        ({"a": 1}, {"a": True}),
        ({"a": 0}, {"a": False}),
        ({"a": None}, {"a": {}}),
        ({"a": {}}, {"a": []}),
        ({"a": "x"}, {"a": ["x"]}),
        ([1, 2], {"a": 1}),
        (1, "one"),
        # Model ids hold "/" and keys may hold "~": RFC 6901 escapes both.
        ({"m": {"org/name": 1, "a~b": 2}}, {"m": {"org/name": 3, "a~b": 4, "c/~d": 5}}),
        ({"": 1}, {"": 2}),
    ],
)
def test_the_patch_turns_old_into_new(old: JsonValue, new: JsonValue) -> None:
    patch = json_patch(old, new)
    assert same_json(apply_patch(old, patch), new)
    assert {operation["op"] for operation in patch} <= {"add", "remove", "replace"}
    if same_json(old, new):
        assert patch == []


def test_keys_with_slashes_and_tildes_are_escaped() -> None:
    patch = json_patch({"m": {}}, {"m": {"org/name~1": 1}})
    assert patch == [{"op": "add", "path": "/m/org~1name~01", "value": 1}]


def test_an_unchanged_subtree_costs_no_operation() -> None:
    big = {str(i): {"value": i, "items": list(range(20))} for i in range(50)}
    changed = copy.deepcopy(big)
    changed["7"]["value"] = -1
    assert json_patch(big, changed) == [{"op": "replace", "path": "/7/value", "value": -1}]


def _random_json(rng: random.Random, depth: int = 0) -> JsonValue:
    kind = rng.randrange(8 if depth < 4 else 5)
    match kind:
        case 0:
            return rng.randrange(-3, 4)
        case 1:
            return rng.choice([0.5, 1.0, -2.25])
        case 2:
            return rng.choice([True, False, None])
        case 3 | 4:
            return rng.choice(["", "a", "b/c", "~0", "héllo"])
        case 5 | 6:
            keys = rng.sample(["a", "b", "c/d", "e~f", "", "g"], rng.randrange(0, 5))
            return {key: _random_json(rng, depth + 1) for key in keys}
        case _:
            return [_random_json(rng, depth + 1) for _ in range(rng.randrange(0, 5))]


def _mutate(rng: random.Random, value: JsonValue, depth: int = 0) -> JsonValue:
    if rng.random() < 0.2 or depth > 4:
        return _random_json(rng, depth)
    if isinstance(value, dict):
        result = dict(value)
        for key in list(result):
            roll = rng.random()
            if roll < 0.2:
                del result[key]
            elif roll < 0.6:
                result[key] = _mutate(rng, result[key], depth + 1)
        if rng.random() < 0.3:
            result[rng.choice(["a", "x/y", "z~"])] = _random_json(rng, depth + 1)
        return result
    if isinstance(value, list):
        result_list = [
            _mutate(rng, item, depth + 1) if rng.random() < 0.4 else item for item in value
        ]
        if result_list and rng.random() < 0.3:
            del result_list[rng.randrange(len(result_list))]
        if rng.random() < 0.3:
            result_list.append(_random_json(rng, depth + 1))
        return result_list
    return _random_json(rng, depth)


def test_random_documents_round_trip_through_the_patch() -> None:
    rng = random.Random(15)  # fixed seed: the same 2,000 pairs every run
    for _ in range(2000):
        old = _random_json(rng)
        new = _mutate(rng, old)
        patch = json_patch(old, new)
        assert same_json(apply_patch(old, patch), new), (old, new, patch)


def test_a_server_sent_event_is_one_data_line() -> None:
    message = server_sent_event("patch", {"text": "two\nlines"})
    assert message == 'event: patch\ndata: {"text":"two\\nlines"}\n\n'


class ChangingState:
    """A state that tests replace, with the wake-up a `ClusterClient` gives."""

    def __init__(self, state: State) -> None:
        self.state = state
        self.changed = anyio.Event()

    def set(self, state: State) -> None:
        self.state = state
        self.changed.set()
        self.changed = anyio.Event()

    def changes(self) -> StateChanges:
        return StateChanges(lambda: self.state, lambda: self.changed.wait())


def parse_message(text: str) -> tuple[str, Any]:
    """(event name, data) of one message; ("comment", text) for a comment line."""
    if text.startswith(":"):
        return "comment", text.strip()
    if text.startswith("retry:"):
        return "retry", int(text.split(":", 1)[1])
    event_line, data_line = text.strip().split("\n")
    assert event_line.startswith("event: ") and data_line.startswith("data: ")
    return event_line.removeprefix("event: "), json.loads(data_line.removeprefix("data: "))


def state_with_memory(available_mb: int, index: int) -> State:
    return make_state(
        nodes={NodeId("a"): make_node_info(available_mb)}, last_event_applied_idx=index
    )


@pytest.mark.anyio
async def test_a_snapshot_then_one_patch_per_change() -> None:
    source = ChangingState(state_with_memory(1000, 0))
    stream = state_stream(source.changes(), patch_interval_seconds=0.01)
    with anyio.fail_after(10):
        assert parse_message(await anext(stream)) == ("retry", 2000)
        name, snapshot = parse_message(await anext(stream))
        assert name == "snapshot"
        assert snapshot == {"index": 0, "state": source.state.model_dump(mode="json")}
        held = snapshot["state"]
        for index, memory in enumerate((900, 800, 700), start=1):
            source.set(state_with_memory(memory, index))
            name, data = parse_message(await anext(stream))
            assert name == "patch" and data["index"] == index
            held = apply_patch(held, data["patch"])
            assert held == source.state.model_dump(mode="json")
    await stream.aclose()


@pytest.mark.anyio
async def test_changes_made_while_the_client_is_busy_come_as_one_patch() -> None:
    """Nothing queues behind a consumer that does not ask: 200 changes, one message."""
    source = ChangingState(state_with_memory(1000, 0))
    stream = state_stream(source.changes(), patch_interval_seconds=0.01)
    with anyio.fail_after(10):
        await anext(stream)
        _, snapshot = parse_message(await anext(stream))
        for index in range(1, 201):
            source.set(state_with_memory(1000 - index, index))
        name, data = parse_message(await anext(stream))
        assert name == "patch" and data["index"] == 200
        final = apply_patch(snapshot["state"], data["patch"])
        assert final == source.state.model_dump(mode="json")
        # The next message waits for the next change.
        with anyio.move_on_after(0.3) as waiting:
            await anext(stream)
        assert waiting.cancelled_caught
    await stream.aclose()


@pytest.mark.anyio
async def test_a_burst_is_coalesced_within_the_interval() -> None:
    source = ChangingState(state_with_memory(1000, 0))
    stream = state_stream(source.changes(), patch_interval_seconds=0.5)
    with anyio.fail_after(10):
        await anext(stream)
        await anext(stream)
        source.set(state_with_memory(999, 1))
        assert parse_message(await anext(stream))[1]["index"] == 1  # the first at once

        async def burst() -> None:
            for index in range(2, 12):
                await anyio.sleep(0.01)
                source.set(state_with_memory(1000 - index, index))

        async with anyio.create_task_group() as task_group:
            task_group.start_soon(burst)
            started = anyio.current_time()
            name, data = parse_message(await anext(stream))
        # Held back until the interval since the last patch was up, then all in one.
        assert anyio.current_time() - started >= 0.3
        assert name == "patch" and data["index"] == 11
    await stream.aclose()


@pytest.mark.anyio
async def test_keepalive_comments_while_nothing_changes() -> None:
    source = ChangingState(state_with_memory(1000, 0))
    stream = state_stream(source.changes(), keepalive_seconds=0.05)
    with anyio.fail_after(10):
        await anext(stream)
        await anext(stream)
        assert parse_message(await anext(stream)) == ("comment", ": keepalive")
        assert parse_message(await anext(stream)) == ("comment", ": keepalive")
    await stream.aclose()


@pytest.mark.anyio
async def test_a_patch_larger_than_the_state_is_sent_as_a_snapshot() -> None:
    nodes = {NodeId(f"node-{i}"): make_node_info(1000 + i) for i in range(30)}
    source = ChangingState(make_state(nodes=nodes, last_event_applied_idx=0))
    stream = state_stream(source.changes(), patch_interval_seconds=0.01)
    with anyio.fail_after(10):
        await anext(stream)
        await anext(stream)
        # Every node replaced by one of another name: removing and adding each costs more
        # than the new state itself.
        renamed = {NodeId(f"other-{i}"): make_node_info(1000 + i) for i in range(30)}
        source.set(make_state(nodes=renamed, last_event_applied_idx=1))
        name, data = parse_message(await anext(stream))
        assert name == "snapshot"
        assert data == {"index": 1, "state": source.state.model_dump(mode="json")}
        # And patches continue from that snapshot.
        source.set(make_state(nodes={**renamed, NodeId("n"): make_node_info(5)}))
        name, data = parse_message(await anext(stream))
        assert name == "patch"
        assert [operation["path"] for operation in data["patch"]] == [
            "/node_info/n",
            "/last_event_applied_idx",
        ]
    await stream.aclose()
