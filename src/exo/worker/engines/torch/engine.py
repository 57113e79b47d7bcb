"""The PyTorch engine: loads a shard, keeps the KV cache, samples and streams text pieces.

One engine serves one request at a time (the runner subprocess owns it). `generate` is a
generator; the runner cancels a request by closing it between pieces, which releases the
request's KV cache.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger
from transformers import AutoTokenizer, GenerationConfig, PreTrainedModel

from exo.shared.models.memory import ENGINE_CPU_WEIGHT_FORMAT
from exo.shared.types.chunks import FinishReason, TokenLogprob, TopLogprob, Usage
from exo.shared.types.common import ModelId
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.prompt import RenderedPrompt, decode_keeping_markers, render_prompt
from exo.worker.engines.torch.constrained import (
    TokenConstraint,
    json_object_constraint,
    json_schema_constraint,
    tool_call_constraint,
)
from exo.worker.engines.torch.detokenizer import StreamingDetokenizer, without_incomplete_end
from exo.worker.engines.torch.kv_cache import DecodeSession, KVCachePool
from exo.worker.engines.torch.loading import LayerProgressCallback, load_model
from exo.worker.engines.torch.quantize import WeightDtype
from exo.worker.engines.torch.sampling import (
    LogitBias,
    Sampler,
    SamplingParams,
    TokenChooser,
    TokenPenalties,
    resolve_sampling_params,
    step_logprobs,
)
from exo.worker.engines.torch.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.vocabulary import TokenVocabulary

WARMUP_PROMPT = "Say hello."
WARMUP_TOKENS = 8
# Weight-only int4 (group 32) decodes ~2-3x faster than float32 on CPU with greedy output
# close to float32's (see bench/bench_engine.py and quantize.py); CUDA keeps float32 (the
# quantized kernels used here are the CPU ones).
DEFAULT_CPU_WEIGHT_DTYPE: WeightDtype = ENGINE_CPU_WEIGHT_FORMAT


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context for even one generated token."""


@dataclass(slots=True)
class GeneratedPiece:
    """One streamed piece of generated text.

    `token_ids` are the tokens whose text this piece completes (several when a character or
    a possible stop string spanned tokens; none for a final piece that only carries the
    finish reason). `finish_reason` and `usage` are set on the last piece only. `logprobs`
    has one entry per token of `token_ids` when the request asked for logprobs, else none.
    """

    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    usage: Usage | None
    logprobs: tuple[TokenLogprob, ...] = ()
    stop_sequence: str | None = None


def _configure_cpu_threads() -> None:
    """Keep torch's default (one intra-op thread per physical core, or OMP_NUM_THREADS) but
    never more threads than CPUs this process may run on: oversubscribed OpenMP threads
    spin-wait on each other and decode several times slower."""
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return
    allowed = max(1, len(os.sched_getaffinity(0)))
    if torch.get_num_threads() > allowed:
        torch.set_num_threads(allowed)


def _eos_token_ids(model_dir: Path, tokenizer: Any, model: PreTrainedModel) -> frozenset[int]:
    ids: set[int] = set()
    candidates: list[Any] = [tokenizer.eos_token_id, model.config.get_text_config().eos_token_id]
    with contextlib.suppress(OSError):  # no generation_config.json
        candidates.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for candidate in candidates:
        if isinstance(candidate, int):
            ids.add(candidate)
        elif isinstance(candidate, list | tuple):
            ids.update(int(item) for item in candidate)
    if not ids:
        raise ValueError(f"{model_dir}: neither the tokenizer nor the config names an EOS token")
    return frozenset(ids)


@dataclass(slots=True)
class LoadedParts:
    """What every engine needs after loading: the (quantized) model and its tokenizer."""

    model: PreTrainedModel
    tokenizer: Any
    device: torch.device
    weight_dtype: WeightDtype
    eos_token_ids: frozenset[int]


