"""One model split across several processes (pipeline or tensor parallel), driven by rank 0.

Rank 0 takes requests through the engine contract (`submit` / `step` / `cancel`, one request
at a time: the running batch holds one request; queued ones wait) with the same
`RequestState` as one rank. It broadcasts a typed control message (`StartGeneration`,
`ShutdownGroup`) that the other ranks wait for in `serve_forever`.

- Pipeline: every forward step goes rank 0 -> 1 -> ... -> last as a header
  `[command, tokens, sample]` plus hidden states `[1, tokens, hidden]`; the last rank samples
  (with the request's seed) and sends the token to rank 0. A request that needs the logits
  on rank 0 (penalties, a logit bias, logprobs, a JSON / JSON-schema / tool-call
  constraint) is started with `sample_on_last_rank: false`: the last rank then sends the
  `[vocab]` float32 logits and rank 0 samples. Rank 0 ends a generation by sending an END
  header down the same path.
- Tensor: every rank runs the whole forward on the same tokens (the row-parallel linears
  all-reduce, so logits are identical everywhere); rank 0 samples and broadcasts each token,
  or END.
"""

from __future__ import annotations

import abc
import dataclasses
import secrets
import time
from collections import deque
from pathlib import Path
from typing import Annotated, Any, Literal

import torch
import torch.distributed as dist
from loguru import logger
from pydantic import Field, TypeAdapter
from transformers import PreTrainedModel

from exo.shared.types.common import FrozenModel
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import PipelineShardMetadata, ShardMetadata, TensorShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.prompt import RenderedPrompt
from exo.worker.engines.torch.distributed import (
    IDLE_WAIT,
    broadcast_bytes,
    broadcast_waiting,
    receive_waiting,
)
from exo.worker.engines.torch.engine import RequestHandle, TorchEngine, load_parts
from exo.worker.engines.torch.kv_cache import PREFILL_CHUNK_TOKENS, DecodeSession
from exo.worker.engines.torch.loading import LayerProgressCallback
from exo.worker.engines.torch.quantize import WeightDtype
from exo.worker.engines.torch.request_state import RequestState
from exo.worker.engines.torch.sampling import (
    Sampler,
    SamplingParams,
    TokenFilter,
    resolve_sampling_params,
)
from exo.worker.engines.torch.scheduler import StepOutput

FORWARD = 1
END = 2


class SamplingSettings(FrozenModel):
    """`SamplingParams` on the wire (the seed always set: every rank that samples draws
    the same tokens)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float


class StartGeneration(FrozenModel):
    """Rank 0 starts a generation: the prompt, the KV capacity it needs, its sampling, and
    whether the pipeline's last rank samples (else it sends logits to rank 0)."""

    kind: Literal["start"] = "start"
    prompt_ids: tuple[int, ...]
    capacity_tokens: int = Field(gt=0)
    sampling: SamplingSettings
    sample_on_last_rank: bool = True


class ShutdownGroup(FrozenModel):
    """Rank 0 is shutting down: the other ranks return from `serve_forever`."""

    kind: Literal["shutdown"] = "shutdown"


ControlMessage = Annotated[StartGeneration | ShutdownGroup, Field(discriminator="kind")]
control_message_adapter: TypeAdapter[ControlMessage] = TypeAdapter(ControlMessage)


def broadcast_control(message: ControlMessage | None) -> ControlMessage:
    """Send (rank 0) or receive (other ranks, waiting without a bound) one control
    message."""
    payload = broadcast_bytes(None if message is None else message.model_dump_json().encode())
    if message is not None:
        return message
    return control_message_adapter.validate_json(payload)


class DistributedSession(DecodeSession, abc.ABC):
    """Rank 0's side of one request's forward steps across the group (see subclasses)."""

    __slots__ = ("_in_flight",)

    def __init__(self, model: PreTrainedModel, device: torch.device, capacity_tokens: int):
        super().__init__(model, device, capacity_tokens)
        self._in_flight = False  # a step was started and its answer not yet received

    def begin(self, start_message: StartGeneration) -> None:
        """Tell the other ranks to start this generation (`serve_forever` receives it)."""
        self._in_flight = True
        broadcast_control(start_message)
        self._in_flight = False

    @abc.abstractmethod
    def _tell_end(self) -> None:
        """Tell the other ranks this generation is over (how depends on the sharding)."""

    def close(self) -> None:
        """Drop the KV cache and tell the other ranks the generation ended (unless a step
        failed half-way: then the group is broken and they raise on their own)."""
        if self.closed:
            return
        super().close()
        if not self._in_flight:
            try:
                self._tell_end()
            except RuntimeError as error:  # the group is gone; the caller sees the first error
                logger.warning("could not tell the other ranks the generation ended: {}", error)


