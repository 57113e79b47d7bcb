"""The engine of an encoder card (`exo.shared.models.architectures.ENCODER_ARCHITECTURES`:
BERT, XLM-RoBERTa, NomicBERT, the bge cross-encoder, EmbeddingGemma): what the runner calls on
`TorchEngine`, answered by exo's own encoder forward (`embedding.encoder_models`).

Embeddings and reranking only: the whole model on one rank, no KV cache (`kv_cache_tokens`
0, as placement reserved none: `exo.shared.models.memory`), no decoding. A generation that
reaches it (the API refuses chat to an embedding-only card first) fails as a ValueError, a
400 naming the capability.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, NoReturn

from loguru import logger

from exo.chat_protocol.prompt import RenderedPrompt
from exo.shared.types.models import ModelCard
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.batching.scheduler import StepOutput
from exo.worker.engines.torch.embedding.encoder_models import (
    EncoderEmbeddingModel,
    load_encoder_model,
)

# What `warmup` embeds (and, for a reranker, scores against itself): any short text.
WARMUP_TEXT = "Hello"


class EncoderEngine:
    """An encoder card's engine on one rank.

    Attributes:
        card: the model's card.
        tokenizer: the model folder's tokenizer.
        max_concurrent_requests: what the runner reports (embedding tasks batch together
            regardless; no generation runs here).
        kv_cache_tokens: 0 (no KV cache).
    """

    kv_cache_tokens = 0

    def __init__(
        self, model: EncoderEmbeddingModel, card: ModelCard, max_concurrent_requests: int = 1
    ) -> None:
        self._model = model
        self.card = card
        self.tokenizer: Any = model.tokenizer
        self.max_concurrent_requests = max_concurrent_requests

    @classmethod
    def load(
        cls, model_dir: Path, shard: ShardMetadata, max_concurrent_requests: int = 1
    ) -> EncoderEngine:
        """Load the encoder (or reranker) in `model_dir` whole, with the card's Matryoshka
        widths.

        Raises:
            ValueError: `shard` is one rank of a split instance (placement never splits an
                encoder), or the folder lacks a file or tensor the model needs
                (`EmbeddingModelError`, named).
        """
        card = shard.model_card
        if shard.world_size > 1:
            raise ValueError(
                f"{card.model_id} is an encoder model: it runs whole on one node, not as rank "
                f"{shard.device_rank} of {shard.world_size}"
            )
        started = time.perf_counter()
        model = load_encoder_model(model_dir, card.matryoshka_dimensions)
        logger.info(
            "loaded encoder {} ({} MiB float32) in {:.1f} s",
            card.model_id,
            model.weight_bytes // 2**20,
            time.perf_counter() - started,
        )
        return cls(model, card, max_concurrent_requests)

    def weight_bytes(self) -> int:
        """Bytes of the weights held (float32)."""
        return self._model.weight_bytes

    def embedding_backend(self) -> EncoderEmbeddingModel:
        """The model as the runner's `EmbeddingBackend`."""
        return self._model

    def warmup(self) -> None:
        """Embed one short text (a reranker: score it against itself), so the first request
        does not pay for first-call allocations."""
        self._model.embed(self._model.tokenize([WARMUP_TEXT]))
        self._model.score_pairs([(WARMUP_TEXT, WARMUP_TEXT)])

    def _refuse(self) -> ValueError:
        capability = " / ".join(self.card.capabilities)
        return ValueError(
            f"{self.card.model_id} has the {capability} capability only: it does not generate "
            "text (use /v1/embeddings or /v1/rerank)"
        )

    def render_prompt(self, params: TextGenerationTaskParams) -> NoReturn:
        """Raises: ValueError, always (an encoder does not generate)."""
        raise self._refuse()

    def submit(
        self,
        params: TextGenerationTaskParams,
        prompt: RenderedPrompt | None = None,
        request_id: str | None = None,
    ) -> NoReturn:
        """Raises: ValueError, always (an encoder does not generate)."""
        raise self._refuse()

    def step(self) -> list[StepOutput]:
        """No generation ever runs: nothing to step."""
        return []

    def store_finished(self) -> int:
        """No KV cache: nothing to store."""
        return 0

    def cancel(self, request_id: str) -> bool:
        """No generation to cancel (embedding tasks are cancelled by the runner)."""
        return False

    def kv_cache_usage(self) -> tuple[int, int, int] | None:
        """None: no KV cache."""
        return None

    def serve_forever(self) -> None:
        """Raises: RuntimeError (an encoder has no other ranks to serve)."""
        raise RuntimeError("an encoder engine runs on one rank: it has no rank 0 to serve")

    def shutdown(self) -> None:
        """Nothing to release (one rank)."""
