"""Every wire type survives JSON: same class, same values, same id types."""

import base64
import json
from typing import Any, get_args

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from exo.shared.tests.wire_samples import (
    ALL_SAMPLES,
    SAMPLES,
    UNIONS,
    WIRE_MODULES,
)
from exo.shared.tests.wire_values import (
    COMMAND,
    FULL_STATE,
    IMAGE,
    IMAGE_BYTES,
    IMAGE_MESSAGE,
    INSTANCE_ID,
    NODE,
    PARAMS,
    RUNNER,
    TASK,
    TENSOR,
    USAGE,
)
from exo.shared.types.chunks import (
    Usage,
)
from exo.shared.types.commands import (
    ForwarderCommand,
    GenerateText,
)
from exo.shared.types.common import (
    CommandId,
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
    truncate_for_repr,
)
from exo.shared.types.events import (
    Event,
    IndexedEvent,
    InstanceCreated,
    TaskStatusUpdated,
)
from exo.shared.types.state import (
    State,
)
from exo.shared.types.tasks import (
    Shutdown,
    TaskComplete,
)
from exo.shared.types.text_generation import (
    ChatMessage,
)
from exo.testing.builders import (
    make_params,
)
from exo.worker.runner.messages import (
    RunnerInbound,
    RunnerOutbound,
    runner_inbound_adapter,
    runner_outbound_adapter,
)


def union_members(union: Any) -> tuple[type[BaseModel], ...]:
    """The classes of an `Annotated[A | B | ..., Field(discriminator=...)]` union."""
    members: tuple[type[BaseModel], ...] = get_args(get_args(union)[0])
    return members


def wire_classes() -> set[type[BaseModel]]:
    """Every public FrozenModel subclass defined in the wire-type modules."""
    found: set[type[BaseModel]] = set()
    pending: list[type[BaseModel]] = [FrozenModel]
    while pending:
        cls = pending.pop()
        for sub in cls.__subclasses__():
            pending.append(sub)
            defined_in_wire_module = any(sub.__module__ == m.__name__ for m in WIRE_MODULES)
            if defined_in_wire_module and not sub.__name__.startswith("_"):
                found.add(sub)
    return found


def sample_id(sample: BaseModel) -> str:
    return type(sample).__name__


def test_every_wire_class_has_a_sample() -> None:
    missing = {cls.__name__ for cls in wire_classes()} - {cls.__name__ for cls in SAMPLES}
    assert missing == set()
    for cls, samples in SAMPLES.items():
        assert samples, cls
        assert all(type(sample) is cls for sample in samples), cls


@pytest.mark.parametrize("name", UNIONS)
def test_every_union_member_has_a_sample(name: str) -> None:
    members = union_members(UNIONS[name])
    assert len(members) >= 2
    assert [m.__name__ for m in members if m not in SAMPLES] == []


@pytest.mark.parametrize("sample", ALL_SAMPLES, ids=sample_id)
def test_model_round_trips_through_json(sample: BaseModel) -> None:
    restored = type(sample).model_validate_json(sample.model_dump_json())
    assert type(restored) is type(sample)
    assert restored == sample
    assert restored.model_dump_json() == sample.model_dump_json()


@pytest.mark.parametrize("name", UNIONS)
def test_union_round_trips_every_member_as_its_own_class(name: str) -> None:
    adapter: TypeAdapter[Any] = TypeAdapter(UNIONS[name])
    for member in union_members(UNIONS[name]):
        for sample in SAMPLES[member]:
            restored = adapter.validate_json(adapter.dump_json(sample))
            assert type(restored) is member
            assert restored == sample


def test_runner_adapters_keep_the_member_class() -> None:
    adapters: list[tuple[TypeAdapter[Any], Any]] = [
        (runner_inbound_adapter, RunnerInbound),
        (runner_outbound_adapter, RunnerOutbound),
    ]
    for adapter, union in adapters:
        for member in union_members(union):
            for sample in SAMPLES[member]:
                assert type(adapter.validate_json(adapter.dump_json(sample))) is member


def test_fieldless_members_keep_their_tag_inside_events() -> None:
    # TaskComplete is terminal and TaskRunning is not: confusing them loses or keeps a task.
    event = TaskStatusUpdated(task_id=TASK, status=TaskComplete())
    restored = IndexedEvent.model_validate_json(IndexedEvent(idx=4, event=event).model_dump_json())
    assert isinstance(restored.event, TaskStatusUpdated)
    assert type(restored.event.status) is TaskComplete
    tensor = InstanceCreated.model_validate_json(InstanceCreated(instance=TENSOR).model_dump_json())
    assert tensor.instance.sharding == "tensor"


