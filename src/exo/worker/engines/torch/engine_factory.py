"""Which engine serves a shard: `TorchEngine` for a whole model on one rank and for a rank
of a split (pipeline or tensor) instance, which composes a `RankGroup`."""

from __future__ import annotations

from pathlib import Path

from exo.shared.models.memory import (
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_PREFILL_ACTIVATIONS,
    KVCacheDtype,
    PrefillActivations,
)
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.engine import DEFAULT_MAX_CONCURRENT_REQUESTS, TorchEngine
from exo.worker.engines.torch.model.loading import LayerProgressCallback
from exo.worker.engines.torch.quant.quantize import WeightDtype


def load_engine(
    model_dir: Path,
    shard: ShardMetadata,
    device: str = "cpu",
    on_layer_loaded: LayerProgressCallback | None = None,
    weight_dtype: WeightDtype | None = None,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
    kv_cache_dtype: KVCacheDtype | None = None,
) -> TorchEngine:
    """Load the engine for `shard` (arguments as `TorchEngine.load`).

    A multi-rank shard needs its process group first (`distributed.init_group`); rank 0
    batches up to `max_concurrent_requests` requests across the group.

    Raises:
        RuntimeError: a multi-rank shard without a matching process group.
        ValueError / UnsupportedArchitectureError: as `TorchEngine.load`.
    """
    return TorchEngine.load(
        model_dir, shard, device, on_layer_loaded, weight_dtype, max_concurrent_requests,
        kv_cache_tokens=kv_cache_tokens, prefill_activations=prefill_activations,
        kv_cache_dtype=kv_cache_dtype,
    )  # fmt: skip
