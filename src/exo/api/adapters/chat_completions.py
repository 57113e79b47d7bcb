"""OpenAI Chat Completions <-> internal types. The only module that knows this dialect.

Pure conversions: a wire request becomes `TextGenerationTaskParams`; the internal chunk
stream of one generation becomes either OpenAI's SSE events or one
`ChatCompletionResponse`. Routes do the I/O around them.

A chunk stream ends with the first chunk whose `finish_reason` is set (an `ErrorChunk`
always has one); nothing after it is read. The caller owns the chunk iterator and closes it.

Failure after the HTTP status has been sent is reported in-band, the way vLLM does: one
`data: {"error": {...}}` event in OpenAI's error shape, then `data: [DONE]`. The official
`openai` client raises `APIError` on any event whose JSON has a truthy `error` key (checked
in openai 3.57, `_streaming.Stream.__stream__`), before it reaches `[DONE]`; clients that
ignore unknown events still see a well-terminated stream.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import assert_never

from exo.api.errors import ApiError, GenerationError, InvalidRequestError, openai_error_body_for
from exo.api.types.openai_chat import (
    AssistantContentPart,
    AssistantMessage,
    AudioContentPart,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatFinishReason,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionUsage,
    DeveloperMessage,
    FileContentPart,
    ImageContentPart,
    RefusalContentPart,
    RequestMessage,
    ResponseMessage,
    SystemMessage,
    TextContentPart,
    ToolMessage,
    UserContentPart,
    UserMessage,
)
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams

SSE_DONE = "data: [DONE]\n\n"

# vLLM joins the text parts of one message with a newline; so do we, so that parts written
# as separate paragraphs do not run into each other.
_TEXT_PART_SEPARATOR = "\n"

_NOT_SUPPORTED_YET = "is not supported yet"


def new_completion_id() -> str:
    """A fresh id in OpenAI's format (`chatcmpl-` + 32 hex digits)."""
    return f"chatcmpl-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- request


def to_task_params(request: ChatCompletionRequest) -> TextGenerationTaskParams:
    """Convert a Chat Completions request into the internal generation request.

    Args:
        request: A schema-valid request.

    Returns:
        The internal params; sampling fields the client left out stay None (model card
        defaults apply), `stop` becomes a tuple without empty strings.

    Raises:
        InvalidRequestError: the request asks for something exo does not do (n > 1, tools,
            logprobs, JSON response formats, image/audio/file input) or its fields
            contradict each other (`max_tokens` != `max_completion_tokens`).
    """
    _refuse_unsupported_features(request)
    return TextGenerationTaskParams(
        model=ModelId(request.model),
        messages=tuple(
            _to_chat_message(message, index) for index, message in enumerate(request.messages)
        ),
        max_tokens=_max_tokens(request),
        temperature=request.temperature,
        top_p=request.top_p,
        # vLLM spells "no top-k filter" as -1; internally it is 0.
        top_k=0 if request.top_k == -1 else request.top_k,
        min_p=request.min_p,
        seed=request.seed,
        stop=_stop_sequences(request.stop),
        stream=request.stream,
    )


