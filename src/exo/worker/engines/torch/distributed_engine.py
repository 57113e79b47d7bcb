"""One model split across several processes (pipeline or tensor parallel), driven by rank 0.

Rank 0 is a `TorchEngine`: the engine contract (`submit` / `step` / `cancel`) over the
single-rank `BatchScheduler` (continuous batching, chunked prefill, pre-emption; no prefix
cache, whose KV would be rank 0's part only). Its scheduler's forward pass is this engine's:
each step, rank 0 tells the other ranks the step as a `StepHeader` (`distributed_batch.py`:
the KV-slot operations since the last step, so admissions, finishes, cancels and
pre-emptions free the same slots on every rank, and the step's batch plan), then every rank
runs its part of the same batched forward. Rank 0 samples every request (`RequestState`):
seeded generators, penalties, logit bias, logprobs and constraints live in one place, and
the next step's header carries the chosen tokens, so no extra message is needed for them.

- Tensor: one broadcast of the header per step (one message per rank); every rank
  runs the whole batched forward in lockstep (the row-parallel linears all-reduce, so every
  rank computes the same logits; the others drop theirs).
- Pipeline: up to `world_size` steps are in flight at once, each over its own requests
  (the scheduler's `max_in_flight`: rank 0 runs step t+1's layers while the next ranks run
  step t's, and samples step t when its logits come back). A step of at least
  `MICRO_BATCH_MIN_ROWS` rows (prefill) is also split into up to `world_size`
  micro-batches of requests (`micro_batch_count`; a decode step stays whole).
  For each, rank 0 runs its layers and sends the header and `[1, T, hidden]` float32
  hidden states to rank 1 (which runs its layers while rank 0 computes the next
  micro-batch), and so on; the last rank sends the micro-batch's `[R, vocab]` float32
  logits to rank 0 (rank 0 posts that receive before sending the micro-batch, so no send
  waits on a rank that is itself sending). Per micro-batch and hop: two messages (the
  header with its length, the hidden states), over the group's `comm/tcp_mesh.py` TCP links when
  it has them (else gloo).

Ranks > 0 wait for rank 0's next header in `serve_forever` (unbounded while rank 0 is idle;
every other wait is bounded by the group's timeout, so a dead rank makes the others raise).
"""

from __future__ import annotations

import time
from collections.abc import Callable
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
    BatchPlan,
    SlotKVCache,
    attention_layers,
    forward_batch,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.scheduler import BatchScheduler, StepOutput
