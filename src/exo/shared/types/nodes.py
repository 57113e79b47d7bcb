"""What a node reports about itself."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.models.weight_formats import DEFAULT_PREFILL_ACTIVATIONS, PrefillActivations
from exo.shared.types.common import FrozenModel, NodeId
from exo.shared.types.downloads import DownloadProgress


class MemoryInfo(FrozenModel):
    """Bytes of RAM; `available_bytes` is what a new model may use."""

    total_bytes: int = Field(ge=0)
    available_bytes: int = Field(ge=0)


class GpuInfo(FrozenModel):
    name: str
    total_memory_bytes: int = Field(ge=0)


class NetworkInterface(FrozenModel):
    name: str
    addresses: tuple[str, ...]


class NodeSpeed(FrozenModel):
    """What this node's CPU does per second, measured at start by `exo.node.speed_probe`
    with the torch thread count its runners use (`threads`, within its CPU affinity).

    Attributes:
        int4_decode_bytes_per_second: packed int4 weight bytes (with their bfloat16 scales
            and zeros) the engine's decode kernel (`aten._weight_int4pack_mm_for_cpu`, one
            row) reads per second.
        int8_decode_bytes_per_second: the same for the int8 kernel (`aten._weight_int8pack_mm`,
            the LM head).
        memory_copy_bytes_per_second: bytes read plus bytes written per second by a plain
            copy of a buffer larger than the last-level cache (KV cache, float32 reads).
        bf16_matmul_flops: FLOP/s of a bfloat16 matmul at a prefill shape.
        float32_matmul_flops: FLOP/s of a float32 matmul at a prefill shape.
        layer_overhead_seconds: fixed cost of one decoder layer's decode ops at a tiny width
            (dispatch, casts, norms, rotary, attention; bytes negligible), seconds.
        loopback_round_trip_seconds: a small message's round trip over TCP on 127.0.0.1
            between two threads, seconds (links between nodes on one machine).
        native_kernels: exo's own CPU kernels run the engine's linears here
            (`worker/engines/torch/quant/native_kernels.py`), so GGUF blocks are held in their
            smaller forms (`exo.shared.models.memory.gguf_weight_bytes`).
        int5_decode_bytes_per_second, int8_block_decode_bytes_per_second: where they run,
            the bytes per second exo's 5-bit block kernel (GGUF Q5_0) and int8 block
            kernel (Q8_0 / Q5_1 / Q6_K) read, one row, as `int4_decode_bytes_per_second`
            (None elsewhere, and from older nodes).
        int4_prefill_int16_flops, int4_prefill_int8_flops: where exo's kernels run, FLOP/s
            (2 per multiply-add) of prefill's integer GEMM (`block_matmul`, native/
            prefill.cpp) of float32 rows times int4 block weights, the rows rounded to
            int16 or to int8 per block of 32 (`--prefill-activations`); None elsewhere,
            and from older nodes.
        int5_prefill_int16_flops, int5_prefill_int8_flops: the same for 5-bit block
            weights (GGUF Q5_0).
        int8_block_prefill_int16_flops, int8_block_prefill_int8_flops: the same for int8
            blocks of 16 with values in [-32, 31] (GGUF Q6_K).
        int4_prefill_bf16_flops, int5_prefill_bf16_flops, int8_block_prefill_bf16_flops:
            the same with `--prefill-activations bf16` (native/prefill_bf16.cpp), where it
            runs (CPUs with AMX-BF16); None elsewhere and from older nodes.
    """

    threads: int = Field(ge=1)
    int4_decode_bytes_per_second: float = Field(gt=0)
    int8_decode_bytes_per_second: float = Field(gt=0)
    memory_copy_bytes_per_second: float = Field(gt=0)
    bf16_matmul_flops: float = Field(gt=0)
    float32_matmul_flops: float = Field(gt=0)
    layer_overhead_seconds: float = Field(ge=0)
    loopback_round_trip_seconds: float = Field(ge=0)
    native_kernels: bool = False
    int5_decode_bytes_per_second: float | None = Field(default=None, gt=0)
    int8_block_decode_bytes_per_second: float | None = Field(default=None, gt=0)
    int4_prefill_int16_flops: float | None = Field(default=None, gt=0)
    int4_prefill_int8_flops: float | None = Field(default=None, gt=0)
    int5_prefill_int16_flops: float | None = Field(default=None, gt=0)
    int5_prefill_int8_flops: float | None = Field(default=None, gt=0)
    int8_block_prefill_int16_flops: float | None = Field(default=None, gt=0)
    int8_block_prefill_int8_flops: float | None = Field(default=None, gt=0)
    int4_prefill_bf16_flops: float | None = Field(default=None, gt=0)
    int5_prefill_bf16_flops: float | None = Field(default=None, gt=0)
    int8_block_prefill_bf16_flops: float | None = Field(default=None, gt=0)


class NodeInfo(FrozenModel):
    """A node's resources. `api_addresses` are the addresses its API listens on (what
    peers probe); `models_disk_free_bytes` (of `models_disk_total_bytes`) is free space
    where models are stored; `cpu_percent` how busy all its cores were over the last
    gather interval, 0-100 (reported when it moves by `CPU_CHANGE_REPORT_PERCENT`, at
    most every `LOAD_REPORT_SECONDS`: `exo.node.info_gatherer`); `offline`: started with
    `--offline`, it can prepare only files it already holds; `speed`: its measured
    decode and prefill rates (None until measured, and from nodes too old to measure);
    `prefill_activations`: how its runners round prefill's activations
    (`--prefill-activations`), which of its prefill GEMM figures a TTFT prediction reads
    (nodes too old to say: `DEFAULT_PREFILL_ACTIVATIONS`); `kv_cache_tokens`: the KV-cache
    budget of each of its runners in tokens (`--kv-cache-tokens`), which placement reserves
    memory for on this node; None: placement sizes each runner's budget from the node's
    memory (`exo.master.placement_memory.memory_sized_kv_cache_tokens`); `draft_model`: its
    `--draft-model` (a model name or a directory on the node), which overrides a card's
    draft model for the instances whose rank 0 it runs (`exo.shared.models.drafts`);
    `draft_on_spare`: whether placement may run those instances' draft models on a spare
    node (`--no-draft-on-spare`: False, the draft stays in rank 0's runner)."""

    friendly_name: str
    memory: MemoryInfo
    cpu_model: str = ""
    cpu_cores: int = Field(default=1, ge=1)
    gpus: tuple[GpuInfo, ...] = ()
    models_disk_free_bytes: int = Field(default=0, ge=0)
    models_disk_total_bytes: int = Field(default=0, ge=0)
    cpu_percent: float = Field(default=0.0, ge=0, le=100)
    network_interfaces: tuple[NetworkInterface, ...] = ()
    api_port: int = Field(default=0, ge=0, lt=65536)
    api_addresses: tuple[str, ...] = ()
    offline: bool = False
    speed: NodeSpeed | None = None
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS
    kv_cache_tokens: int | None = Field(default=None, ge=1)
    draft_model: str | None = None
    draft_on_spare: bool = True


class TopologyEdge(FrozenModel):
    """A measured link from `source` to `sink`: `sink`'s API answered on `address`."""

    source: NodeId
    sink: NodeId
    address: str
    latency_ms: float = Field(ge=0)
    bandwidth_mbps: float = Field(ge=0)


class DownloadPending(FrozenModel):
    kind: Literal["DownloadPending"] = "DownloadPending"


class DownloadOngoing(FrozenModel):
    """`progress`: bytes, speed and ETA per file and in total of a Hub or peer transfer
    (None while the node prepares otherwise: a PyPI wheel, a conversion)."""

    kind: Literal["DownloadOngoing"] = "DownloadOngoing"
    message: str = ""
    progress: DownloadProgress | None = None


class DownloadCompleted(FrozenModel):
    kind: Literal["DownloadCompleted"] = "DownloadCompleted"
    path: str


class DownloadFailed(FrozenModel):
    """A node could not prepare the model's files. `permanent`: the files are there but
    cannot become a model the engine loads (a GGUF conversion failed); the node does not
    retry them until a new instance of the model asks, and requests get a server error
    (500), not 503."""

    kind: Literal["DownloadFailed"] = "DownloadFailed"
    error_message: str
    permanent: bool = False


DownloadStatus = Annotated[
    DownloadPending | DownloadOngoing | DownloadCompleted | DownloadFailed,
    Field(discriminator="kind"),
]
