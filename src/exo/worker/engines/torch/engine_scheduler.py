"""The engine's batch scheduler, built when the first request needs it (`TorchEngine.
scheduler`): a single rank's over its own slot KV cache, sized by the model's KV geometry
and attention windows, with its prefix cache and speculative decoding; a split instance's
rank 0's through its `RankGroup`, speculating where its split verifies a draft's k + 1
positions in one step (`drafts.draft_runs_on`). On a model the tests marked, the steps
sleep as the test seam says (`testing_seam`)."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from exo.shared.models.drafts import draft_runs_on
from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.worker.engines.torch.batching.batch_attention import (
    attention_layers,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.prefix_cache import PrefixCache
from exo.worker.engines.torch.batching.scheduler import BatchScheduler
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.speculation import Speculation
from exo.worker.engines.torch.decoding.speculative_drafts import DraftSource, NgramDraftSource
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.parallel.rank_group import RankGroup
from exo.worker.engines.torch.testing_seam import TestingSeam


def build_scheduler(
    model: PreTrainedModel,
    device: torch.device,
    kv_dtype: torch.dtype,
    max_concurrent_requests: int,
    kv_cache_tokens: int,
    speculation: SpeculationSettings,
    draft_source: DraftSource | None,
    group: RankGroup | None,
    testing_seam: TestingSeam | None,
) -> BatchScheduler:
    """The engine's scheduler (see the module docstring).

    Args:
        model: this rank's model (a single rank's is switched to batched attention).
        kv_dtype: how keys and values are stored.
        max_concurrent_requests: the slots, most requests running at once.
        kv_cache_tokens: the KV budget in tokens, running requests and prefix cache.
        speculation: speculative decoding's settings.
        draft_source: where drafts come from (None: n-gram drafts).
        group: a split instance's rank group (None: a single rank).
        testing_seam: the test seam's step delays (None on every production model).
    """
    scheduler = _new_scheduler(
        model, device, kv_dtype, max_concurrent_requests, kv_cache_tokens, speculation,
        draft_source, group,
    )  # fmt: skip
    if testing_seam is not None:
        scheduler.prefill_chunk_seconds = testing_seam.prefill_chunk_seconds
        scheduler.decode_step_seconds = testing_seam.decode_step_seconds
    return scheduler


def _new_scheduler(
    model: PreTrainedModel,
    device: torch.device,
    kv_dtype: torch.dtype,
    max_concurrent_requests: int,
    kv_cache_tokens: int,
    settings: SpeculationSettings,
    draft_source: DraftSource | None,
    group: RankGroup | None,
) -> BatchScheduler:
    if group is not None:
        # Rank 0 drafts (a draft model, else n-gram) where its split verifies a draft's
        # k + 1 positions in one step (`draft_runs_on`).
        shard = group.shard
        speculation = (
            Speculation(settings, draft_source or NgramDraftSource())
            if draft_runs_on(shard.sharding, shard.world_size)
            else None
        )
        return group.build_scheduler(kv_cache_tokens, max_concurrent_requests, speculation)
    text_config = model.config.get_text_config()
    family = family_for_architecture(type(model).__name__)
    windows = family.attention_windows(text_config)
    geometry = kv_geometry_of_config(text_config, len(windows))
    use_batched_attention(model)
    cache = SlotKVCache(
        geometry.layers, geometry.kv_heads, geometry.head_dim, kv_dtype, device,
        max_concurrent_requests, geometry.latent_values, windows,
    )  # fmt: skip
    return BatchScheduler(
        model, cache, windows, attention_layers(model), kv_cache_tokens,
        PrefixCache(kv_cache_tokens), device,
        speculation=Speculation(settings, draft_source or NgramDraftSource()),
    )  # fmt: skip
