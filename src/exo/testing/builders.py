"""Small builders of wire types for pure-function tests.

Every builder starts from the built-in SmolLM2 card and plain defaults, so a test spells
out only the values it checks.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from exo.master.placement import runner_id_for
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS
from exo.shared.parallelism import parallelism
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.events import Event, IndexedEvent
from exo.shared.types.instances import Instance, Rendezvous, ShardAssignments, Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadStatus, MemoryInfo, NodeInfo, NodeSpeed
from exo.shared.types.runners import RunnerStatus
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskPending, TaskStatus, TextGeneration
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

SMOLLM2 = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
MIB = 2**20


@functools.cache
def smollm2_card() -> ModelCard:
    return load_builtin_cards()[SMOLLM2]


def make_card(
    n_layers: int | None = None,
    storage_size_bytes: int | None = None,
    model_id: str | None = None,
    supports_tensor: bool | None = None,
) -> ModelCard:
    """The SmolLM2 card with the given fields replaced (validated again)."""
    update: dict[str, Any] = {}
    if n_layers is not None:
        update["n_layers"] = n_layers
    if storage_size_bytes is not None:
        update["storage_size_bytes"] = storage_size_bytes
    if model_id is not None:
        update["model_id"] = ModelId(model_id)
    if supports_tensor is not None:
        update["supports_tensor"] = supports_tensor
    # model_copy does not validate; a JSON round trip does.
    return ModelCard.model_validate_json(smollm2_card().model_copy(update=update).model_dump_json())


def make_node_speed(threads: int = 1) -> NodeSpeed:
    """Measured-looking figures of a small CPU node (the range the speed probe measures on
    the 2-core reference machine): 10 GB/s int4 decode, 100 GFLOP/s bfloat16 matmuls."""
    return NodeSpeed(
        threads=threads,
        int4_decode_bytes_per_second=1e10,
        int8_decode_bytes_per_second=8e9,
        memory_copy_bytes_per_second=2e10,
        bf16_matmul_flops=1e11,
        float32_matmul_flops=5e10,
        layer_overhead_seconds=1e-4,
        loopback_round_trip_seconds=5e-5,
    )


def make_node_info(
    available_mb: int,
    total_mb: int | None = None,
    name: str = "node",
    kv_cache_tokens: int | None = DEFAULT_KV_CACHE_TOKENS,
) -> NodeInfo:
    """A node reporting `available_mb` MiB of available memory, started with
    `--kv-cache-tokens kv_cache_tokens` (the default budget: placement arithmetic in tests
    stays independent of memory-sized budgets; None: sized from its memory, as a node
    started without the option)."""
    total = available_mb if total_mb is None else total_mb
    return NodeInfo(
        friendly_name=name,
        memory=MemoryInfo(total_bytes=total * MIB, available_bytes=available_mb * MIB),
        kv_cache_tokens=kv_cache_tokens,
    )


def make_shard(
    card: ModelCard | None = None,
    sharding: Sharding = "pipeline",
    device_rank: int = 0,
    world_size: int = 1,
) -> ShardMetadata:
    """One rank's shard; pipeline ranks get equal layer ranges (the last takes the rest)."""
    card = card or smollm2_card()
    per_rank = card.n_layers // world_size

    def equal_counts() -> list[int]:
        return [per_rank] * (world_size - 1) + [card.n_layers - per_rank * (world_size - 1)]

    ranges = parallelism(sharding).layer_ranges(card.n_layers, world_size, equal_counts)
    start, end = ranges[device_rank]
    return ShardMetadata(
        model_card=card,
        sharding=sharding,
        device_rank=device_rank,
        world_size=world_size,
        start_layer=start,
        end_layer=end,
    )


def make_instance(
    node_ids: NodeId | Sequence[NodeId],
    card: ModelCard | None = None,
    sharding: Sharding = "pipeline",
    instance_id: str = "instance-1",
    runner_tag: str = "",
) -> Instance:
    """An instance with one runner per node, `runner_id_for(instance_id, rank, runner_tag)`
    (`f"{instance_id}-rank{rank}"` untagged), rank = position."""
    nodes = [node_ids] if isinstance(node_ids, str) else list(node_ids)
    card = card or smollm2_card()
    runners = [
        runner_id_for(InstanceId(instance_id), rank, runner_tag) for rank in range(len(nodes))
    ]
    assignments = ShardAssignments(
        model_id=card.model_id,
        runner_to_shard={
            runner_id: make_shard(card, sharding, rank, len(nodes))
            for rank, runner_id in enumerate(runners)
        },
        node_to_runner=dict(zip(nodes, runners, strict=True)),
    )
    rendezvous = None
    if len(nodes) > 1:
        # Every node reaches rank 0 at a distinct made-up address, to tell them apart.
        rendezvous = Rendezvous(
            backend="gloo",
            port=41000,
            addresses={node: f"10.0.0.{i + 1}" for i, node in enumerate(nodes)},
        )
    return Instance(
        instance_id=InstanceId(instance_id),
        sharding=sharding,
        shard_assignments=assignments,
        rendezvous=rendezvous,
    )


def make_params(
    prompt: str = "Hello", model: ModelId = SMOLLM2, max_tokens: int | None = None
) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=model,
        messages=(ChatMessage(role="user", content=prompt),),
        max_tokens=max_tokens,
    )


def make_text_generation_task(
    instance_id: str = "instance-1",
    task_id: str = "task-1",
    command_id: str | None = None,
    origin_node_id: str = "node-a",
    status: TaskStatus | None = None,
    params: TextGenerationTaskParams | None = None,
) -> TextGeneration:
    """A pending generation task; `command_id` defaults to `f"command-{task_id}"`."""
    return TextGeneration(
        task_id=TaskId(task_id),
        command_id=CommandId(command_id or f"command-{task_id}"),
        instance_id=InstanceId(instance_id),
        origin_node_id=NodeId(origin_node_id),
        params=params or make_params(),
        status=status or TaskPending(),
    )


def make_state(
    nodes: Mapping[NodeId, NodeInfo] | None = None,
    instances: Iterable[Instance] = (),
    tasks: Iterable[TextGeneration] = (),
    runners: Mapping[RunnerId, tuple[NodeId, RunnerStatus]] | None = None,
    downloads: Mapping[NodeId, Mapping[ModelId, DownloadStatus]] | None = None,
    last_event_applied_idx: int = -1,
) -> State:
    """A state holding exactly the given things; tasks keep their iteration order."""
    runners = runners or {}
    return State(
        instances={instance.instance_id: instance for instance in instances},
        runners={runner_id: status for runner_id, (_, status) in runners.items()},
        runner_nodes={runner_id: node_id for runner_id, (node_id, _) in runners.items()},
        tasks={task.task_id: task for task in tasks},
        node_info=dict(nodes or {}),
        downloads={node_id: dict(models) for node_id, models in (downloads or {}).items()},
        last_event_applied_idx=last_event_applied_idx,
    )


def indexed(events: Iterable[Event], start: int = 0) -> list[IndexedEvent]:
    """`events` numbered `start, start + 1, ...`."""
    return [IndexedEvent(idx=start + i, event=event) for i, event in enumerate(events)]
