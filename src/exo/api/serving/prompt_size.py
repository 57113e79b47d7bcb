"""A bound on a generation's size, checked before anything is placed or sent.

A generation's whole request (its conversation or raw prompt, tools and options) travels to
the master inside a `GenerateText` command and is kept in the replicated event log inside a
`TaskCreated` event, on every node. A prompt far longer than the model's context cannot be
generated from (the engine refuses it), yet before this check it still went through the
cluster: a ~60 MB prompt stalled the master and grew a node to 7.8 GB.

So a request whose serialized size (UTF-8 JSON of `TextGenerationTaskParams`) exceeds
`MAX_PROMPT_BYTES_PER_TOKEN` bytes per token of the model's context length is refused with
a 400 (`context_length_exceeded`), and no request exceeds `MAX_GENERATION_BYTES` whatever the
context. The bound is far above any prompt that fits: English text averages about 4 bytes
per token, CJK text about 3 (one character, 3 UTF-8 bytes, per token), but vocabularies hold
tokens that are long runs of whitespace or punctuation (SmolLM2's: runs of up to 81 `#`,
`=`, `-` or spaces; a prompt of separator lines averaged 48 bytes a token) and JSON escaping
doubles whitespace (`\t`, `\n`): 256 bytes per token leaves room for both (32 refused a
6,500-token prompt of separator lines that fits an 8,192-token context). Prompts between the
real limit and this bound still reach the engine, which counts their tokens exactly and
refuses them (400) as before.

Images (`ChatMessage.images`, base64 in the JSON) are left out of the per-token bound: the
cards give no tokens-per-image figure, so an image counts as no tokens here, and the engine,
which knows how many tokens each image becomes, refuses a prompt its images overfill. They
count in the absolute `MAX_GENERATION_BYTES`, which they would otherwise push past the
master's own refusal (an image at `--image-max-bytes`' default fits it).
"""

from __future__ import annotations

from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.commands import MAX_GENERATION_BYTES
from exo.shared.types.models import ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams

MAX_PROMPT_BYTES_PER_TOKEN = 256
"""Bytes of request per token of context beyond which no prompt can fit (see above)."""


def prompt_byte_limit(card: ModelCard | None) -> int:
    """The largest serialized request, in bytes, accepted for a model with `card` (the
    absolute `MAX_GENERATION_BYTES` for a model whose card is unknown)."""
    if card is None:
        return MAX_GENERATION_BYTES
    return min(MAX_GENERATION_BYTES, card.context_length * MAX_PROMPT_BYTES_PER_TOKEN)


def image_json_bytes(params: TextGenerationTaskParams) -> int:
    """Bytes the request's images take in its JSON (base64: 4 characters per 3 bytes)."""
    return sum(
        4 * -(-len(image.data) // 3) for message in params.messages for image in message.images
    )


def check_prompt_size(params: TextGenerationTaskParams, card: ModelCard | None) -> None:
    """Refuse a request too large to fit the model's context (see the module docstring).

    Raises:
        InvalidRequestError: the request's serialized size is over `prompt_byte_limit`
            (400, param `messages` or `prompt`, code `context_length_exceeded`).
    """
    limit = prompt_byte_limit(card)
    size = len(params.__pydantic_serializer__.to_json(params))
    image_bytes = image_json_bytes(params)
    if image_bytes and size > MAX_GENERATION_BYTES:
        raise InvalidRequestError(
            f"the request is {size} bytes with its images ({image_bytes} bytes of them as "
            f"base64); a generation carries at most {MAX_GENERATION_BYTES} bytes through "
            "the cluster: send fewer or smaller images",
            param="prompt" if params.prompt is not None else "messages",
            code="request_too_large",
        )
    size -= image_bytes
    if size <= limit:
        return
    context = f"a context of {card.context_length} tokens" if card is not None else "a context"
    raise InvalidRequestError(
        f"the request is {size} bytes; {params.model} has {context}, and no request over "
        f"{limit} bytes can fit in it (at most {MAX_PROMPT_BYTES_PER_TOKEN} bytes per token, "
        f"{MAX_GENERATION_BYTES} bytes in all): shorten the prompt",
        param="prompt" if params.prompt is not None else "messages",
        code="context_length_exceeded",
    )
