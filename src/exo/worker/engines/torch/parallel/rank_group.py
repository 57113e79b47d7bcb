"""One rank's place in a split instance, composed into `TorchEngine` when the shard spans
several ranks (the process group must exist).

Rank 0 runs the engine contract (`submit` / `step` / `cancel`) over the single-rank
`BatchScheduler` (continuous batching, chunked prefill, pre-emption, prefix cache). Its
scheduler's forward pass is the group's: each step, rank 0 tells the other ranks the step
as a `StepHeader` (`rank_steps.py`: the KV operations since the last step, so admissions,
finishes, cancels and pre-emptions free the same slots on every rank and a prefix hit
copies the same cached entry into the same slot on every rank, each rank its own part of
the KV; and the step's batch plan), then every rank runs its part of the same batched
forward. Rank 0's prefix cache (`RecordingPrefixCache`) decides hits and evictions; each
other rank keeps its part of the same entries (`PrefixMirror`), so a hit saves the
prefill on every rank and the cached-token count rank 0 reports is the group's.

Rank 0 keeps every request's state (`RequestState`): seeded generators, penalties, logit
bias, logprobs and constraints live in one place, and the next step's header carries the
chosen tokens, so no extra message is needed for them. A pipeline's last rank may choose
a request's token itself (`pipeline.py`) from what rank 0 puts in the header.

How a step travels (a broadcast to every rank in lockstep, or rank to rank with several
steps in flight) is the shard's parallelism's: `<kind>.py` here, looked up by the shard's
`sharding` (`engine_transform`); the group calls it and never tests the kind.

Ranks > 0 wait for rank 0's next header in `serve_forever` (unbounded while rank 0 is idle;
every other wait is bounded by the group's timeout, so a dead rank makes the others raise).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PreTrainedModel

from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.batching.batch_attention import (
    BATCHED_ATTENTION,
    SlotKVCache,
    attention_layers,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.kv_footprint import KVFootprint, card_footprint
from exo.worker.engines.torch.batching.kv_memory import kv_cache_torch_dtype
from exo.worker.engines.torch.batching.scheduler import BatchScheduler
from exo.worker.engines.torch.batching.speculation import Speculation
from exo.worker.engines.torch.comm.process_group import IDLE_WAIT, group_ranks
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.parallel import engine_transform
from exo.worker.engines.torch.parallel.cache_ops import (
    CacheOp,
    CacheOpLog,
    PrefixMirror,
    RecordingPrefixCache,
    RecordingSlotKVCache,
    replay_cache_ops,
)
from exo.worker.engines.torch.parallel.last_rank_sampling import PipelineTraffic
from exo.worker.engines.torch.parallel.rank_steps import (
    SHUTDOWN,
    STEP,
    WARMUP_DONE,
    StepHeader,
)


def check_process_group(shard: ShardMetadata) -> None:
    """Raises RuntimeError when there is no process group, or its rank / world size differ
    from the shard's."""
    ranks = group_ranks()
    if ranks is None:
        raise RuntimeError("init_group() must run before loading a multi-rank shard")
    if ranks != (shard.device_rank, shard.world_size):
        raise RuntimeError(
            f"process group rank {ranks[0]} of {ranks[1]} does not "
            f"match the shard's rank {shard.device_rank} of {shard.world_size}"
        )