class PipelineHeadSession(DistributedSession):
    """Pipeline rank 0: runs its layers, sends hidden states on, receives from the last rank
    either the sampled token (`sample_on_last_rank`: `prefill`/`decode` return it as a 0-d
    int64 tensor, consumed by `ForwardedTokenSampler`) or the `[vocab]` float32 logits.

    Args:
        vocab_size: length of the logits the last rank sends (when it does not sample).
    """

    __slots__ = ("_last_rank", "_sample_on_last_rank", "_vocab_size")

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        capacity_tokens: int,
        sample_on_last_rank: bool = True,
        vocab_size: int = 0,
    ):
        super().__init__(model, device, capacity_tokens)
        self._last_rank = dist.get_world_size() - 1
        self._sample_on_last_rank = sample_on_last_rank
        self._vocab_size = vocab_size

    def _step(self, tokens: torch.Tensor, sample: bool) -> torch.Tensor | None:
        if self._cache is None:
            raise RuntimeError("the decode session is closed")
        length = tokens.shape[1]
        if self.position + length > self.capacity_tokens:
            raise RuntimeError(
                f"KV cache overflow: {self.position} + {length} > {self.capacity_tokens}"
            )
        self._in_flight = True
        hidden = stage_forward(
            self._model, self._cache, self.position, is_last=False, input_ids=tokens
        )
        self.position += length
        dist.send(torch.tensor([FORWARD, length, int(sample)], dtype=torch.int64), dst=1)
        dist.send(hidden.contiguous(), dst=1)
        if not sample:
            self._in_flight = False
            return None
        if not self._sample_on_last_rank:
            logits = torch.empty(self._vocab_size, dtype=torch.float32)  # [vocab]
            dist.recv(logits, src=self._last_rank)
            self._in_flight = False
            return logits.to(self._device)
        token = torch.zeros(1, dtype=torch.int64)
        dist.recv(token, src=self._last_rank)
        self._in_flight = False
        return token[0]

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        if not prompt_ids:
            raise ValueError("cannot prefill an empty prompt")
        tokens = torch.tensor([prompt_ids], dtype=torch.long, device=self._device)  # [1, n]
        token: torch.Tensor | None = None
        for start in range(0, tokens.shape[1], PREFILL_CHUNK_TOKENS):
            chunk = tokens[:, start : start + PREFILL_CHUNK_TOKENS]
            token = self._step(chunk, sample=start + PREFILL_CHUNK_TOKENS >= tokens.shape[1])
        assert token is not None
        return token

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        token = self._step(torch.tensor([[token_id]], dtype=torch.long, device=self._device), True)
        assert token is not None
        return token

    def _tell_end(self) -> None:
        dist.send(torch.tensor([END, 0, 0], dtype=torch.int64), dst=1)


class TensorHeadSession(DistributedSession):
    """Tensor rank 0: broadcasts each decode token before running the (collective) forward."""

    __slots__ = ()

    @torch.inference_mode()
    def prefill(self, prompt_ids: list[int]) -> torch.Tensor:
        self._in_flight = True
        logits = super().prefill(prompt_ids)
        self._in_flight = False
        return logits

    @torch.inference_mode()
    def decode(self, token_id: int) -> torch.Tensor:
        self._in_flight = True
        dist.broadcast(torch.tensor([FORWARD, token_id], dtype=torch.int64), src=0)
        logits = super().decode(token_id)
        self._in_flight = False
        return logits

    def _tell_end(self) -> None:
        dist.broadcast(torch.tensor([END, 0], dtype=torch.int64), src=0)


class ForwardedTokenSampler(Sampler):
    """Rank 0's sampler in a pipeline: the last rank already sampled; `logits` is the token."""

    __slots__ = ()

    def sample(self, logits: torch.Tensor, constraint: TokenFilter | None = None) -> int:
        assert constraint is None, "a constrained request has rank 0 sample"
        return int(logits.item())


