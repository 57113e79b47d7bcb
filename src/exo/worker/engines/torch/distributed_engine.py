"""One model split across several processes (pipeline or tensor parallel), driven by rank 0.

Rank 0 is a `TorchEngine`: the engine contract (`submit` / `step` / `cancel`) over the
single-rank `BatchScheduler` (continuous batching, chunked prefill, pre-emption; no prefix
cache, whose KV would be rank 0's part only). Its scheduler's forward pass is this engine's:
each step, rank 0 tells the other ranks the step as a `StepHeader` (`parallel/rank_steps.py`:
the KV-slot operations since the last step, so admissions, finishes, cancels and
pre-emptions free the same slots on every rank, and the step's batch plan), then every rank
runs its part of the same batched forward. Rank 0 samples every request (`RequestState`):
seeded generators, penalties, logit bias, logprobs and constraints live in one place, and
the next step's header carries the chosen tokens, so no extra message is needed for them.

How a step travels (a broadcast to every rank in lockstep, or rank to rank with several
steps in flight) is the shard's parallelism's: `parallel/<kind>.py`, looked up by the
shard's `sharding` (`engine_transform`); this engine calls it and never tests the kind.

Ranks > 0 wait for rank 0's next header in `serve_forever` (unbounded while rank 0 is idle;
every other wait is bounded by the group's timeout, so a dead rank makes the others raise).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from loguru import logger
from transformers import PreTrainedModel

from exo.shared.models.memory import (
    DEFAULT_KV_CACHE_TOKENS,
    DEFAULT_PREFILL_ACTIVATIONS,
    PrefillActivations,
)
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.prompt import RenderedPrompt
from exo.worker.engines.torch.batching.batch_attention import (
    BATCHED_ATTENTION,
    SlotKVCache,
    attention_layers,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.scheduler import BatchScheduler, StepOutput
from exo.worker.engines.torch.comm.process_group import (
    IDLE_WAIT,
)
from exo.worker.engines.torch.engine import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    RequestHandle,
    TorchEngine,
    load_parts,
)
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.model.loading import LayerProgressCallback
from exo.worker.engines.torch.parallel import engine_transform
from exo.worker.engines.torch.parallel.rank_steps import (
    SHUTDOWN,
    STEP,
    WARMUP_DONE,
    RecordingSlotKVCache,
    StepHeader,
    replay_cache_ops,
)
from exo.worker.engines.torch.quant.quantize import WeightDtype


class DistributedTorchEngine(TorchEngine):
    """A `TorchEngine` for one rank of a multi-rank shard (the process group must exist).

    Rank 0: the engine contract (`submit` / `step` / `cancel`, up to
    `max_concurrent_requests` in the running batch), `shutdown()` at the end. Other ranks:
    `serve_forever()`. Every rank: `warmup()` (collective).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        card: ModelCard,
        device: torch.device,
        eos_token_ids: frozenset[int],
        shard: ShardMetadata,
        weight_dtype: WeightDtype = "float32",
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
    ) -> None:
        super().__init__(
            model, tokenizer, card, device, eos_token_ids, weight_dtype,
            max_concurrent_requests, kv_cache_tokens,
        )  # fmt: skip
        self.shard = shard
        self.rank = shard.device_rank
        self.world_size = shard.world_size
        self._shut_down = False
        # This rank's KV slots (rank 0's is its scheduler's, built with it).
        self._slots: SlotKVCache | None = None
        text_config = model.config.get_text_config()
        self._windows = family_for_architecture(type(model).__name__).attention_windows(
            text_config
        )  # this shard's layers (a pipeline stage's config lists only its own)
        self._layer_of = attention_layers(model)
        self._hidden_size = int(text_config.hidden_size)
        self.transform = engine_transform(shard.sharding)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        shard: ShardMetadata,
        device: str = "cpu",
        on_layer_loaded: LayerProgressCallback | None = None,
        weight_dtype: WeightDtype | None = None,
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
    ) -> DistributedTorchEngine:
        """Load this rank's part of the model (see `TorchEngine.load`).

        Raises:
            RuntimeError: no process group, or its rank / world size differ from the shard's.
        """
        if not dist.is_initialized():
            raise RuntimeError("init_group() must run before loading a multi-rank shard")
        if (dist.get_rank(), dist.get_world_size()) != (shard.device_rank, shard.world_size):
            raise RuntimeError(
                f"process group rank {dist.get_rank()} of {dist.get_world_size()} does not "
                f"match the shard's rank {shard.device_rank} of {shard.world_size}"
            )
        started = time.perf_counter()
        parts = load_parts(
            model_dir, shard, device, weight_dtype, on_layer_loaded, prefill_activations
        )
        engine = cls(
            parts.model, parts.tokenizer, shard.model_card, parts.device,
            parts.eos_token_ids, shard, parts.weight_dtype, max_concurrent_requests,
            kv_cache_tokens,
        )  # fmt: skip
        logger.info(
            "rank {}/{} loaded {} in {:.1f} s", shard.device_rank, shard.world_size,
            shard.model_card.model_id, time.perf_counter() - started,
        )  # fmt: skip
        return engine

    @property
    def hidden_size(self) -> int:
        return self._hidden_size

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def _new_slot_cache(self, cache_class: type[SlotKVCache]) -> SlotKVCache:
        """This rank's KV slots: its layers, its KV heads (a tensor rank holds 1/N)."""
        text_config = self.model.config.get_text_config()
        heads = int(text_config.num_attention_heads)
        kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        kv_heads = self.transform.kv_heads(kv_heads, self.shard)
        dtype = next(self.model.parameters()).dtype
        use_batched_attention(self.model)
        # A family may give a tensor rank's attention modules a config of their own (with
        # this rank's head counts, e.g. Phi-3): it must use the batched attention too.
        layers: Any = self.model.model.layers
        for layer in layers:
            own_config = getattr(layer.self_attn, "config", None)
            if own_config is not None and own_config is not text_config:
                own_config._attn_implementation = BATCHED_ATTENTION
        return cache_class(
            len(self._windows), kv_heads, head_dim, dtype, self.device,
            self.max_concurrent_requests,
        )  # fmt: skip

    def _build_scheduler(self) -> BatchScheduler:
        self._check_rank_zero()
        cache = self._new_slot_cache(RecordingSlotKVCache)
        self._slots = cache
        hooks = self.transform.scheduler_hooks(self)
        return BatchScheduler(
            self.model, cache, self._windows, self._layer_of, self.kv_cache_tokens, None,
            self.device, forward=hooks.forward, launch=hooks.launch,
            max_in_flight=hooks.max_in_flight,
        )  # fmt: skip

    def warmup(self) -> None:
        """Collective: the ranks take rank 0's `max_concurrent_requests`, then rank 0 runs
        a short generation and the others serve it until rank 0 says the warm-up is over.

        Raises:
            RuntimeError: rank 0 shut down during the warm-up (ranks > 0).
        """
        self._agree_on_slots()
        if self.rank == 0:
            super().warmup()
            self._send_control(WARMUP_DONE)
        elif self._serve() != WARMUP_DONE:
            raise RuntimeError("rank 0 shut down during warmup")

    def _agree_on_slots(self) -> None:
        """Take rank 0's `max_concurrent_requests` (each node may be started with its own):
        every rank needs as many KV slots as rank 0 admits requests."""
        slots = torch.tensor([self.max_concurrent_requests], dtype=torch.int64)
        self.transform.agree(self, slots)
        self.max_concurrent_requests = int(slots.item())

    # -- the engine contract, on rank 0 ---------------------------------------------------

    def _check_rank_zero(self) -> None:
        if self.rank != 0:
            raise RuntimeError("only rank 0 generates; other ranks call serve_forever()")
        if self._shut_down:
            raise RuntimeError("the engine was shut down")

    def submit(
        self,
        params: TextGenerationTaskParams,
        prompt: RenderedPrompt | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """As `TorchEngine.submit`, on rank 0 only."""
        self._check_rank_zero()
        return super().submit(params, prompt, request_id)

    def step(self) -> list[StepOutput]:
        """As `TorchEngine.step`, on rank 0 only: one batched step across the group (a
        pipeline launches one and samples the oldest of up to `world_size` in flight, so a
        call may stream nothing while the pipeline fills).

        Raises:
            RuntimeError (torch.distributed): another rank died or timed out; every running
                request is dropped.
        """
        self._check_rank_zero()
        return super().step()

    def shutdown(self) -> None:
        """On rank 0: make the other ranks return from `serve_forever` (idempotent)."""
        if self.rank != 0 or self._shut_down:
            return
        self._shut_down = True
        self._send_control(SHUTDOWN)

    def _send_control(self, command: int) -> None:
        self.transform.send_control(self, StepHeader(command))

    def take_cache_ops(self) -> tuple[tuple[int, int], ...]:
        """Rank 0's KV-slot operations since the last step (for the next step's header)."""
        assert isinstance(self._slots, RecordingSlotKVCache)
        return self._slots.take_ops()

    # -- ranks > 0 ------------------------------------------------------------------------

    def serve_forever(self) -> None:
        """On ranks > 0: run rank 0's steps until it shuts down.

        Raises:
            RuntimeError (from torch.distributed): another rank died or timed out.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives generation; it does not serve")
        while self._serve() != SHUTDOWN:
            pass

    @torch.inference_mode()
    def _serve(self) -> int:
        """Run rank 0's steps until a control command (`WARMUP_DONE`, `SHUTDOWN`); return
        it (a pipeline rank passes it on first)."""
        if self._slots is None:
            self._slots = self._new_slot_cache(SlotKVCache)
        while True:
            header = self.transform.receive_header(self, IDLE_WAIT)
            if header.command != STEP:
                self.transform.pass_on_control(self, header)
                return header.command
            replay_cache_ops(self._slots, header.cache_ops)
            plan = header.plan(self._slots, self._windows, self._layer_of)
            self.transform.serve_step(self, header, plan)


def shard_needs_group(shard: ShardMetadata) -> bool:
    """Whether the shard spans several ranks (and so needs `DistributedTorchEngine`)."""
    return shard.world_size > 1
