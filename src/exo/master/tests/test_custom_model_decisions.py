"""The master's decisions on custom models: adding, deleting, and placing one."""

from exo.master.decisions import events_for_command
from exo.shared.apply import apply_all
from exo.shared.types.commands import (
    AddCustomModel,
    Command,
    DeleteCustomModel,
    PlaceInstance,
)
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.events import (
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    Event,
    InstanceCreated,
)
from exo.shared.types.models import HuggingFaceSource
from exo.shared.types.state import State
from exo.testing.builders import (
    SMOLLM2,
    indexed,
    make_card,
    make_instance,
    make_node_info,
    make_state,
)

API_NODE = NodeId("api-node")
NODE_A = NodeId("node-a")
CATALOG = {SMOLLM2: make_card()}
CUSTOM = make_card(model_id="someone/tiny-llama").model_copy(
    update={"source": HuggingFaceSource(repo_id="someone/tiny-llama")}
)


def decide(state: State, command: Command) -> list[Event]:
    return events_for_command(
        state, API_NODE, command, CATALOG, new_instance_id=lambda: InstanceId("new-instance")
    )


def with_custom(state: State) -> State:
    event = CustomModelAdded(card=CUSTOM)
    return apply_all(state, indexed([event], start=state.last_event_applied_idx + 1))


def rejection(events: list[Event]) -> tuple[int, str]:
    (event,) = events
    assert isinstance(event, CommandRejected)
    return event.status_code, event.reason


def test_adding_a_custom_model_appends_its_card() -> None:
    command = AddCustomModel(command_id=CommandId("add"), card=CUSTOM)
    assert decide(State(), command) == [
        CustomModelAdded(card=CUSTOM, command_id=command.command_id)
    ]


def test_adding_it_again_replaces_the_card() -> None:
    newer = CUSTOM.model_copy(update={"context_length": 1024})
    events = decide(with_custom(State()), AddCustomModel(command_id=CommandId("add"), card=newer))
    assert events == [CustomModelAdded(card=newer, command_id=CommandId("add"))]


def test_a_catalog_id_in_any_spelling_is_not_added() -> None:
    for model_id in (SMOLLM2, SMOLLM2.lower(), "smollm2:135m"):
        card = make_card(model_id=model_id)
        status, reason = rejection(
            decide(State(), AddCustomModel(command_id=CommandId("add"), card=card))
        )
        assert status == 409
        assert "catalog" in reason


def test_deleting_a_custom_model() -> None:
    command = DeleteCustomModel(command_id=CommandId("delete"), model_id=CUSTOM.model_id)
    assert decide(with_custom(State()), command) == [
        CustomModelDeleted(model_id=CUSTOM.model_id, command_id=command.command_id)
    ]


def test_a_catalog_model_cannot_be_deleted() -> None:
    command = DeleteCustomModel(command_id=CommandId("delete"), model_id=SMOLLM2)
    status, reason = rejection(decide(with_custom(State()), command))
    assert status == 400
    assert "catalog model" in reason


def test_an_unknown_custom_model_is_a_404() -> None:
    command = DeleteCustomModel(command_id=CommandId("delete"), model_id=ModelId("nobody/none"))
    status, reason = rejection(decide(with_custom(State()), command))
    assert status == 404
    assert "nobody/none" in reason


def test_a_placed_custom_model_is_not_deleted() -> None:
    state = make_state(instances=[make_instance(NODE_A, CUSTOM, instance_id="instance-1")])
    command = DeleteCustomModel(command_id=CommandId("delete"), model_id=CUSTOM.model_id)
    status, reason = rejection(decide(with_custom(state), command))
    assert status == 409
    assert "instance-1" in reason
    assert "delete them first" in reason


def test_a_custom_model_is_placed_like_a_catalog_model() -> None:
    state = with_custom(make_state(nodes={NODE_A: make_node_info(4096)}))
    # The bare repository name resolves too, as for catalog models.
    for name in (CUSTOM.model_id, "tiny-llama"):
        command = PlaceInstance(command_id=CommandId("place"), model_id=ModelId(name))
        (event,) = decide(state, command)
        assert isinstance(event, InstanceCreated), event
        assert event.instance.model_id == CUSTOM.model_id


def test_a_deleted_custom_model_is_unknown_to_placement() -> None:
    state = with_custom(make_state(nodes={NODE_A: make_node_info(4096)}))
    deleted = apply_all(
        state,
        indexed(
            [CustomModelDeleted(model_id=CUSTOM.model_id)],
            start=state.last_event_applied_idx + 1,
        ),
    )
    command = PlaceInstance(command_id=CommandId("place"), model_id=CUSTOM.model_id)
    status, _ = rejection(decide(deleted, command))
    assert status == 404


def test_a_custom_model_leaves_the_catalogs_names_to_the_catalog() -> None:
    # A fine-tune's copy under another organisation shares the catalog model's bare name.
    namesake = CUSTOM.model_copy(update={"model_id": ModelId("someone/SmolLM2-135M-Instruct")})
    state = apply_all(
        make_state(nodes={NODE_A: make_node_info(4096)}),
        indexed([CustomModelAdded(card=namesake)]),
    )
    for name, meant in (
        ("SmolLM2-135M-Instruct", SMOLLM2),
        ("smollm2:135m", SMOLLM2),
        ("someone/smollm2-135m-instruct", namesake.model_id),
    ):
        command = PlaceInstance(command_id=CommandId("place"), model_id=ModelId(name))
        (event,) = decide(state, command)
        assert isinstance(event, InstanceCreated), event
        assert event.instance.model_id == meant, name
