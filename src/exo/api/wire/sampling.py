"""The sampling fields of every dialect, mapped once onto `TextGenerationTaskParams`.

Each dialect names its fields its own way (`max_output_tokens`, `num_predict`,
`stop_sequences`, Ollama's `options`); it reads them off its request and passes them to
`sampling_fields`, which applies the rules they all share. Chat Completions and legacy
Completions share their field names too: `openai_sampling_fields`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from exo.api.wire.errors import InvalidRequestError

if TYPE_CHECKING:  # the request type only: the dialects import this module
    from exo.api.openai_chat.wire_types import OpenAIGenerationRequest


def sampling_fields(
    *,
    max_tokens: int | None,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    stop: str | Sequence[str] | None = None,
    min_p: float | None = None,
    seed: int | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    repetition_penalty: float | None = None,
    speculative: bool | Literal["auto"] | None = None,
) -> dict[str, Any]:
    """The `TextGenerationTaskParams` fields of a request's sampling settings.

    Fields the client left out stay None (the model card's defaults apply); penalties it
    left out are 0. An empty stop string would match before the first token; clients send
    `""` to mean "no stop", so it is dropped rather than refused. `speculative` is exo's
    extension of every dialect (None: the node's default).
    """
    sequences = [stop] if isinstance(stop, str) else (stop or ())
    return {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "min_p": min_p,
        "seed": seed,
        "stop": tuple(sequence for sequence in sequences if sequence),
        "presence_penalty": presence_penalty or 0.0,
        "frequency_penalty": frequency_penalty or 0.0,
        "repetition_penalty": repetition_penalty,
        "speculative": speculative,
    }


# Fields the two OpenAI-shaped requests name as the internal request does.
_OPENAI_SAMPLING_FIELDS = (
    "temperature", "top_p", "min_p", "seed", "stop", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "speculative",
)  # fmt: skip


def openai_sampling_fields(
    request: OpenAIGenerationRequest, max_tokens: int | None
) -> dict[str, Any]:
    """`sampling_fields` of the two OpenAI-shaped requests, whose sampling fields they
    share (`OpenAIGenerationRequest`, vLLM's `top_k`, `min_p` and `repetition_penalty`
    included); `max_tokens` as the dialect reads it.

    Raises:
        InvalidRequestError: `stream_options` on a request that does not stream (OpenAI
            answers it with this 400 and wording rather than ignoring it).
    """
    if request.stream_options is not None and not request.stream:
        raise InvalidRequestError(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            "stream_options",
        )
    shared = {name: getattr(request, name) for name in _OPENAI_SAMPLING_FIELDS}
    return sampling_fields(max_tokens=max_tokens, top_k=vllm_top_k(request.top_k), **shared)


def vllm_top_k(top_k: int | None) -> int | None:
    """The internal `top_k` of an OpenAI-shaped route's (vLLM's) `top_k`: its -1 means no
    top-k filter, which is 0 internally (`exo.api.wire.request_model.VllmTopK`)."""
    return 0 if top_k == -1 else top_k


_TOKEN_ID = re.compile(r"[0-9]{1,10}")


def logit_bias_from_wire(bias: Mapping[str, float] | None, param: str) -> dict[int, float]:
    """A wire `logit_bias` (token ids as JSON object keys, OpenAI's form) as the internal
    token id -> bias map. The range of each bias and whether an id is inside the model's
    vocabulary are checked later (`TextGenerationTaskParams`, `start_generation`).

    Raises:
        InvalidRequestError: a key that is not a token id (a non-negative integer in
            decimal), blaming `param`.
    """
    converted: dict[int, float] = {}
    for key, value in (bias or {}).items():
        if not _TOKEN_ID.fullmatch(key):
            raise InvalidRequestError(
                f"{param} keys must be token ids (non-negative integers written as strings, "
                f'such as "7042"); got {key[:40]!r}',
                param,
            )
        converted[int(key)] = value
    return converted
