"""The answer to a command, rebuilt from a snapshot of the state.

An API waits for the event that carries out its command (`ClusterClient.submit`). A node
that fell behind further than the master's log reaches takes the master's snapshot in
place of the events (`StateSnapshot`), so an answer inside the snapshot never arrives as
an event. The state keeps a short record of each recent command's answer
(`State.command_outcomes`); with the command the API sent, it rebuilds the event.
"""

from __future__ import annotations

from exo.shared.types.commands import (
    AddCustomModel,
    Command,
    ComputeEmbeddings,
    ControlDownload,
    DeleteCustomModel,
    GenerateText,
    SetKeepAlive,
)
from exo.shared.types.common import NodeId
from exo.shared.types.events import (
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
    InstanceCreated,
    InstanceDeleted,
    InstanceUsed,
    TaskCreated,
)
from exo.shared.types.state import CommandOutcome, State
from exo.shared.types.tasks import Embedding, TaskComplete, TextGeneration


def answer_from_state(
    command: Command, outcome: CommandOutcome, state: State, node_id: NodeId
) -> Event:
    """The event that answered `command` (sent by `node_id`), as `outcome` records it.

    Where the state no longer holds what the answer carried (an instance placed, then
    deleted before this node heard of it), the answer is a `CommandRejected` saying so
    (409).
    """
    command_id = command.command_id

    def gone(what: str) -> CommandRejected:
        return CommandRejected(
            command_id=command_id,
            origin=node_id,
            reason=f"{what} (carried out while this node was catching up)",
            status_code=409,
        )

    match outcome.kind, command:
        case "CommandRejected", _:
            return CommandRejected(
                command_id=command_id,
                origin=outcome.origin or node_id,
                reason=outcome.reason or "rejected",
                status_code=outcome.status_code or 400,
            )
        case "TaskCreated", GenerateText(params=params):
            if outcome.task_id is not None and outcome.task_id in state.tasks:
                return TaskCreated(task=state.tasks[outcome.task_id])
            if outcome.task_id is None or outcome.instance_id is None:
                return gone("the generation's task is unknown")
            # Finished already: the task as created, marked complete.
            return TaskCreated(
                task=TextGeneration(
                    task_id=outcome.task_id,
                    command_id=command_id,
                    instance_id=outcome.instance_id,
                    origin_node_id=node_id,
                    params=params,
                    status=TaskComplete(),
                )
            )
        case "TaskCreated", ComputeEmbeddings(params=embedding_params):
            if outcome.task_id is not None and outcome.task_id in state.tasks:
                return TaskCreated(task=state.tasks[outcome.task_id])
            if outcome.task_id is None or outcome.instance_id is None:
                return gone("the embedding's task is unknown")
            return TaskCreated(
                task=Embedding(
                    task_id=outcome.task_id,
                    command_id=command_id,
                    instance_id=outcome.instance_id,
                    origin_node_id=node_id,
                    params=embedding_params,
                    status=TaskComplete(),
                )
            )
        case "InstanceCreated", _:
            instance = state.instances.get(outcome.instance_id) if outcome.instance_id else None
            if instance is None:
                return gone(f"instance {outcome.instance_id} was placed, then deleted")
            return InstanceCreated(instance=instance, command_id=command_id)
        case "InstanceDeleted", _ if outcome.instance_id is not None:
            return InstanceDeleted(instance_id=outcome.instance_id, command_id=command_id)
        case "InstanceUsed", SetKeepAlive(keep_alive=keep_alive) if outcome.instance_id:
            usage = state.instance_usage.get(outcome.instance_id)
            return InstanceUsed(
                instance_id=outcome.instance_id,
                used_at=usage.last_used_at if usage is not None else 0.0,
                keep_alive_seconds=keep_alive.seconds,
                command_id=command_id,
            )
        case "CustomModelAdded", AddCustomModel(card=card):
            return CustomModelAdded(card=card, command_id=command_id)
        case "CustomModelDeleted", DeleteCustomModel(model_id=model_id):
            return CustomModelDeleted(model_id=model_id, command_id=command_id)
        case "DownloadControlled", ControlDownload(node_id=target, card=card, action=action):
            return DownloadControlled(
                node_id=target, card=card, action=action, command_id=command_id
            )
        case _:
            return gone(f"answered with {outcome.kind}, which does not fit {command.kind}")
