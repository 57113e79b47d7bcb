"""Samples of the wire messages (tasks, commands, events, election messages, runner IPC),
keyed by class: the half of `wire_samples.SAMPLES` that travels between components."""

from pydantic import BaseModel

from exo.node.election import ElectionMessage
from exo.shared.tests.wire_values import (
    CARD,
    COMMAND,
    EDGE,
    EMBED_PARAMS,
    EMBEDDING_TASK,
    FULL_STATE,
    GENERATION,
    INSTANCE_ID,
    LOAD_FAILURE,
    NODE,
    PARAMS,
    PIPELINE,
    RERANK_PARAMS,
    RUNNER,
    TASK,
    TENSOR,
    TOKEN_CHUNK,
)
from exo.shared.types.chunks import (
    EmbeddingChunk,
)
from exo.shared.types.commands import (
    AddCustomModel,
    CancelGeneration,
    ComputeEmbeddings,
    ControlDownload,
    DeleteCustomModel,
    DeleteInstance,
    ForwarderCommand,
    GenerateText,
    KeepAlive,
    PlaceInstance,
    RequestEventReplay,
    SetKeepAlive,
)
from exo.shared.types.common import (
    CommandId,
    ModelId,
    NodeId,
)
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    ForwarderEvent,
    IndexedEvent,
    InstanceCreated,
    InstanceDeleted,
    InstanceReplaced,
    InstanceReported,
    InstanceUnplaced,
    InstanceUsed,
    NodeDownloadProgress,
    NodeGatheredInfo,
    NodeLost,
    NodeRejoined,
    NodeTimedOut,
    RunnerDeleted,
    RunnerStatusUpdated,
    StateSnapshot,
    TaskCreated,
    TaskStatusUpdated,
    TopologyEdgeMeasured,
    TopologyEdgeRemoved,
)
from exo.shared.types.nodes import (
    DownloadPending,
)
from exo.shared.types.runners import (
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerWarmingUp,
)
from exo.shared.types.state import (
    CommandOutcome,
    InstanceUnavailable,
    InstanceUsage,
    LoadFailure,
    State,
)
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    CreateRunner,
    DownloadModel,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    TaskCancelled,
    TaskComplete,
    TaskFailed,
    TaskPending,
    TaskRunning,
    TextGeneration,
)
from exo.testing.builders import (
    SMOLLM2,
    make_node_info,
    make_shard,
)
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerStatusReport,
    TaskStatusReport,
)

