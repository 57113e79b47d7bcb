"""Which engine serves a shard: `TorchEngine` for a whole model on one rank and for a rank
of a split (pipeline or tensor) instance, which composes a `RankGroup`; `EncoderEngine` for
an encoder card (`exo.shared.models.architectures.ENCODER_ARCHITECTURES`: embedding and
reranking only). The runner loads through `load_serving_engine`, which picks."""

from __future__ import annotations

from pathlib import Path

from exo.download.pypi_wheels import ModelPreparationError
from exo.shared.constants import models_dir
from exo.shared.models.architectures import is_encoder_architecture
from exo.shared.models.drafts import draft_runs_on
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS, KVCacheDtype
from exo.shared.models.weight_formats import (
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_PREFILL_ACTIVATIONS,
    DecodeActivations,
    PrefillActivations,
)
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
from exo.worker.engines.torch.draft_model import draft_left_out, draft_model_directory
from exo.worker.engines.torch.encoder_engine import EncoderEngine
from exo.worker.engines.torch.engine import DEFAULT_MAX_CONCURRENT_REQUESTS, TorchEngine
from exo.worker.engines.torch.model.loading import LayerProgressCallback
from exo.worker.engines.torch.quant.quantize import WeightDtype
from exo.worker.engines.torch.remote_drafts import RemoteDraft

Engine = TorchEngine | EncoderEngine
"""What a runner drives: generation and pooled embeddings (`TorchEngine`), or an encoder's
embeddings and rerank scores alone (`EncoderEngine`)."""


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
    decode_activations: DecodeActivations = DEFAULT_DECODE_ACTIVATIONS,
    speculation: SpeculationSettings | None = None,
    draft_model: Path | None = None,
    remote_draft: RemoteDraft | None = None,
    draft_model_id: str | None = None,
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
        kv_cache_dtype=kv_cache_dtype, decode_activations=decode_activations,
        speculation=speculation, draft_model=draft_model, remote_draft=remote_draft,
        draft_model_id=draft_model_id,
    )  # fmt: skip


def load_serving_engine(
    model_dir: Path,
    shard: ShardMetadata,
    on_layer_loaded: LayerProgressCallback | None = None,
    max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
    kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
    kv_cache_dtype: KVCacheDtype | None = None,
    decode_activations: DecodeActivations = DEFAULT_DECODE_ACTIVATIONS,
    speculation: SpeculationSettings | None = None,
    draft_model: str | None = None,
    remote_draft: RemoteDraft | None = None,
) -> Engine:
    """The engine a runner serves `shard` with: `EncoderEngine` for an encoder card (its
    weights are read whole in float32; the KV, weight-format and prefill options do not
    apply), else `load_engine` on the default device, with the draft model `draft_model`
    names (its instance's, `Instance.draft`; `draft_model.draft_model_directory`) where one
    is set. A draft model that is not found (its download failed, an unknown name) or fails
    to load (another vocabulary, a bad config: `TorchEngine.load`) is left out with one
    warning: the model serves without it (`TorchEngine.draft_left_out` says why, its status
    names no draft).
    With `remote_draft` (the instance's draft runs on another node) rank 0 drafts through
    its link instead (`remote_drafts.RemoteDraftSource`) and loads no draft model here.

    Raises:
        ValueError: as `EncoderEngine.load` or `load_engine`.
        RuntimeError: as `load_engine`.
    """
    if is_encoder_architecture(shard.model_card.architecture):
        engine = EncoderEngine.load(model_dir, shard, max_concurrent_requests)
        if on_layer_loaded is not None:
            layers = shard.model_card.n_layers
            on_layer_loaded(layers, layers)
        return engine
    draft_dir = None
    not_found = None
    if (
        draft_model is not None
        and remote_draft is None
        and shard.device_rank == 0
        and draft_runs_on(shard.sharding, shard.world_size)
    ):
        try:
            draft_dir = draft_model_directory(draft_model, models_dir())
        except (ModelPreparationError, ValueError) as error:  # no files here; unknown name
            not_found = draft_left_out(draft_model, shard.model_card.model_id, error)
    loaded = load_engine(
        model_dir, shard, on_layer_loaded=on_layer_loaded,
        max_concurrent_requests=max_concurrent_requests,
        prefill_activations=prefill_activations, kv_cache_tokens=kv_cache_tokens,
        kv_cache_dtype=kv_cache_dtype, decode_activations=decode_activations,
        speculation=speculation,
        draft_model=draft_dir, remote_draft=remote_draft,
        # Named by its model id, as a draft on a spare node is, not by its directory.
        draft_model_id=draft_model if draft_dir is not None else None,
    )  # fmt: skip
    if not_found is not None:
        loaded.draft_left_out = not_found
    return loaded
