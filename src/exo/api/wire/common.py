"""What every dialect's adapter does alike with the end of a chunk stream: failures and
cancellations as errors, an `ErrorChunk` as the right `ApiError`, usage when a producer left
it out."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal

from exo.api.wire.errors import ApiError, GenerationError, InvalidRequestError, NoCapacityError
from exo.shared.types.chunks import ErrorChunk, Usage
from exo.shared.types.text_generation import ChatMessage

# OpenAI's server-sent events (Chat Completions and legacy Completions): `data: <json>`
# lines, ended by `data: [DONE]`.
SSE_DONE = "data: [DONE]\n\n"


def openai_sse(data: str) -> str:
    """One OpenAI SSE event carrying `data` (a JSON text)."""
    return f"data: {data}\n\n"


def logprob_token(token: str, token_bytes: Sequence[int], prefix: str = "") -> str:
    """A logprobs entry's token string as OpenAI writes it: the token's text, unless its
    bytes are not whole UTF-8 characters (a byte-level BPE token inside a character,
    whose text alone is only "\ufffd"): then `prefix` and its bytes escaped as `\\xNN`,
    printable ASCII as itself (Chat Completions and Responses: `"\\xf0\\x9f"`, next to
    the exact `bytes`; legacy Completions, `prefix="bytes:"`: `"bytes:\\xf0\\x9f"`).

    Args:
        token: the token decoded alone.
        token_bytes: its exact output bytes (empty when unknown: `token` is kept).
        prefix: written before the escaped bytes.
    """
    if not token_bytes:
        return token
    raw = bytes(token_bytes)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return prefix + "".join(
            chr(byte) if 0x20 <= byte < 0x7F and byte != 0x5C else f"\\x{byte:02x}" for byte in raw
        )
    return token


def vllm_top_k(top_k: int | None) -> int | None:
    """The internal `top_k` of an OpenAI-shaped route's (vLLM's) `top_k`: its -1 means no
    top-k filter, which is 0 internally (`exo.api.wire.request_model.VllmTopK`)."""
    return 0 if top_k == -1 else top_k


def unfinished_generation_error(reason: Literal["error", "cancelled"]) -> GenerationError:
    """The error for a generation that did not finish. No dialect has a value for a
    cancelled generation, and reporting "stop" would make a truncated answer look
    complete."""
    if reason == "error":
        return GenerationError("generation failed", code="generation_failed")
    return GenerationError(
        "generation was cancelled before it finished", code="generation_cancelled"
    )


def error_chunk_error(chunk: ErrorChunk, param: str | None) -> ApiError:
    """The `ApiError` an `ErrorChunk` stands for: a 400 blaming `param` (the dialect's name
    for the conversation) when the request was at fault, a 503 when its instance became
    unavailable, else a generation failure."""
    if chunk.status_code == 400:
        return InvalidRequestError(chunk.error_message, param=param, code=chunk.error_code)
    if chunk.status_code == 503:
        return NoCapacityError(chunk.error_message, code=chunk.error_code)
    return GenerationError(chunk.error_message, code=chunk.error_code or "generation_failed")


def ended_without_finish() -> GenerationError:
    return GenerationError("generation stream ended without a finish", code="generation_failed")


def final_usage(usage: Usage | None, counted_completion_tokens: int) -> Usage:
    """The last chunk carries usage by contract; should a producer omit it, report what the
    stream itself shows (prompt tokens are then unknown, so 0) rather than fail."""
    if usage is None:
        return Usage(prompt_tokens=0, completion_tokens=counted_completion_tokens)
    return usage


def check_tool_results_answer_calls(messages: Sequence[ChatMessage], param: str) -> None:
    """Every tool result must answer a call an earlier assistant turn made (OpenAI and
    Anthropic refuse an orphan result with a 400 too).

    Raises:
        InvalidRequestError: naming the unanswered id, blaming `param`.
    """
    called: set[str] = set()
    for message in messages:
        if message.role == "assistant":
            called.update(call.id for call in message.tool_calls)
        elif (
            message.role == "tool"
            and message.tool_call_id is not None
            and message.tool_call_id not in called
        ):
            raise InvalidRequestError(
                f"a tool result answers the call {message.tool_call_id!r}, but no earlier "
                "assistant turn made a call with that id",
                param,
            )


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