def load_parts(
    model_dir: Path,
    shard: ShardMetadata,
    device: str,
    weight_dtype: WeightDtype | None,
    on_layer_loaded: LayerProgressCallback | None = None,
) -> LoadedParts:
    """Load the shard's model (whole or one rank's part; quantized and fused on CPU while
    loading, see `loading.load_model`) and the tokenizer: what every engine needs.

    Raises:
        UnsupportedArchitectureError (a ValueError): no family file for the model.
        ValueError: an unknown `weight_dtype`, a quantized one on a non-CPU device,
            or missing tensors.
    """
    torch_device = torch.device(device)
    if weight_dtype is None:
        weight_dtype = DEFAULT_CPU_WEIGHT_DTYPE if torch_device.type == "cpu" else "float32"
    if torch_device.type == "cpu":
        _configure_cpu_threads()
    model = load_model(model_dir, shard, torch_device, weight_dtype, on_layer_loaded)
    # A tokenizer without a chat template is a base model's: it serves raw prompts only.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    eos_token_ids = _eos_token_ids(model_dir, tokenizer, model)
    return LoadedParts(model, tokenizer, torch_device, weight_dtype, eos_token_ids)


class TorchEngine:
    """Text generation for one shard of a transformers causal LM.

    Build with `TorchEngine.load`; call `warmup()` once; then `generate()` per request.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: Any,
        card: ModelCard,
        device: torch.device,
        eos_token_ids: frozenset[int],
        weight_dtype: WeightDtype = "float32",
    ) -> None:
        self.model = model
        self.weight_dtype = weight_dtype
        self.tokenizer = tokenizer
        self.card = card
        self.device = device
        self.eos_token_ids = eos_token_ids
        text_config = model.config.get_text_config()
        configured_context = getattr(text_config, "max_position_embeddings", None)
        self.context_length = min(card.context_length, configured_context or card.context_length)
        # Length of the logits vectors (the output layer may be padded past the tokenizer).
        self.vocab_size = int(getattr(text_config, "vocab_size", None) or len(tokenizer))
        self._cache_pool = KVCachePool(model, device)
        self._vocabulary: TokenVocabulary | None = None
        # Tool-call and thinking markers survive decoding even where they are special tokens.
        self._decode = decode_keeping_markers(tokenizer)

    @classmethod
    def load(
        cls,
        model_dir: Path,
        shard: ShardMetadata,
        device: str = "cpu",
        on_layer_loaded: LayerProgressCallback | None = None,
        weight_dtype: WeightDtype | None = None,
    ) -> TorchEngine:
        """Load the shard's weights and the tokenizer from an HF-format directory.

        Args:
            model_dir: directory from `exo.download.pypi_gguf.prepare_model`.
            shard: the part of the model to hold; a multi-rank shard needs the process
                group initialised first (`distributed.init_group`).
            device: torch device string ("cpu", "cuda", "cuda:1").
            on_layer_loaded: progress as (decoder layers loaded, layers in the shard).
            weight_dtype: how the linear layers' weights (decoder layers and LM head) are
                held: "float32" as loaded, or weight-only "int8" (per channel) / "int4"
                (group-wise) quantized layer by layer while loading (CPU only). None:
                "int4" on CPU (`DEFAULT_CPU_WEIGHT_DTYPE`), "float32" elsewhere.
                `exo.shared.models.memory` sizes each format from the card.

        Raises:
            UnsupportedArchitectureError (a ValueError): no family file for the model.
            ValueError: the directory lacks tensors, a tokenizer or an EOS token; an unknown
                `weight_dtype`, or a quantized one on a non-CPU device.
        """
        if shard.world_size > 1:  # the other ranks' process group must already exist
            from exo.worker.engines.torch.distributed_engine import DistributedTorchEngine

            return DistributedTorchEngine.load(
                model_dir, shard, device, on_layer_loaded, weight_dtype
            )
        started = time.perf_counter()
        parts = load_parts(model_dir, shard, device, weight_dtype, on_layer_loaded)
        engine = cls(
            parts.model, parts.tokenizer, shard.model_card, parts.device,
            parts.eos_token_ids, parts.weight_dtype,
        )  # fmt: skip
        elapsed = time.perf_counter() - started
        logger.info(
            "loaded {} ({} weights) in {:.1f} s",
            shard.model_card.model_id,
            parts.weight_dtype,
            elapsed,
        )
        return engine

    def serve_forever(self) -> None:
        """Ranks > 0 of a multi-rank shard serve rank 0 here (`DistributedTorchEngine`)."""
        raise RuntimeError("a single-rank engine has no rank 0 to serve")

    def shutdown(self) -> None:
        """Rank 0 of a multi-rank shard releases the other ranks; nothing to do here."""

    @property
    def has_chat_template(self) -> bool:
        """False for a base model, whose tokenizer has no chat template (raw prompts only)."""
        return getattr(self.tokenizer, "chat_template", None) is not None

    def warmup(self) -> None:
        """Run one short greedy generation so kernels, caches and allocator are warm
        (through the chat template when the model has one, else as a raw prompt)."""
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

    def render_prompt(self, params: TextGenerationTaskParams) -> RenderedPrompt:
        """The request's conversation through the chat template (tools, tool history and
        thinking flags included), ending with the assistant's turn; a raw prompt as it is.

        Raises:
            ValueError: the model has no chat template (a conversation sent to a base
                model), the template refuses the conversation (e.g. roles that do not
                alternate), or an empty raw prompt for a model without a BOS token.
        """
        return render_prompt(self.tokenizer, params)

    def encode_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Token ids of a plain chat-templated conversation (no tools), ending with the
        assistant's turn."""
        params = TextGenerationTaskParams(
            model=ModelId(self.card.model_id), messages=tuple(messages)
        )
        return self.render_prompt(params).token_ids

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
        """The request's penalties, logit bias, constraint and sampler.

        Raises:
            ValueError: a forced tool call without tools to offer; a logit bias for a
                token id outside the vocabulary.
        """
        penalties: TokenPenalties | None = None
        if sampling.has_penalties:
            penalties = TokenPenalties(sampling, self.vocab_size, self.device)
            penalties.observe_prompt(prompt_ids)
        bias = (
            LogitBias(params.logit_bias, self.vocab_size, self.device)
            if params.logit_bias
            else None
        )
        constraint: TokenConstraint | None = None
        if params.forces_tool_call:
            constraint = tool_call_constraint(
                params.offered_tools, self.vocabulary, self.eos_token_ids
            )
        elif params.response_format == "json_object":
            constraint = json_object_constraint(self.vocabulary, self.eos_token_ids)
        elif params.response_format == "json_schema":
            assert params.json_schema is not None  # TextGenerationTaskParams checks it
            constraint = json_schema_constraint(
                params.json_schema, self.vocabulary, self.eos_token_ids
            )
        return TokenChooser(Sampler(sampling, self.device), penalties, constraint, bias)

    def token_logprob(self, logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
        """The chosen token's log probability (and the `top_n` likeliest alternatives).

        Args:
            logits: `[vocab]` raw scores of the position (before penalties and filters).
            token_id: the chosen token.
            top_n: alternatives to report (0: none).
        """
        step = step_logprobs(logits, token_id, top_n)
        vocabulary = self.vocabulary
        top = tuple(
            TopLogprob(
                token=vocabulary.text(candidate),
                token_id=candidate,
                logprob=logprob,
                bytes=tuple(vocabulary.token_bytes[candidate]),
            )
            for candidate, logprob in zip(step.top_ids, step.top_logprobs, strict=True)
        )
        return TokenLogprob(
            token=vocabulary.text(token_id), token_id=token_id, logprob=step.logprob,
            bytes=tuple(vocabulary.token_bytes[token_id]), top_logprobs=top,
        )  # fmt: skip

    def _prompt_and_budget(
        self, params: TextGenerationTaskParams, prompt: RenderedPrompt | None
    ) -> tuple[list[int], int]:
        """The prompt's token ids and how many tokens may be generated after them
        (`max_tokens`, capped by the room left in the context).

        Raises:
            PromptTooLongError: the prompt leaves no room for a generated token.
            ValueError: the chat template refuses the conversation.
        """
        prompt_ids = (prompt or self.render_prompt(params)).token_ids
        room = self.context_length - len(prompt_ids)
        if room < 1:
            raise PromptTooLongError(
                f"the prompt is {len(prompt_ids)} tokens; the model's context is "
                f"{self.context_length} tokens, leaving no room for a reply"
            )
        return prompt_ids, room if params.max_tokens is None else min(params.max_tokens, room)

    def generate(
        self, params: TextGenerationTaskParams, prompt: RenderedPrompt | None = None
    ) -> Generator[GeneratedPiece, None, None]:
        """Stream the completion of a chat request (`prompt`: its `render_prompt`, when the
        caller already rendered it).

        Yields one piece per token where possible. The last piece carries `finish_reason`
        ("stop" on EOS, a stop string or a completed constrained document (`response_format`
        "json_object" or "json_schema", a forced tool call), "length" at `max_tokens` or the
        context limit)
        and `usage` (completion tokens count every sampled token, EOS included). With
        `params.logprobs` every piece carries one `TokenLogprob` per token id. The text
        never ends inside a character: bytes of one left unfinished when generation ends
        are dropped from the text (their tokens still count, their logprobs keep the
        exact bytes).

        Raises:
            PromptTooLongError: the prompt leaves no room for a generated token (raised on
                the first `next()`).
            ValueError: the chat template refuses the conversation (first `next()`).
        """
        prompt_ids, max_new_tokens = self._prompt_and_budget(params, prompt)
        sampling = resolve_sampling_params(params, self.card.sampling_defaults)
        chooser = self.token_chooser(params, sampling, prompt_ids)
        top_logprobs = params.top_logprobs if params.logprobs else None
        detokenizer = StreamingDetokenizer(self._decode, prompt_ids)
        stop_matcher = StopSequenceMatcher(params.stop)
        session = self._cache_pool.open(len(prompt_ids) + max_new_tokens)
        try:
            yield from self._generate_tokens(
                session, prompt_ids, max_new_tokens, chooser, top_logprobs, detokenizer,
                stop_matcher,
            )  # fmt: skip
        finally:
            session.close()

    def _generate_tokens(
        self,
        session: DecodeSession,
        prompt_ids: list[int],
        max_new_tokens: int,
        chooser: TokenChooser,
        top_logprobs: int | None,
        detokenizer: StreamingDetokenizer,
        stop_matcher: StopSequenceMatcher,
    ) -> Iterator[GeneratedPiece]:
        """The decode loop; `top_logprobs` None means no logprobs (else that many
        alternatives per token)."""
        logits = session.prefill(prompt_ids)  # [vocab]
        completion_tokens = 0
        pending_ids: list[int] = []  # tokens whose text has not been emitted yet
        pending_logprobs: list[TokenLogprob] = []  # their logprobs, when asked for
        finish_reason: FinishReason = "length"
        final_text = ""
        stop_sequence: str | None = None
        while True:
            token = chooser.choose(logits)
            completion_tokens += 1
            if token in self.eos_token_ids:
                final_text, stop_sequence = _finish_text(detokenizer, stop_matcher)
                finish_reason = "stop"
                break
            chooser.observe(token)
            pending_ids.append(token)
            if top_logprobs is not None:
                pending_logprobs.append(self.token_logprob(logits, token, top_logprobs))
            text = detokenizer.add_token(token)
            if text:
                check = stop_matcher.feed(text)
                if check.stopped:
                    final_text = without_incomplete_end(check.text)
                    finish_reason, stop_sequence = "stop", check.stop
                    break
                if check.text:
                    yield GeneratedPiece(
                        check.text, tuple(pending_ids), None, None, tuple(pending_logprobs)
                    )
                    pending_ids, pending_logprobs = [], []
            if chooser.is_complete:  # the constrained document is whole: nothing may follow
                final_text, stop_sequence = _finish_text(detokenizer, stop_matcher)
                finish_reason = "stop"
                break
            if completion_tokens >= max_new_tokens:
                final_text, stop_sequence = _finish_text(detokenizer, stop_matcher)
                finish_reason = "stop" if stop_sequence is not None else "length"
                break
            logits = session.decode(token)
        usage = Usage(prompt_tokens=len(prompt_ids), completion_tokens=completion_tokens)
        yield GeneratedPiece(
            final_text, tuple(pending_ids), finish_reason, usage, tuple(pending_logprobs),
            stop_sequence,
        )  # fmt: skip


def _finish_text(
    detokenizer: StreamingDetokenizer, stop_matcher: StopSequenceMatcher
) -> tuple[str, str | None]:
    """The text still held back when generation ends, and the stop string it completes (None
    when it completes none). The text never ends with the bytes of an unfinished character
    (`without_incomplete_end`)."""
    check = stop_matcher.feed(detokenizer.flush())
    if check.stopped:
        return without_incomplete_end(check.text), check.stop
    return check.text + stop_matcher.flush(), None
