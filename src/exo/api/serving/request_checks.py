"""The internal request built from a dialect's fields, and the checks every generation
passes before it is sent to the cluster (model card, serializability, vocabulary)."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError
from pydantic_core import PydanticSerializationError

from exo.api.wire.errors import InvalidRequestError, describe_validation_errors
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.models import ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams


def build_task_params(**fields: Any) -> TextGenerationTaskParams:
    """`TextGenerationTaskParams(**fields)`, with a violated constraint (a negative
    `max_tokens`, a `tool_choice` naming an unknown tool, ...) turned into a 400.

    Raises:
        InvalidRequestError: the fields do not make a valid request; `param` names the
            internal field at fault (adapters that spell it differently catch and re-raise).
    """
    try:
        return TextGenerationTaskParams(**fields)
    except ValidationError as error:
        message, param = describe_validation_errors(error.errors())
        raise InvalidRequestError(message, param) from None


def check_chat_template(params: TextGenerationTaskParams, card: ModelCard | None) -> None:
    """Refuse a conversation for a base model (its card says it has no chat template): it
    can only continue a raw prompt.

    Raises:
        InvalidRequestError: naming the model and where to send a raw prompt instead.
    """
    if params.is_raw or card is None or card.has_chat_template:
        return
    raise InvalidRequestError(
        f"'{params.model}' is a base model: it has no chat template, so it cannot answer a "
        "conversation; send it a raw prompt to continue instead: POST /v1/completions "
        '(OpenAI) or /ollama/api/generate with "raw": true (Ollama)',
        param="model",
        code="base_model",
    )


def check_serializable(params: TextGenerationTaskParams | EmbeddingTaskParams) -> None:
    """Refuse what cannot travel to the runner: strings with lone UTF-16 surrogates (JSON
    text from a client may hold `\ud800`, which UTF-8 cannot encode) and tool schemas
    nested deeper than the serializer allows.

    Raises:
        InvalidRequestError: with the reason.
    """
    try:
        params.model_dump_json()
    except PydanticSerializationError as error:
        if "surrogates not allowed" in str(error):
            raise InvalidRequestError(
                "the request contains a lone UTF-16 surrogate (such as \\ud800), which is "
                "not valid Unicode text; send well-formed strings"
            ) from None
        if "depth exceeded" in str(error):
            raise InvalidRequestError(
                "a value in the request (such as a tool's parameter schema) is nested too deeply"
            ) from None
        raise InvalidRequestError(f"the request cannot be processed: {error}") from None


def check_logit_bias(params: TextGenerationTaskParams, card: ModelCard | None) -> None:
    """Refuse biased token ids outside the model's vocabulary (as its card gives it; the
    engine checks again against the loaded model)."""
    if not params.logit_bias or card is None:
        return
    outside = sorted(token_id for token_id in params.logit_bias if token_id >= card.vocab_size)
    if outside:
        raise InvalidRequestError(
            f"logit_bias names token ids outside the vocabulary of '{params.model}' "
            f"({card.vocab_size} tokens, ids 0 to {card.vocab_size - 1}): "
            f"{', '.join(str(token_id) for token_id in outside[:5])}",
            "logit_bias",
        )