def test_ids_come_back_as_their_own_class() -> None:
    restored = State.model_validate_json(FULL_STATE.model_dump_json())
    assert {type(key) for key in restored.instances} == {InstanceId}
    assert {type(key) for key in restored.tasks} == {TaskId}
    assert {type(key) for key in restored.runners} == {RunnerId}
    assert {type(value) for value in restored.runner_nodes.values()} == {NodeId}
    assert {type(key) for key in restored.node_info} == {NodeId}
    assert {type(key) for key in restored.downloads[NODE]} == {ModelId}
    assert {type(key) for key in restored.topology[NODE]} == {NodeId}
    assignments = restored.instances[INSTANCE_ID].shard_assignments
    assert type(assignments.model_id) is ModelId
    assert {type(key) for key in assignments.runner_to_shard} == {RunnerId}
    assert {type(key) for key in assignments.node_to_runner} == {NodeId}
    task = restored.tasks[TASK]
    assert (type(task.command_id), type(task.origin_node_id)) == (CommandId, NodeId)
    assert type(task.params.model) is ModelId
    forwarded = ForwarderCommand.model_validate_json(SAMPLES[ForwarderCommand][0].model_dump_json())
    assert type(forwarded.origin) is NodeId


def test_ids_serialize_as_plain_strings() -> None:
    assert json.loads(Shutdown(runner_id=RUNNER).model_dump_json()) == {
        "kind": "Shutdown",
        "runner_id": "instance-1-rank0",
    }
    assert repr(NodeId("node-a")) == "NodeId('node-a')"
    assert NodeId.new() != NodeId.new()


def test_empty_id_is_rejected() -> None:
    with pytest.raises(ValidationError):
        Shutdown.model_validate_json('{"kind": "Shutdown", "runner_id": ""}')


@pytest.mark.parametrize("sample", ALL_SAMPLES, ids=sample_id)
def test_unknown_fields_are_rejected(sample: BaseModel) -> None:
    data = json.loads(sample.model_dump_json())
    data["unexpected_field"] = 1
    with pytest.raises(ValidationError, match="unexpected_field"):
        type(sample).model_validate_json(json.dumps(data))


def test_unknown_fields_are_rejected_inside_unions() -> None:
    adapter: TypeAdapter[Any] = TypeAdapter(Event)
    with pytest.raises(ValidationError, match="extra"):
        adapter.validate_json('{"kind": "RunnerDeleted", "runner_id": "r", "extra": true}')
    with pytest.raises(ValidationError):
        adapter.validate_json('{"kind": "RunnerExploded", "runner_id": "r"}')


def test_models_are_frozen_and_strict() -> None:
    with pytest.raises(ValidationError):
        USAGE.prompt_tokens = 5  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Usage.model_validate({"prompt_tokens": "10", "completion_tokens": 1})


def test_repr_truncates_a_long_prompt() -> None:
    prompt = "Tell me a story about a lighthouse keeper. " * 500
    message = ChatMessage(role="user", content=prompt)
    text = repr(message)
    assert len(text) < len(prompt)
    assert prompt[:80] in text
    assert f"…(+{len(prompt) - 80} chars)" in text
    nested = repr(GenerateText(command_id=COMMAND, params=make_params(prompt)))
    assert len(nested) < len(prompt)
    assert prompt[:80] in nested


def test_an_image_travels_as_base64_and_logs_as_its_size() -> None:
    text = GenerateText(command_id=COMMAND, params=PARAMS).model_dump_json()
    assert base64.urlsafe_b64encode(IMAGE_BYTES).decode() in text
    restored = GenerateText.model_validate_json(text)
    assert restored.params.messages[-1].images[0].data == IMAGE_BYTES
    assert f"data='<{len(IMAGE_BYTES)} bytes>'" in repr(IMAGE)
    assert "\\x00" not in repr(IMAGE_MESSAGE)


def test_repr_keeps_short_strings_whole() -> None:
    assert truncate_for_repr("short") == "short"
    assert truncate_for_repr("x" * 80) == "x" * 80
    assert truncate_for_repr("x" * 81) == "x" * 80 + "…(+1 chars)"
    assert "content='hi'" in repr(ChatMessage(role="user", content="hi"))