class RankGroup:
    """Rank `shard.device_rank` of a split instance: its KV slots, how steps reach the other
    ranks (its parallelism's `EngineTransform`), and serving rank 0's steps on ranks > 0."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        vocab_size: int,
        shard: ShardMetadata,
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        # This rank's KV dtype (its node's `--kv-cache-dtype`; None: `kv_cache_torch_dtype`'s
        # default).
        self.kv_dtype = kv_dtype or kv_cache_torch_dtype(
            None, device, next(model.parameters()).dtype
        )
        self.device = device
        self.vocab_size = vocab_size
        self.shard = shard
        self.rank = shard.device_rank
        self.world_size = shard.world_size
        self.transform = engine_transform(shard.sharding)
        self.shut_down = False
        self.traffic = PipelineTraffic()
        # This rank's KV slots (rank 0's is its scheduler's, built with it).
        self._slots: SlotKVCache | None = None
        # Ranks > 0: their part of rank 0's prefix-cache entries.
        self._mirror = PrefixMirror()
        text_config = model.config.get_text_config()
        self._windows = family_for_architecture(type(model).__name__).attention_windows(
            text_config
        )  # this shard's layers (a pipeline stage's config lists only its own)
        self._layer_of = attention_layers(model)
        self._hidden_size = int(text_config.hidden_size)

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @property
    def layer_range(self) -> tuple[int, int]:
        return self.shard.start_layer, self.shard.end_layer

    def take_cache_ops(self) -> tuple[CacheOp, ...]:
        """Rank 0's KV operations since the last step (for the next step's header)."""
        assert isinstance(self._slots, RecordingSlotKVCache)
        return self._slots.log.take()

    @property
    def prefix_mirror(self) -> PrefixMirror:
        """Ranks > 0: this rank's part of rank 0's prefix-cache entries."""
        return self._mirror

    def _new_slot_cache(
        self, max_concurrent_requests: int, log: CacheOpLog | None = None
    ) -> SlotKVCache:
        """This rank's KV slots: its layers, its KV heads (`EngineTransform.kv_heads`), in
        the group's KV dtype (recording into `log` on rank 0)."""
        text_config = self.model.config.get_text_config()
        geometry = kv_geometry_of_config(text_config, len(self._windows))
        # A latent (MLA) cache is one shared head, whole on every tensor rank.
        kv_heads = (
            geometry.kv_heads
            if geometry.latent_values
            else self.transform.kv_heads(geometry.kv_heads, self.shard)
        )
        use_batched_attention(self.model)
        # A family may give a tensor rank's attention modules a config of their own (with
        # this rank's head counts, e.g. Phi-3): it must use the batched attention too.
        layers: Any = self.model.model.layers
        for layer in layers:
            own_config = getattr(layer.self_attn, "config", None)
            if own_config is not None and own_config is not text_config:
                own_config._attn_implementation = BATCHED_ATTENTION
        arguments = (
            geometry.layers, kv_heads, geometry.head_dim, self.kv_dtype, self.device,
            max_concurrent_requests, geometry.latent_values, self._windows,
        )  # fmt: skip
        if log is None:
            return SlotKVCache(*arguments)
        return RecordingSlotKVCache(*arguments, log=log)

    def build_scheduler(
        self,
        kv_cache_tokens: int,
        max_concurrent_requests: int,
        speculation: Speculation | None = None,
    ) -> BatchScheduler:
        """Rank 0's scheduler, its steps run across the group, with the group's prefix
        cache (`RecordingPrefixCache`), and `speculation` (None: none): the draft rows
        travel in the step's plan like any decode rows, every rank commits only the fed
        position (`commit_lengths`, as rank 0 before verifying), rank 0's verified length
        reaches the others as a `CACHE_COMMIT` before their next step, and later steps'
        positions overwrite a rejected draft's KV. A pipeline's last rank sends back a
        draft's rows for rank 0 to verify (`pipeline.py`)."""
        self.check_rank_zero()
        log = CacheOpLog()
        cache = self._new_slot_cache(max_concurrent_requests, log)
        assert isinstance(cache, RecordingSlotKVCache)
        cache.prefix = RecordingPrefixCache(kv_cache_tokens, log)
        self._slots = cache
        hooks = self.transform.scheduler_hooks(self)
        footprint, prefix_windows = self._budget_windows()
        return BatchScheduler(
            self.model, cache, self._windows, self._layer_of, kv_cache_tokens, cache.prefix,
            self.device, forward=hooks.forward, launch=hooks.launch,
            max_in_flight=hooks.max_in_flight, footprint=footprint,
            prefix_windows=prefix_windows, speculation=speculation,
        )  # fmt: skip

    def _budget_windows(self) -> tuple[KVFootprint | None, tuple[int | None, ...]]:
        """How rank 0's scheduler counts the budget and checks prefix hits: where this
        rank holds every layer (tensor, expert), by its own windows. A pipeline stage's
        rank 0 sees its own layers only: it counts by the card's sliding layers
        (`card_footprint`), else every layer whole (the budget as without trimming; every
        stage trims its slots all the same), and checks hits against the model's sliding
        window too (`sliding_window` of the config: every family's windowed layers use it,
        `families/spec.py`)."""
        card = self.shard.model_card
        if len(self._windows) == card.n_layers:
            return None, self._windows
        footprint = card_footprint(card, len(self._windows))
        if footprint is None:
            footprint = KVFootprint((None,) * len(self._windows))
        window = getattr(self.model.config.get_text_config(), "sliding_window", None)
        extra = (window,) if isinstance(window, int) and window > 0 else ()
        return footprint, (*self._windows, *extra)

    def agree_on_slots(self, max_concurrent_requests: int) -> int:
        """Collective: rank 0's `max_concurrent_requests` (each node may be started with its
        own): every rank needs as many KV slots as rank 0 admits requests."""
        slots = torch.tensor([max_concurrent_requests], dtype=torch.int64)
        self.transform.agree(self, slots)
        return int(slots.item())

    def check_rank_zero(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 generates; other ranks call serve_forever()")
        if self.shut_down:
            raise RuntimeError("the engine was shut down")

    def send_control(self, command: int) -> None:
        self.transform.send_control(self, StepHeader(command))

    def end_warmup(self) -> None:
        """Rank 0: the other ranks' warm-up is over."""
        self.send_control(WARMUP_DONE)

    def serve_warmup(self, max_concurrent_requests: int) -> None:
        """Ranks > 0: serve rank 0's warm-up.

        Raises:
            RuntimeError: rank 0 shut down during the warm-up.
        """
        if self.serve(max_concurrent_requests) != WARMUP_DONE:
            raise RuntimeError("rank 0 shut down during warmup")

    def shutdown(self) -> None:
        """On rank 0: make the other ranks return from `serve_forever` (idempotent)."""
        if self.rank != 0 or self.shut_down:
            return
        self.shut_down = True
        self.send_control(SHUTDOWN)

    def serve_forever(self, max_concurrent_requests: int) -> None:
        """On ranks > 0: run rank 0's steps until it shuts down.

        Raises:
            RuntimeError (from torch.distributed): another rank died or timed out.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives generation; it does not serve")
        while self.serve(max_concurrent_requests) != SHUTDOWN:
            pass

    @torch.inference_mode()
    def serve(self, max_concurrent_requests: int) -> int:
        """Run rank 0's steps until a control command (`WARMUP_DONE`, `SHUTDOWN`); return
        it (passed on first to the ranks that still need it)."""
        if self._slots is None:
            self._slots = self._new_slot_cache(max_concurrent_requests)
        while True:
            header = self.transform.receive_header(self, IDLE_WAIT)
            if header.command != STEP:
                self.transform.pass_on_control(self, header)
                return header.command
            replay_cache_ops(self._slots, header.cache_ops, self._mirror)
            plan = header.plan(self._slots, self._windows, self._layer_of)
            self.transform.serve_step(self, header, plan)