def _refuse_unsupported_features(request: ChatCompletionRequest) -> None:
    if request.n is not None and request.n > 1:
        raise InvalidRequestError(
            f"n={request.n} is not supported: exo returns exactly one choice per request; "
            "send several requests (with different seeds) instead",
            "n",
        )
    if request.tools:
        raise InvalidRequestError(f"tools {_NOT_SUPPORTED_YET}", "tools")
    if request.functions:
        raise InvalidRequestError(f"functions {_NOT_SUPPORTED_YET}", "functions")
    # "none" and "auto" without tools ask for nothing; anything else demands a tool call.
    if request.tool_choice not in (None, "none", "auto"):
        raise InvalidRequestError(f"tool_choice {_NOT_SUPPORTED_YET}", "tool_choice")
    if request.function_call not in (None, "none", "auto"):
        raise InvalidRequestError(f"function_call {_NOT_SUPPORTED_YET}", "function_call")
    if request.logprobs:
        raise InvalidRequestError(f"logprobs {_NOT_SUPPORTED_YET}", "logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(request, name):  # 0 and absent ask for nothing
            raise InvalidRequestError(f"{name} {_NOT_SUPPORTED_YET}", name)
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequestError(
            f"response_format of type {request.response_format.type!r} {_NOT_SUPPORTED_YET}; "
            "only 'text' is",
            "response_format",
        )


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    # `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    legacy, current = request.max_tokens, request.max_completion_tokens
    if legacy is not None and current is not None and legacy != current:
        raise InvalidRequestError(
            f"max_tokens ({legacy}) and max_completion_tokens ({current}) disagree; "
            "they are the same setting, send only one",
            "max_completion_tokens",
        )
    return current if current is not None else legacy


def _stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    # An empty stop string would match before the first token; clients send `""` to mean
    # "no stop", so it is dropped rather than refused.
    if stop is None:
        return ()
    sequences = [stop] if isinstance(stop, str) else stop
    return tuple(sequence for sequence in sequences if sequence)


def _to_chat_message(message: RequestMessage, index: int) -> ChatMessage:
    param = f"messages[{index}]"
    match message:
        case SystemMessage() | DeveloperMessage():
            return ChatMessage(
                role="system",
                content=_text_content(message.content),
                name=message.name,
            )
        case UserMessage():
            return ChatMessage(
                role="user", content=_user_content(message.content, param), name=message.name
            )
        case AssistantMessage():
            if message.tool_calls:
                raise InvalidRequestError(
                    f"assistant messages with tool_calls are {_NOT_SUPPORTED_YET}",
                    f"{param}.tool_calls",
                )
            return ChatMessage(
                role="assistant",
                content=_assistant_content(message.content, message.refusal),
                name=message.name,
            )
        case ToolMessage():
            return ChatMessage(
                role="tool",
                content=_text_content(message.content),
                tool_call_id=message.tool_call_id,
            )
        case _:
            assert_never(message)


def _text_content(content: str | list[TextContentPart] | None) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return _TEXT_PART_SEPARATOR.join(part.text for part in content)


def _user_content(content: str | list[UserContentPart] | None, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for part_index, part in enumerate(content):
        part_param = f"{param}.content[{part_index}]"
        match part:
            case TextContentPart():
                texts.append(part.text)
            case ImageContentPart():
                raise InvalidRequestError(
                    f"image input {_NOT_SUPPORTED_YET}; send text content parts only",
                    part_param,
                )
            case AudioContentPart():
                raise InvalidRequestError(f"audio input {_NOT_SUPPORTED_YET}", part_param)
            case FileContentPart():
                raise InvalidRequestError(f"file input {_NOT_SUPPORTED_YET}", part_param)
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts)


def _assistant_content(
    content: str | list[AssistantContentPart] | None, refusal: str | None
) -> str:
    # A replayed refusal is what the assistant said, so it stays in the history as text.
    if content is None:
        return refusal or ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        match part:
            case TextContentPart():
                texts.append(part.text)
            case RefusalContentPart():
                texts.append(part.refusal)
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts)


# ---------------------------------------------------------------- response


def _chat_finish_reason(reason: FinishReason) -> ChatFinishReason:
    """Map an internal finish reason onto OpenAI's.

    Raises:
        GenerationError: for "error" and "cancelled". OpenAI has no value for a cancelled
            generation, and reporting "stop" would make a truncated answer look complete.
    """
    match reason:
        case "stop" | "length":
            return reason
        case "error":
            raise GenerationError("generation failed", code="generation_failed")
        case "cancelled":
            raise GenerationError(
                "generation was cancelled before it finished", code="generation_cancelled"
            )
        case _:
            assert_never(reason)


def _completion_usage(usage: Usage | None, counted_completion_tokens: int) -> CompletionUsage:
    # The last chunk carries usage by contract; should a producer omit it, report what the
    # stream itself shows (prompt tokens are then unknown, so 0) rather than fail.
    if usage is None:
        usage = Usage(prompt_tokens=0, completion_tokens=counted_completion_tokens)
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
    )


def _tool_calls_unsupported() -> GenerationError:
    return GenerationError(
        f"tool calls {_NOT_SUPPORTED_YET} by the chat completions API",
        code="tool_calls_not_supported",
    )


def _ended_without_finish() -> GenerationError:
    return GenerationError("generation stream ended without a finish", code="generation_failed")


