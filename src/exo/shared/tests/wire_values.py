"""Named values of the wire types (ids, a card, task params, instances, a full state...) that
the samples in `wire_samples.py` are built from and the round-trip tests check by name."""

import hashlib

from exo.shared.models.weight_formats import DEFAULT_PREFILL_ACTIVATIONS, PREFILL_ACTIVATIONS
from exo.shared.types.chunks import (
    TokenChunk,
    TopLogprob,
    Usage,
)
from exo.shared.types.common import (
    CommandId,
    InstanceId,
    ModelId,
    NodeId,
    RunnerId,
    TaskId,
)
from exo.shared.types.downloads import DownloadProgress, FileProgress
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.instances import (
    DraftRunner,
    InstanceDraft,
)
from exo.shared.types.nodes import (
    DownloadCompleted,
    NodeSpeed,
    TopologyEdge,
)
from exo.shared.types.runners import (
    RunnerReady,
    SpeculationStats,
)
from exo.shared.types.state import (
    CommandOutcome,
    InstanceUnavailable,
    InstanceUsage,
    LoadFailure,
)
from exo.shared.types.tasks import (
    Embedding,
    TaskRunning,
)
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
    ToolDefinition,
)
from exo.testing.builders import (
    SMOLLM2,
    make_card,
    make_instance,
    make_node_info,
    make_state,
    make_text_generation_task,
)

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
