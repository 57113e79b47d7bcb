"""The runner's steps before it serves: joining the ranks' process group, loading the
engine, warming it up; and the speculative-decoding counts its statuses carry.

Each step is a function of the shard, the runner's options and the engine that returns the
status the runner reports next (`RunnerFailed`, worded by `failures.load_failure`, where it
failed), so the runner (`runner.py`) only sets statuses and keeps the serving loop: what a
step of the batch does with its requests. Runs inside the runner's subprocess; torch and
the engine are imported on first use (the supervisor's process imports this package too).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from loguru import logger

from exo.shared.types.common import InstanceId, RunnerId
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerFailed,
    RunnerLoading,
    RunnerReady,
    SpeculationStats,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import ConnectToGroup
from exo.utils.heap import freeze_long_lived_objects
from exo.worker.runner.card_check import check_card
from exo.worker.runner.draft_serving import remote_draft_of
from exo.worker.runner.failures import load_failure
from exo.worker.runner.options import RunnerOptions

if TYPE_CHECKING:
    from exo.worker.engines.torch.engine_factory import Engine

# Bounds every collective: a rank that vanished without closing its sockets (a machine
# that lost power) fails the others after this long instead of hanging them.
GROUP_TIMEOUT_SECONDS = 60.0


def join_group(
    task: ConnectToGroup, shard: ShardMetadata, options: RunnerOptions, runner_id: RunnerId
) -> RunnerConnected | RunnerFailed:
    """Join the instance's process group as this shard's rank (authenticated with the
    options' rank-group key when set). Returns the status to report."""
    from exo.worker.engines.torch.comm.group_auth import GroupCredentials
    from exo.worker.engines.torch.comm.process_group import init_group

    key = options.rank_group_key
    try:
        init_group(
            task.backend,
            shard.device_rank,
            shard.world_size,
            task.master_addr,
            task.master_port,
            timeout_s=GROUP_TIMEOUT_SECONDS,
            link_addresses=task.link_addresses,
            credentials=(
                None if key is None else GroupCredentials(bytes.fromhex(key), task.instance_id)
            ),
        )
    except Exception as error:
        logger.opt(exception=error).error(f"runner {runner_id}: joining the group failed")
        return RunnerFailed(error_message=f"joining the process group failed: {error}")
    return RunnerConnected()


def load_engine(
    model_dir: Path,
    shard: ShardMetadata,
    options: RunnerOptions,
    instance_id: InstanceId,
    runner_id: RunnerId,
    on_status: Callable[[RunnerLoading], None],
) -> tuple[Engine, tuple[str, ...]] | RunnerFailed:
    """Load this shard's engine from `model_dir`, reporting each layer loaded through
    `on_status`.

    Returns:
        The engine and what the model's files contradict in its card (`check_card`), or
        the failed status (permanent where the model itself is at fault).
    """
    from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS
    from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
    from exo.worker.engines.torch.engine import DEFAULT_MAX_CONCURRENT_REQUESTS
    from exo.worker.engines.torch.engine_factory import load_serving_engine

    on_status(RunnerLoading(layers_loaded=0, total_layers=shard.model_card.n_layers))

    def on_layer_loaded(loaded: int, total: int) -> None:
        on_status(RunnerLoading(layers_loaded=loaded, total_layers=total))

    remote_draft = remote_draft_of(options, instance_id)
    try:
        engine = load_serving_engine(
            model_dir, shard, on_layer_loaded=on_layer_loaded,
            max_concurrent_requests=(
                options.max_concurrent_requests or DEFAULT_MAX_CONCURRENT_REQUESTS
            ),
            prefill_activations=options.prefill_activations,
            decode_activations=options.decode_activations,
            kv_cache_tokens=options.kv_cache_tokens or DEFAULT_KV_CACHE_TOKENS,
            kv_cache_dtype=options.kv_cache_dtype,
            speculation=SpeculationSettings(
                options.speculative, options.draft_min, options.draft_max
            ),
            # A draft on a spare node answers over the links; else rank 0 loads it.
            draft_model=None if remote_draft is not None else options.draft_model,
            remote_draft=remote_draft,
        )  # fmt: skip
    except Exception as error:
        logger.opt(exception=error).error(f"runner {runner_id}: loading failed")
        return load_failure("loading", error)
    return engine, check_card(shard.model_card, model_dir, engine.tokenizer)


def warm_up(
    engine: Engine, runner_id: RunnerId, card_mismatches: tuple[str, ...]
) -> RunnerReady | RunnerFailed:
    """Warm the engine up (its first forward passes), then freeze the long-lived objects
    (the model: no full garbage collection walks it mid-decode).

    Returns:
        The ready status, with the engine's capacity, weights (bytes), draft model and
        `card_mismatches`; or the failed status.
    """
    started = time.perf_counter()
    try:
        engine.warmup()
    except Exception as error:
        logger.opt(exception=error).error(f"runner {runner_id}: warm-up failed")
        return load_failure("warm-up", error)
    logger.info(f"runner {runner_id}: warmed up in {time.perf_counter() - started:.1f}s")
    freeze_long_lived_objects()
    draft_source = getattr(engine, "draft_source", None)  # an encoder has none
    return RunnerReady(
        weight_bytes=engine.weight_bytes(),
        max_concurrent_requests=engine.max_concurrent_requests,
        kv_cache_tokens=engine.kv_cache_tokens,
        card_mismatches=card_mismatches,
        draft_model=None if draft_source is None else draft_source.name,
        draft_left_out=getattr(engine, "draft_left_out", None),
    )


def speculation_stats(engine: Engine | None) -> SpeculationStats | None:
    """The engine's speculative-decoding counts (None where it does not speculate)."""
    counters = getattr(engine, "speculation_counters", None)
    measured = counters() if counters is not None else None
    if measured is None:
        return None
    counts, auto_enabled = measured
    return SpeculationStats(
        decode_rounds=counts.decode_rounds,
        decode_tokens=counts.decode_tokens,
        verify_rounds=counts.verify_rounds,
        drafted_tokens=counts.drafted_tokens,
        accepted_tokens=counts.accepted_tokens,
        acceptance_rate=counts.acceptance_rate,
        tokens_per_step=counts.tokens_per_step,
        auto_enabled=auto_enabled,
        draft_connected=getattr(engine, "draft_connected", None),
    )