def _error_chunk_error(chunk: ErrorChunk) -> ApiError:
    if chunk.status_code == 400:
        return InvalidRequestError(chunk.error_message, param="messages", code=chunk.error_code)
    return GenerationError(chunk.error_message, code=chunk.error_code or "generation_failed")


def _sse(data: str) -> str:
    return f"data: {data}\n\n"


async def stream_chat_completion(
    chunks: AsyncIterator[Chunk],
    *,
    completion_id: str,
    model: str,
    created: int,
    include_usage: bool,
) -> AsyncIterator[str]:
    """Render one generation as Chat Completions SSE events, in OpenAI's order.

    Yields, each as `data: <json>\\n\\n`: a chunk with `delta {role: "assistant", content:
    ""}`; one content chunk per non-empty `TokenChunk` text; a chunk with an empty delta
    and the finish reason; with `include_usage`, a chunk with `choices: []` and the usage
    (every other chunk then has `usage: null`); finally `data: [DONE]`. On failure the
    finish and usage chunks are replaced by one error event in OpenAI's error shape, still
    followed by `[DONE]` (see the module docstring).

    Args:
        chunks: The generation's internal chunks; read up to and including the first one
            with a finish reason.
        completion_id: The `id` of every chunk (`new_completion_id()`).
        model: The model name to report.
        created: Unix time in seconds, the same in every chunk.
        include_usage: The request's `stream_options.include_usage`.
    """

    def event(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=completion_id, created=created, model=model, choices=choices, usage=usage
        )
        # OpenAI sends `usage: null` on ordinary chunks only when usage was asked for.
        excluded = {"system_fingerprint"} if include_usage else {"system_fingerprint", "usage"}
        return _sse(chunk.model_dump_json(exclude=excluded))

    def error_event(error: ApiError) -> str:
        return _sse(json.dumps(openai_error_body_for(error), ensure_ascii=False))

    yield event([ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))])
    counted_completion_tokens = 0
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                counted_completion_tokens += len(chunk.token_ids)
                if chunk.text:
                    yield event([ChunkChoice(index=0, delta=ChunkDelta(content=chunk.text))])
                if chunk.finish_reason is None:
                    continue
                try:
                    finish_reason = _chat_finish_reason(chunk.finish_reason)
                except GenerationError as error:
                    yield error_event(error)
                    yield SSE_DONE
                    return
                yield event([ChunkChoice(index=0, delta=ChunkDelta(), finish_reason=finish_reason)])
                if include_usage:
                    yield event([], _completion_usage(chunk.usage, counted_completion_tokens))
                yield SSE_DONE
                return
            case ToolCallChunk():
                yield error_event(_tool_calls_unsupported())
                yield SSE_DONE
                return
            case ErrorChunk():
                yield error_event(_error_chunk_error(chunk))
                yield SSE_DONE
                return
            case _:
                assert_never(chunk)
    yield error_event(_ended_without_finish())
    yield SSE_DONE


async def collect_chat_completion(
    chunks: AsyncIterator[Chunk], *, completion_id: str, model: str, created: int
) -> ChatCompletionResponse:
    """Gather one generation into a non-streaming Chat Completions response.

    Args:
        chunks: The generation's internal chunks; read up to and including the first one
            with a finish reason.
        completion_id: The response `id` (`new_completion_id()`).
        model: The model name to report.
        created: Unix time in seconds.

    Raises:
        GenerationError: an `ErrorChunk` arrived, the generation was cancelled, a tool call
            arrived (not supported yet), or the stream ended without a finish.
    """
    texts: list[str] = []
    counted_completion_tokens = 0
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                texts.append(chunk.text)
                counted_completion_tokens += len(chunk.token_ids)
                if chunk.finish_reason is None:
                    continue
                return ChatCompletionResponse(
                    id=completion_id,
                    created=created,
                    model=model,
                    choices=[
                        Choice(
                            index=0,
                            message=ResponseMessage(content="".join(texts)),
                            finish_reason=_chat_finish_reason(chunk.finish_reason),
                        )
                    ],
                    usage=_completion_usage(chunk.usage, counted_completion_tokens),
                )
            case ToolCallChunk():
                raise _tool_calls_unsupported()
            case ErrorChunk():
                raise _error_chunk_error(chunk)
            case _:
                assert_never(chunk)
    raise _ended_without_finish()
