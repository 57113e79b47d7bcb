"""Count a request's prompt tokens on the API node, exactly as the engine will see them:
the same `render_prompt` over the model's own tokenizer, loaded from this node's models
directory (once per model, in a worker thread).

Dialect-neutral: any route with a "count tokens" endpoint (Anthropic's
`/v1/messages/count_tokens`) converts its request to `TextGenerationTaskParams` and calls
`count_prompt_tokens`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.model_lookup import card_of, known_model_ids
from exo.api.serving.request_checks import check_chat_template, check_serializable
from exo.api.wire.errors import InvalidRequestError, ModelNotFoundError, NoCapacityError
from exo.chat_protocol import tokenizer_loading
from exo.chat_protocol.image_tokens import ImageTokens
from exo.chat_protocol.prompt import render_prompt
from exo.download.locations import ModelLocations, candidates, directory_name
from exo.download.pypi_gguf import TOKENIZER_FILES, model_directory_name
from exo.shared.constants import models_dir
from exo.shared.types.common import ModelId
from exo.shared.types.models import HuggingFaceSource, LocalDirectorySource, ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams

TokenizerLoader = Callable[[Path], Any]


def load_tokenizer(directory: Path) -> Any:
    """The tokenizer in `directory`, loaded as the engine loads it (`tokenizer_loading`:
    Kimi's TikToken files included)."""
    return tokenizer_loading.load_tokenizer(directory)


def model_files_directory(
    model_id: ModelId,
    card: ModelCard | None,
    models_directory: Path,
    environment: Mapping[str, str] | None = None,
) -> Path:
    """Where this node keeps (or would keep) the files of `model_id`: the card's own
    directory for local models, else the first copy holding a tokenizer among
    `<models_directory>/<org>--<name>` and the other places a model is used in place
    (`EXO_MODELS_DIRS`, `EXO_MODELS_READ_ONLY_DIRS`, a Hub model's Hugging Face cache
    snapshot: `exo.download.locations`), else `<models_directory>/<org>--<name>`."""
    if card is not None and isinstance(card.source, LocalDirectorySource):
        return Path(card.source.path).expanduser()
    default = models_directory / model_directory_name(model_id)
    locations = ModelLocations.from_environment(models_directory, environment)
    if card is not None and isinstance(card.source, HuggingFaceSource):
        places = candidates(locations, model_id, card.source.repo_id, card.source.revision)
    else:
        places = [
            root / directory_name(model_id) for root in (*locations.writable, *locations.read_only)
        ]
    for place in (default, *places):
        if any((place / name).is_file() for name in TOKENIZER_FILES):
            return place
    return default


class TokenizerCache:
    """Tokenizers by model id, each loaded once in a worker thread (loading takes up to
    seconds and must not block the event loop)."""

    def __init__(self, loader: TokenizerLoader = load_tokenizer) -> None:
        self._loader = loader
        self._tokenizers: dict[ModelId, Any] = {}
        self._locks: dict[ModelId, anyio.Lock] = {}

    async def get(self, model_id: ModelId, directory: Path) -> Any:
        """The tokenizer of `model_id`, loading it from `directory` on first use.

        Raises:
            NoCapacityError: `directory` holds no tokenizer (the model's files are not on
                this node), or loading it failed (503: another node may answer).
        """
        if model_id in self._tokenizers:
            return self._tokenizers[model_id]
        lock = self._locks.setdefault(model_id, anyio.Lock())
        async with lock:  # one load per model even when requests arrive together
            if model_id in self._tokenizers:
                return self._tokenizers[model_id]
            if not any((directory / name).is_file() for name in TOKENIZER_FILES):
                raise NoCapacityError(
                    f"the files of model '{model_id}' are not on this node (no tokenizer in "
                    f"{directory}); count tokens on a node that runs the model, or wait "
                    "until its download finishes",
                    param="model",
                    code="model_files_missing",
                )
            try:
                tokenizer = await anyio.to_thread.run_sync(self._loader, directory)
            except (OSError, ValueError) as error:
                raise NoCapacityError(
                    f"the tokenizer of model '{model_id}' could not be loaded from "
                    f"{directory}: {error}",
                    param="model",
                    code="tokenizer_unavailable",
                ) from None
            self._tokenizers[model_id] = tokenizer
            return tokenizer


TOKENIZERS = TokenizerCache()
"""The node's tokenizer cache (the API lives as long as the process)."""


async def count_prompt_tokens(
    cluster: ClusterClient,
    params: TextGenerationTaskParams,
    *,
    tokenizers: TokenizerCache = TOKENIZERS,
    models_directory: Path | None = None,
) -> int:
    """Number of tokens the engine's prompt for `params` will have.

    Args:
        cluster: For the known models and their cards.
        params: The request (its messages, offered tools and thinking switches are
            rendered; sampling fields are irrelevant).
        tokenizers: The cache to load tokenizers through.
        models_directory: This node's models directory (default: `exo.shared.constants
            .models_dir()`).

    Returns:
        The prompt's token count, chat-template special tokens included.

    Raises:
        ModelNotFoundError: the model is unknown to the cluster (404).
        NoCapacityError: the model's tokenizer is not on this node (503).
        InvalidRequestError: the chat template rejects the conversation, or the model is
            a base model without one (400).
    """
    check_serializable(params)  # the same refusals as a generation
    if params.model not in known_model_ids(cluster):
        raise ModelNotFoundError(f"The model '{params.model}' does not exist")
    check_chat_template(params, card_of(cluster, params.model))
    directory = model_files_directory(
        params.model, cluster.cards.get(params.model), models_directory or models_dir()
    )
    tokenizer = await tokenizers.get(params.model, directory)
    try:
        # A vision model's images count as its image tokens, by each image's width and
        # height (config.json and preprocessor_config.json; None: no config.json here).
        image_tokens = ImageTokens.of_model(directory, tokenizer)
        rendered = await anyio.to_thread.run_sync(render_prompt, tokenizer, params, image_tokens)
    except ValueError as error:
        raise InvalidRequestError(str(error), param="messages") from None
    return len(rendered.token_ids)