def stage_forward(
    model: PreTrainedModel,
    cache: Any,
    position: int,
    *,
    is_last: bool,
    input_ids: torch.Tensor | None = None,
    inputs_embeds: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run this pipeline rank's layers on `input_ids` `[1, n]` (first rank) or hidden states
    `inputs_embeds` `[1, n, hidden]` (later ranks), appending to `cache`.

    Returns:
        `[1, n, hidden]` hidden states to send on, or `[vocab]` logits of the last position
        on the last rank.
    """
    length = (input_ids if input_ids is not None else inputs_embeds).shape[1]  # type: ignore[union-attr]
    position_ids = torch.arange(position, position + length).unsqueeze(0)  # [1, n]
    if is_last:
        output = model(
            input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
            cache=cache, use_cache=True, logits_to_keep=1,
        )  # fmt: skip
        logits: torch.Tensor = output.logits[0, -1]
        return logits
    inner: Any = model.model
    hidden: torch.Tensor = inner(
        input_ids=input_ids, inputs_embeds=inputs_embeds, position_ids=position_ids,
        cache=cache, use_cache=True,
    ).last_hidden_state  # fmt: skip
    return hidden


class DistributedTorchEngine(TorchEngine):
    """A `TorchEngine` for one rank of a multi-rank shard (the process group must exist).

    Rank 0: the engine contract (`submit` / `step` / `cancel`; one request runs at a time,
    the others wait in order), `shutdown()` at the end. Other ranks: `serve_forever()`.
    Every rank: `warmup()` (collective).
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
    ) -> None:
        super().__init__(
            model, tokenizer, card, device, eos_token_ids, weight_dtype,
            max_concurrent_requests=1,
        )  # fmt: skip
        self.shard = shard
        self.rank = shard.device_rank
        self.world_size = shard.world_size
        self._shut_down = False
        self._waiting: deque[tuple[RequestState, SamplingParams]] = deque()
        self._active: tuple[RequestState, DistributedSession] | None = None

    @classmethod
    def load(  # type: ignore[override]
        cls,
        model_dir: Path,
        shard: ShardMetadata,
        device: str = "cpu",
        on_layer_loaded: LayerProgressCallback | None = None,
        weight_dtype: WeightDtype | None = None,
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
        parts = load_parts(model_dir, shard, device, weight_dtype, on_layer_loaded)
        engine = cls(
            parts.model, parts.tokenizer, shard.model_card, parts.device,
            parts.eos_token_ids, shard, parts.weight_dtype,
        )  # fmt: skip
        logger.info(
            "rank {}/{} loaded {} in {:.1f} s", shard.device_rank, shard.world_size,
            shard.model_card.model_id, time.perf_counter() - started,
        )  # fmt: skip
        return engine

    @property
    def is_pipeline(self) -> bool:
        return isinstance(self.shard, PipelineShardMetadata)

    def warmup(self) -> None:
        """Collective: rank 0 runs a short generation, the others serve exactly that one."""
        if self.rank == 0:
            super().warmup()
        elif not self._serve_one():
            raise RuntimeError("rank 0 shut down during warmup")

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
        sampling = resolve_sampling_params(params, self.card.sampling_defaults)
        if sampling.seed is None:  # drawn here so every rank that samples uses the same one
            sampling = dataclasses.replace(sampling, seed=secrets.randbits(63))
        state = self.build_request(params, prompt, request_id, sampling)
        self._waiting.append((state, sampling))
        return RequestHandle(state.request_id, len(state.prompt_ids))

    @property
    def has_work(self) -> bool:
        return bool(self._waiting) or self._active is not None

    def cancel(self, request_id: str) -> bool:
        """As `TorchEngine.cancel`: a running request's session ends (the other ranks are
        told)."""
        for entry in self._waiting:
            if entry[0].request_id == request_id:
                self._waiting.remove(entry)
                return True
        if self._active is not None and self._active[0].request_id == request_id:
            self._active[1].close()
            self._active = None
            return True
        return False

    def step(self) -> list[StepOutput]:
        """One forward step of the running request across the group (its prompt's prefill
        when it starts), as `TorchEngine.step`.

        Raises:
            RuntimeError (torch.distributed): another rank died or timed out; the running
                request is dropped.
        """
        self._check_rank_zero()
        if self._active is None:
            if not self._waiting:
                return []
            state, sampling = self._waiting.popleft()
            session = self._start(state, sampling)
            self._active = (state, session)
            forward = lambda: session.prefill(state.prompt_ids)  # noqa: E731
        else:
            state, session = self._active
            forward = lambda: session.decode(state.generated_ids[-1])  # noqa: E731
        try:
            logits = forward()
        except BaseException:
            session.close()
            self._active = None
            raise
        try:
            pieces = state.accept(logits)
        except Exception as error:  # this request's own failure (its constraint)
            session.close()
            self._active = None
            return [(state.request_id, error)]
        if state.finished:
            session.close()
            self._active = None
        return [(state.request_id, piece) for piece in pieces]

    def _start(self, state: RequestState, sampling: SamplingParams) -> DistributedSession:
        """Open the request's session and tell the other ranks to start it."""
        capacity = len(state.prompt_ids) + state.max_new_tokens
        # The fast pipeline path sends one token id per step; logits (vocab floats) only
        # when rank 0 needs them.
        sample_on_last_rank = not state.chooser.needs_logits and state.top_logprobs is None
        session: DistributedSession
        if self.is_pipeline:
            session = PipelineHeadSession(
                self.model, self.device, capacity, sample_on_last_rank, self.vocab_size
            )
            if sample_on_last_rank:
                state.chooser.sampler = ForwardedTokenSampler(sampling, self.device)
        else:
            session = TensorHeadSession(self.model, self.device, capacity)
        assert sampling.seed is not None
        settings = SamplingSettings(**{**dataclasses.asdict(sampling), "seed": sampling.seed})
        start = StartGeneration(
            prompt_ids=tuple(state.prompt_ids),
            capacity_tokens=capacity,
            sampling=settings,
            sample_on_last_rank=sample_on_last_rank,
        )
        try:
            session.begin(start)
        except BaseException:
            session.close()
            raise
        return session

    def shutdown(self) -> None:
        """On rank 0: make the other ranks return from `serve_forever` (idempotent)."""
        if self.rank != 0 or self._shut_down:
            return
        self._shut_down = True
        broadcast_control(ShutdownGroup())

    def serve_forever(self) -> None:
        """On ranks > 0: serve generations until rank 0 shuts down.

        Raises:
            RuntimeError (from torch.distributed): another rank died or timed out.
        """
        if self.rank == 0:
            raise RuntimeError("rank 0 drives generation; it does not serve")
        while self._serve_one():
            pass

    def _serve_one(self) -> bool:
        """Wait for one control message and act on it; False on shutdown."""
        match broadcast_control(None):
            case StartGeneration() as start:
                sampling = SamplingParams(**start.sampling.model_dump())
                if self.is_pipeline:
                    self._serve_pipeline_generation(
                        start.capacity_tokens, sampling, start.sample_on_last_rank
                    )
                else:
                    self._serve_tensor_generation(list(start.prompt_ids), start.capacity_tokens)
                return True
            case ShutdownGroup():
                return False

    @torch.inference_mode()
    def _serve_pipeline_generation(
        self, capacity: int, sampling: SamplingParams, sample_on_last_rank: bool
    ) -> None:
        session = DecodeSession(self.model, self.device, capacity)  # owns the KV cache
        is_last = self.rank == self.world_size - 1
        sampler = Sampler(sampling, self.device) if is_last and sample_on_last_rank else None
        hidden_size = self.model.config.get_text_config().hidden_size
        dtype = next(self.model.parameters()).dtype
        header = torch.zeros(3, dtype=torch.int64)
        try:
            while True:
                # Unbounded: rank 0 may wait on its consumer between steps.
                receive_waiting(header, self.rank - 1, IDLE_WAIT)
                command, length, sample = (int(value) for value in header.tolist())
                if command == END:
                    if not is_last:
                        dist.send(header, dst=self.rank + 1)
                    return
                hidden = torch.empty((1, length, hidden_size), dtype=dtype)
                dist.recv(hidden, src=self.rank - 1)
                output = stage_forward(
                    self.model, session._cache, session.position, is_last=is_last,
                    inputs_embeds=hidden,
                )  # fmt: skip
                session.position += length
                if not is_last:
                    dist.send(header, dst=self.rank + 1)
                    dist.send(output.contiguous(), dst=self.rank + 1)
                elif sample and sampler is None:  # rank 0 samples
                    dist.send(output.float().cpu().contiguous(), dst=0)
                elif sample and sampler is not None:
                    token = sampler.sample(output)
                    dist.send(torch.tensor([token], dtype=torch.int64), dst=0)
        finally:
            session.close()

    def _serve_tensor_generation(self, prompt_ids: list[int], capacity: int) -> None:
        session = DecodeSession(self.model, self.device, capacity)
        header = torch.zeros(2, dtype=torch.int64)
        try:
            session.prefill(prompt_ids)
            while True:
                broadcast_waiting(header, 0, IDLE_WAIT)
                command, token = (int(value) for value in header.tolist())
                if command == END:
                    return
                session.decode(token)
        finally:
            session.close()


def shard_needs_group(shard: ShardMetadata) -> bool:
    """Whether the shard spans several ranks (and so needs `DistributedTorchEngine`)."""
    match shard:
        case PipelineShardMetadata() | TensorShardMetadata():
            return shard.world_size > 1