# Members with no fields next to members with the same fields (TaskComplete/TaskRunning)
# check that the union tag, not the field set, picks the class.
MESSAGE_SAMPLES: dict[type[BaseModel], list[BaseModel]] = {
    # tasks
    TaskPending: [TaskPending()],
    TaskRunning: [TaskRunning()],
    TaskComplete: [TaskComplete()],
    TaskFailed: [TaskFailed(error_message="oom")],
    TaskCancelled: [TaskCancelled()],
    CreateRunner: [CreateRunner(instance_id=INSTANCE_ID, runner_id=RUNNER)],
    DownloadModel: [DownloadModel(instance_id=INSTANCE_ID, shard=make_shard(CARD))],
    LoadModel: [LoadModel(instance_id=INSTANCE_ID, runner_id=RUNNER, model_dir="/models/x")],
    ConnectToGroup: [
        ConnectToGroup(
            instance_id=INSTANCE_ID,
            runner_id=RUNNER,
            backend="nccl",
            master_addr="10.0.0.1",
            master_port=41000,
        ),
        ConnectToGroup(
            instance_id=INSTANCE_ID,
            runner_id=RUNNER,
            backend="gloo",
            master_addr="10.0.0.1",
            master_port=41000,
            link_addresses={1: "192.168.7.2", 2: "192.168.7.3"},
        ),
    ],
    StartWarmup: [StartWarmup(instance_id=INSTANCE_ID, runner_id=RUNNER)],
    TextGeneration: [GENERATION],
    Embedding: [EMBEDDING_TASK, EMBEDDING_TASK.model_copy(update={"params": RERANK_PARAMS})],
    EmbeddingTaskParams: [EMBED_PARAMS, RERANK_PARAMS],
    ComputeEmbeddings: [
        ComputeEmbeddings(command_id=COMMAND, params=EMBED_PARAMS),
        ComputeEmbeddings(
            command_id=COMMAND,
            params=RERANK_PARAMS,
            keep_alive=KeepAlive(seconds=5.0),
            instance_id=INSTANCE_ID,
        ),
    ],
    EmbeddingChunk: [
        EmbeddingChunk(command_id=COMMAND, model=SMOLLM2, vectors=((0.6, 0.8),), prompt_tokens=3),
        EmbeddingChunk(command_id=COMMAND, model=SMOLLM2, scores=(0.25, 0.75), prompt_tokens=9),
    ],
    CancelTask: [CancelTask(runner_id=RUNNER, task_id=TASK)],
    Shutdown: [Shutdown(runner_id=RUNNER)],
    # commands
    PlaceInstance: [
        PlaceInstance(command_id=COMMAND, model_id=SMOLLM2),
        PlaceInstance(
            command_id=COMMAND,
            model_id=SMOLLM2,
            sharding="tensor",
            min_nodes=2,
            node_ids=(NODE, NodeId("node-b")),
            only_if_cluster_empty=True,
            on_request=True,
            keep_alive=KeepAlive(seconds=30.0),
        ),
    ],
    DeleteInstance: [DeleteInstance(command_id=COMMAND, instance_id=INSTANCE_ID)],
    GenerateText: [
        GenerateText(command_id=COMMAND, params=PARAMS),
        GenerateText(command_id=COMMAND, params=PARAMS, keep_alive=KeepAlive(seconds=0.0)),
    ],
    KeepAlive: [KeepAlive(seconds=300.0), KeepAlive(seconds=None)],
    SetKeepAlive: [
        SetKeepAlive(command_id=COMMAND, model_id=SMOLLM2, keep_alive=KeepAlive(seconds=None))
    ],
    CancelGeneration: [CancelGeneration(command_id=COMMAND, target_command_id=CommandId("c-0"))],
    RequestEventReplay: [RequestEventReplay(command_id=COMMAND, from_idx=17)],
    AddCustomModel: [AddCustomModel(command_id=COMMAND, card=CARD)],
    ControlDownload: [
        ControlDownload(command_id=COMMAND, node_id=NODE, card=CARD, action=action)
        for action in ("start", "cancel", "delete")
    ],
    DeleteCustomModel: [DeleteCustomModel(command_id=COMMAND, model_id=ModelId("org/tiny"))],
    ForwarderCommand: [
        ForwarderCommand(
            origin=NODE, command=CancelGeneration(command_id=COMMAND, target_command_id=COMMAND)
        )
    ],
    # events
    InstanceCreated: [InstanceCreated(instance=TENSOR, command_id=COMMAND)],
    InstanceDeleted: [
        InstanceDeleted(instance_id=INSTANCE_ID),
        InstanceDeleted(instance_id=INSTANCE_ID, load_failure=LOAD_FAILURE),
    ],
    InstanceUsed: [
        InstanceUsed(instance_id=INSTANCE_ID, used_at=1.5, keep_alive_seconds=None),
        InstanceUsed(
            instance_id=INSTANCE_ID, used_at=1.5, keep_alive_seconds=0.0, command_id=COMMAND
        ),
    ],
    InstanceUsage: [InstanceUsage(last_used_at=2.0, keep_alive_seconds=60.0)],
    LoadFailure: [LOAD_FAILURE],
    CommandOutcome: [
        CommandOutcome(
            event_idx=7, kind="CommandRejected", origin=NODE, reason="no room", status_code=503
        )
    ],
    TaskCreated: [TaskCreated(task=GENERATION)],
    TaskStatusUpdated: [
        TaskStatusUpdated(task_id=TASK, status=TaskComplete()),
        TaskStatusUpdated(task_id=TASK, status=TaskRunning()),
    ],
    RunnerStatusUpdated: [
        RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE, status=RunnerLoaded()),
        RunnerStatusUpdated(runner_id=RUNNER, node_id=NODE, status=RunnerWarmingUp()),
    ],
    RunnerDeleted: [RunnerDeleted(runner_id=RUNNER)],
    NodeGatheredInfo: [NodeGatheredInfo(node_id=NODE, info=make_node_info(5))],
    NodeDownloadProgress: [
        NodeDownloadProgress(node_id=NODE, model_id=SMOLLM2, status=DownloadPending())
    ],
    CommandRejected: [
        CommandRejected(command_id=COMMAND, origin=NODE, reason="unknown", status_code=404)
    ],
    ClusterHistoryStarted: [ClusterHistoryStarted(history_id="history-1", master=NODE)],
    NodeTimedOut: [NodeTimedOut(node_id=NODE)],
    NodeLost: [NodeLost(node_id=NODE)],
    NodeRejoined: [NodeRejoined(node_id=NODE)],
    InstanceReplaced: [InstanceReplaced(instance=PIPELINE, reason="node node-b left")],
    InstanceUnplaced: [InstanceUnplaced(instance_id=INSTANCE_ID, reason="no room")],
    StateSnapshot: [StateSnapshot(state=FULL_STATE, last_event_digest="0123456789abcdef")],
    InstanceReported: [
        InstanceReported(
            node_id=NODE,
            instance=PIPELINE,
            runners={RUNNER: RunnerReady()},
            usage=InstanceUsage(last_used_at=1_700_000_000.0, keep_alive_seconds=None),
        )
    ],
    InstanceUnavailable: [InstanceUnavailable(reason="node node-b left")],
    TopologyEdgeMeasured: [TopologyEdgeMeasured(edge=EDGE)],
    TopologyEdgeRemoved: [TopologyEdgeRemoved(source=NODE, sink=NodeId("node-b"))],
    CustomModelAdded: [CustomModelAdded(card=CARD, command_id=COMMAND)],
    DownloadControlled: [
        DownloadControlled(node_id=NODE, card=CARD, action="delete", command_id=COMMAND)
    ],
    CustomModelDeleted: [CustomModelDeleted(model_id=ModelId("org/tiny"))],
    ForwarderEvent: [
        ForwarderEvent(
            origin=NODE,
            origin_session="session-1",
            origin_idx=3,
            event=RunnerDeleted(runner_id=RUNNER),
        )
    ],
    IndexedEvent: [
        IndexedEvent(idx=0, event=TaskCreated(task=GENERATION)),
        IndexedEvent(
            idx=5,
            event=NodeTimedOut(node_id=NODE),
            origin=NODE,
            origin_session="session-1",
            origin_idx=2,
        ),
        IndexedEvent(idx=6, event=NodeTimedOut(node_id=NODE), published_by=NODE),
    ],
    # election
    ElectionMessage: [
        ElectionMessage(node_id=NODE, clock=0, seniority=0, last_event_idx=-1),
        ElectionMessage(
            node_id=NODE,
            clock=7,
            seniority=3,
            force_master=True,
            last_event_idx=41,
            history_id="history-1",
            master=NodeId("node-b"),
        ),
    ],
    State: [State(), FULL_STATE],
    # runner IPC
    RunnerStatusReport: [RunnerStatusReport(status=RunnerLoading(layers_loaded=0, total_layers=1))],
    TaskStatusReport: [TaskStatusReport(task_id=TASK, status=TaskCancelled())],
    ChunkReport: [ChunkReport(chunk=TOKEN_CHUNK)],
    KVCacheReport: [
        KVCacheReport(running_tokens=120, prefix_cache_tokens=1500, budget_tokens=8192)
    ],
}
