"""OpenAI legacy Completions <-> internal types: this module turns a `POST /v1/completions`
body into a raw-prompt `TextGenerationTaskParams`; `response` turns one
generation's chunks into `text_completion` SSE chunks or one `Completion`. The route does
the I/O around them.
"""

from __future__ import annotations

import uuid

from exo.api.openai_completions.wire_types import CompletionRequest
from exo.api.serving.request_checks import build_task_params
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.sampling import logit_bias_from_wire, openai_sampling_fields
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import TextGenerationTaskParams

COMPLETION_ID_PREFIX = "cmpl-"


def new_completion_id() -> str:
    """A fresh id in OpenAI's legacy format (`cmpl-` + 32 hex digits)."""
    return f"{COMPLETION_ID_PREFIX}{uuid.uuid4().hex}"


def to_task_params(request: CompletionRequest) -> TextGenerationTaskParams:
    """Convert a Completions request into an internal raw-prompt request.

    The prompt reaches the model as it is (no chat template, with the BOS token the
    tokenizer adds itself). `logprobs` n asks for the sampled tokens' log probabilities
    and n alternatives per position. Sampling fields the client left out stay None (the
    model card's defaults apply); `max_tokens` defaults to 16 as at OpenAI.

    Args:
        request: A schema-valid body.

    Returns:
        The internal params, `prompt` set and `messages` empty.

    Raises:
        InvalidRequestError: what exo does not do (`suffix` (fill-in-the-middle), `n` or
            `best_of` > 1, several prompts or token-id prompts, `echo` together with
            `logprobs`), a `logit_bias` key that is not a token id, or field values the
            internal request refuses.
    """
    prompt = _prompt_text(request)
    _refuse_unsupported_features(request)
    return build_task_params(
        model=ModelId(request.model),
        prompt=prompt,
        **openai_sampling_fields(request, max_tokens=request.max_tokens),
        stream=request.stream,
        logit_bias=logit_bias_from_wire(request.logit_bias, "logit_bias"),
        logprobs=request.logprobs is not None,
        top_logprobs=request.logprobs or 0,
    )


def _prompt_text(request: CompletionRequest) -> str:
    prompt = request.prompt
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise InvalidRequestError("prompt must not be an empty list", "prompt")
    if all(isinstance(item, str) for item in prompt):
        if len(prompt) > 1:
            raise InvalidRequestError(
                f"a batch of {len(prompt)} prompts is not supported: exo completes one "
                "prompt per request; send one request per prompt",
                "prompt",
            )
        text = prompt[0]
        assert isinstance(text, str)
        return text
    raise InvalidRequestError(
        "a prompt given as token ids is not supported; send the prompt as text", "prompt"
    )


def _refuse_unsupported_features(request: CompletionRequest) -> None:
    if request.suffix:
        raise InvalidRequestError(
            "suffix (text after the completion, for fill-in-the-middle) is not supported; "
            "send the prompt alone",
            "suffix",
        )
    if request.n is not None and request.n > 1:
        raise InvalidRequestError(
            f"n={request.n} is not supported: exo returns exactly one choice per request; "
            "send several requests (with different seeds) instead",
            "n",
        )
    if request.best_of is not None and request.best_of > 1:
        raise InvalidRequestError(
            f"best_of={request.best_of} is not supported: exo generates one completion per request",
            "best_of",
        )
    if request.echo and request.logprobs is not None:
        raise InvalidRequestError(
            "echo together with logprobs is not supported: exo reports log probabilities "
            "of generated tokens only, not of the prompt; drop one of the two",
            "echo",
        )
