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
per token, CJK text about 3 (one character, 3 UTF-8 bytes, per token), and JSON escaping at
most doubles code; 32 bytes per token leaves room for tokenizers whose tokens are long runs
of whitespace or punctuation. Prompts between the real limit and this bound still reach the
engine, which counts their tokens exactly and refuses them (400) as before.
"""

from __future__ import annotations

from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.commands import MAX_GENERATION_BYTES
from exo.shared.types.models import ModelCard
from exo.shared.types.text_generation import TextGenerationTaskParams

MAX_PROMPT_BYTES_PER_TOKEN = 32
"""Bytes of request per token of context beyond which no prompt can fit (see above)."""


def prompt_byte_limit(card: ModelCard | None) -> int:
    """The largest serialized request, in bytes, accepted for a model with `card` (the
    absolute `MAX_GENERATION_BYTES` for a model whose card is unknown)."""
    if card is None:
        return MAX_GENERATION_BYTES
    return min(MAX_GENERATION_BYTES, card.context_length * MAX_PROMPT_BYTES_PER_TOKEN)


def check_prompt_size(params: TextGenerationTaskParams, card: ModelCard | None) -> None:
    """Refuse a request too large to fit the model's context (see the module docstring).

    Raises:
        InvalidRequestError: the request's serialized size is over `prompt_byte_limit`
            (400, param `messages` or `prompt`, code `context_length_exceeded`).
    """
    limit = prompt_byte_limit(card)
    size = len(params.__pydantic_serializer__.to_json(params))
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