from exo.worker.engines.torch.comm.process_group import (
    IDLE_WAIT,
    post_receive,
    receive_tensor,
    send_tensor,
)
from exo.worker.engines.torch.distributed_batch import (
    SHUTDOWN,
    STEP,
    WARMUP_DONE,
    RecordingSlotKVCache,
    StepHeader,
    broadcast_step,
    micro_batch_count,
    receive_step,
    replay_cache_ops,
    send_step,
    split_micro_batches,
    stage_forward_batch,
)
from exo.worker.engines.torch.engine import (
    DEFAULT_MAX_CONCURRENT_REQUESTS,
    RequestHandle,
    TorchEngine,
    load_parts,
)
from exo.worker.engines.torch.model.families import family_for_architecture
from exo.worker.engines.torch.model.loading import LayerProgressCallback
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
    def is_pipeline(self) -> bool:
        return self.shard.sharding == "pipeline"

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def _new_slot_cache(self, cache_class: type[SlotKVCache]) -> SlotKVCache:
        """This rank's KV slots: its layers, its KV heads (a tensor rank holds 1/N)."""
        text_config = self.model.config.get_text_config()
        heads = int(text_config.num_attention_heads)
        kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
        if self.shard.sharding == "tensor":
            kv_heads //= self.world_size
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
        if self.is_pipeline:  # one step in flight per rank (see scheduler.py)
            return BatchScheduler(
                self.model, cache, self._windows, self._layer_of, self.kv_cache_tokens, None,
                self.device, launch=self._pipeline_launch, max_in_flight=self.world_size,
            )  # fmt: skip
        return BatchScheduler(
            self.model, cache, self._windows, self._layer_of, self.kv_cache_tokens, None,
            self.device, forward=self._tensor_forward,
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
        if not self.is_pipeline:
            dist.broadcast(slots, src=0)
        else:
            if self.rank > 0:
                dist.recv(slots, src=self.rank - 1)
            if not self.is_last_rank:
                dist.send(slots, dst=self.rank + 1)
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
        header = StepHeader(command)
        if self.is_pipeline:
            send_step(header, 1)
        else:
            broadcast_step(header, IDLE_WAIT)

    def _rank_zero_ops(self) -> tuple[tuple[int, int], ...]:
        assert isinstance(self._slots, RecordingSlotKVCache)
        return self._slots.take_ops()

    def _tensor_forward(
        self,
        model: PreTrainedModel,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        """Rank 0's tensor-parallel step: broadcast the header, run the collective forward."""
        header = StepHeader.from_plan(
            plan, input_ids, position_ids, logit_rows, self._rank_zero_ops()
        )
        broadcast_step(header, IDLE_WAIT)
        return forward_batch(model, plan, input_ids, position_ids, logit_rows)

    def _pipeline_launch(
        self,
        model: PreTrainedModel,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> Callable[[], torch.Tensor]:
        """Rank 0's part of a pipeline step: its layers for each micro-batch in turn, sent
        on as soon as done (the receive of the last rank's logits posted first); returns
        the function that waits for every micro-batch's logits and puts them in order."""
        step = StepHeader.from_plan(
            plan, input_ids, position_ids, logit_rows, self._rank_zero_ops()
        )
        last = self.world_size - 1
        answers: list[tuple[Callable[[], None] | None, torch.Tensor, tuple[int, ...]]] = []
        for micro_batch in split_micro_batches(step, micro_batch_count(step, self.world_size)):
            header = micro_batch.header
            logits = torch.empty((len(header.logit_rows), self.vocab_size), dtype=torch.float32)
            wait = post_receive(logits, last) if header.logit_rows else None
            micro_plan = header.plan(plan.cache, plan.windows, plan.layer_of)
            hidden = stage_forward_batch(
                model, micro_plan, header, hidden=None, is_last=False, device=self.device
            )
            send_step(header, 1)
            send_tensor(hidden.cpu().contiguous(), 1)
            answers.append((wait, logits, micro_batch.logit_order))
        device = self.device

        def collect() -> torch.Tensor:
            result = torch.empty((len(step.logit_rows), self.vocab_size), dtype=torch.float32)
            for wait, logits, order in answers:
                if wait is not None:
                    wait()
                    result[list(order)] = logits
            return result.to(device)

        return collect

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
            if self.is_pipeline:
                header = receive_step(self.rank - 1, IDLE_WAIT)
            else:
                header = broadcast_step(None, IDLE_WAIT)
            if header.command != STEP:
                if self.is_pipeline and not self.is_last_rank:
                    send_step(header, self.rank + 1)
                return header.command
            replay_cache_ops(self._slots, header.cache_ops)
            plan = header.plan(self._slots, self._windows, self._layer_of)
            if self.is_pipeline:
                self._serve_pipeline_step(header, plan)
            else:
                input_ids, position_ids, logit_rows = (
                    tensor.to(self.device) for tensor in header.tensors()
                )
                forward_batch(self.model, plan, input_ids, position_ids, logit_rows)

    def _serve_pipeline_step(self, header: StepHeader, plan: BatchPlan) -> None:
        dtype = next(self.model.parameters()).dtype
        received = torch.empty((1, header.rows, self._hidden_size), dtype=torch.float32)
        receive_tensor(received, self.rank - 1)
        hidden = received.to(device=self.device, dtype=dtype)
        output = stage_forward_batch(
            self.model, plan, header, hidden=hidden, is_last=self.is_last_rank,
            device=self.device,
        )  # fmt: skip
        if not self.is_last_rank:
            send_step(header, self.rank + 1)
            send_tensor(output.cpu().contiguous(), self.rank + 1)
        elif header.logit_rows:
            send_tensor(output.float().cpu().contiguous(), 0)


def shard_needs_group(shard: ShardMetadata) -> bool:
    """Whether the shard spans several ranks (and so needs `DistributedTorchEngine`)."""
    return shard.world_size > 1
