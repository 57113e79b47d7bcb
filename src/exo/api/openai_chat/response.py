"""Chat Completions output: one generation's chunks as OpenAI's SSE events or one
`ChatCompletionResponse` (see `chat_completions` for the request side).

Failure after the HTTP status has been sent is reported in-band, the way vLLM does: one
`data: {"error": {...}}` event in OpenAI's error shape, then `data: [DONE]`. The official
`openai` client raises `APIError` on any event whose JSON has a truthy `error` key (checked
in openai 3.57, `_streaming.Stream.__stream__`), before it reaches `[DONE]`; clients that
ignore unknown events still see a well-terminated stream.

A chunk stream ends with the first chunk whose `finish_reason` is set (an `ErrorChunk`
always has one); nothing after it is read. The caller owns the chunk iterator and closes it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import assert_never

from exo.api.openai_chat.wire_types import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatFinishReason,
    Choice,
    ChoiceLogprobs,
    ChunkChoice,
    ChunkDelta,
    CompletionTokensDetails,
    CompletionUsage,
    DeltaFunctionCall,
    DeltaToolCall,
    LogprobEntry,
    PromptTokensDetails,
    ResponseFunctionCall,
    ResponseMessage,
    ResponseToolCall,
    TopLogprobEntry,
)
from exo.api.wire.common import (
    SSE_DONE,
    ended_without_finish,
    error_chunk_error,
    final_usage,
    logprob_token,
    openai_sse,
    unfinished_generation_error,
)
from exo.api.wire.errors import ApiError, GenerationError, openai_error_body_for
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    TokenLogprob,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.text_generation import (
    TextGenerationTaskParams,
)

# ---------------------------------------------------------------- response


def _chat_finish_reason(reason: FinishReason) -> ChatFinishReason:
    """Map an internal finish reason onto OpenAI's.

    Raises:
        GenerationError: for "error" and "cancelled". OpenAI has no value for a cancelled
            generation, and reporting "stop" would make a truncated answer look complete.
    """
    match reason:
        case "stop" | "length" | "tool_calls":
            return reason
        case "error" | "cancelled":
            raise unfinished_generation_error(reason)
        case _:
            assert_never(reason)


def _completion_usage(usage: Usage | None, counted_completion_tokens: int) -> CompletionUsage:
    # The last chunk carries usage by contract; should a producer omit it, report what the
    # stream itself shows (prompt tokens are then unknown, so 0) rather than fail.
    usage = final_usage(usage, counted_completion_tokens)
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens),
    )


def _logprob_entries(entries: tuple[TokenLogprob, ...]) -> list[LogprobEntry]:
    return [
        LogprobEntry(
            token=logprob_token(entry.token, entry.bytes),
            logprob=entry.logprob,
            bytes=list(entry.bytes),
            top_logprobs=[
                TopLogprobEntry(
                    token=logprob_token(top.token, top.bytes),
                    logprob=top.logprob,
                    bytes=list(top.bytes),
                )
                for top in entry.top_logprobs
            ],
        )
        for entry in entries
    ]


def _error_chunk_error(chunk: ErrorChunk) -> ApiError:
    return error_chunk_error(chunk, param="messages")


def text_event_renderer(
    render: Callable[[ChunkDelta], str], field: str
) -> Callable[[str], str] | None:
    """A fast `lambda text: render(ChunkDelta(**{field: text}))` for non-empty `text`: the
    event is rendered once with an empty text, and each token's text (JSON-escaped as
    pydantic does: UTF-8 left as is, `"`, `\\` and control characters escaped) goes
    between its two halves, byte for byte what `render` would give (the model's
    validation and serialisation cost ~0.1 ms per token, once per streamed token). None
    when the empty text cannot be found exactly once in the rendering.
    """
    marker = f'"{field}":""'
    rendered = render(ChunkDelta(**{field: ""}))
    if rendered.count(marker) != 1:
        return None
    before, _, after = rendered.partition(marker)
    prefix = f'{before}"{field}":'

    def render_text(text: str) -> str:
        return prefix + json.dumps(text, ensure_ascii=False) + after

    return render_text


async def stream_chat_completion(
    chunks: AsyncIterator[Chunk],
    *,
    completion_id: str,
    model: str,
    created: int,
    include_usage: bool,
    params: TextGenerationTaskParams | None = None,
) -> AsyncIterator[str]:
    """Render one generation as Chat Completions SSE events, in OpenAI's order.

    Yields, each as `data: <json>\\n\\n`: a chunk with `delta {role: "assistant", content:
    ""}`; one chunk per `TokenChunk` with text (`delta.content`), thinking
    (`delta.reasoning_content`) or logprobs (`choices[0].logprobs.content`); one chunk per
    tool call, whole in one `delta.tool_calls` entry (`index`, `id`, `type`, `name`, full
    `arguments`); a chunk with an empty delta and the finish reason ("tool_calls" when the
    model called tools); with `include_usage`, a chunk with `choices: []` and the usage
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
        params: The request; logprobs are reported only when it asked for them.
    """
    want_logprobs = params is not None and params.logprobs

    def event(choices: list[ChunkChoice], usage: CompletionUsage | None = None) -> str:
        chunk = ChatCompletionChunk(
            id=completion_id, created=created, model=model, choices=choices, usage=usage
        )
        # OpenAI sends `usage: null` on ordinary chunks only when usage was asked for.
        excluded = {"system_fingerprint"} if include_usage else {"system_fingerprint", "usage"}
        return openai_sse(chunk.model_dump_json(exclude=excluded))

    def error_event(error: ApiError) -> str:
        return openai_sse(json.dumps(openai_error_body_for(error), ensure_ascii=False))

    def delta_event(delta: ChunkDelta) -> str:
        return event([ChunkChoice(index=0, delta=delta)])

    # The common token (text only, no logprobs) skips the models: see `text_event_renderer`.
    content_event = text_event_renderer(delta_event, "content")
    reasoning_event = text_event_renderer(delta_event, "reasoning_content")

    yield event([ChunkChoice(index=0, delta=ChunkDelta(role="assistant", content=""))])
    counted_completion_tokens = 0
    tool_call_count = 0
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                counted_completion_tokens += len(chunk.token_ids)
                logprobs = (
                    ChoiceLogprobs(content=_logprob_entries(chunk.logprobs))
                    if want_logprobs and chunk.logprobs
                    else None
                )
                if logprobs is None and chunk.text and not chunk.reasoning_text and content_event:
                    yield content_event(chunk.text)
                elif (
                    logprobs is None and chunk.reasoning_text and not chunk.text and reasoning_event
                ):
                    yield reasoning_event(chunk.reasoning_text)
                elif chunk.text or chunk.reasoning_text or logprobs is not None:
                    delta = ChunkDelta(
                        content=chunk.text or None,
                        reasoning_content=chunk.reasoning_text or None,
                    )
                    if delta.content is None and delta.reasoning_content is None:
                        delta = ChunkDelta(content="")
                    yield event([ChunkChoice(index=0, delta=delta, logprobs=logprobs)])
            case ToolCallChunk():
                counted_completion_tokens += len(chunk.token_ids)
                for call in chunk.tool_calls:
                    delta_call = DeltaToolCall(
                        index=tool_call_count,
                        id=call.id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                    tool_call_count += 1
                    yield event([ChunkChoice(index=0, delta=ChunkDelta(tool_calls=[delta_call]))])
            case ErrorChunk():
                yield error_event(_error_chunk_error(chunk))
                yield SSE_DONE
                return
            case _:
                assert_never(chunk)
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
    yield error_event(ended_without_finish())
    yield SSE_DONE


async def collect_chat_completion(
    chunks: AsyncIterator[Chunk],
    *,
    completion_id: str,
    model: str,
    created: int,
    params: TextGenerationTaskParams | None = None,
) -> ChatCompletionResponse:
    """Gather one generation into a non-streaming Chat Completions response.

    The message holds the whole text (`content`, null when the model only called tools),
    the thinking (`reasoning_content`, left out when none) and the calls (`tool_calls`,
    arguments as JSON text); `logprobs.content` has one entry per sampled token when the
    request asked for logprobs.

    Args:
        chunks: The generation's internal chunks; read up to and including the first one
            with a finish reason.
        completion_id: The response `id` (`new_completion_id()`).
        model: The model name to report.
        created: Unix time in seconds.
        params: The request; logprobs are reported only when it asked for them.

    Raises:
        InvalidRequestError: the engine refused the request (an ErrorChunk with status 400).
        GenerationError: an `ErrorChunk` arrived, the generation was cancelled, or the
            stream ended without a finish.
    """
    want_logprobs = params is not None and params.logprobs
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[ResponseToolCall] = []
    logprobs: list[LogprobEntry] = []
    counted_completion_tokens = 0
    async for chunk in chunks:
        match chunk:
            case TokenChunk():
                texts.append(chunk.text)
                reasoning.append(chunk.reasoning_text)
                logprobs.extend(_logprob_entries(chunk.logprobs))
                counted_completion_tokens += len(chunk.token_ids)
            case ToolCallChunk():
                counted_completion_tokens += len(chunk.token_ids)
                tool_calls.extend(
                    ResponseToolCall(
                        id=call.id,
                        function=ResponseFunctionCall(name=call.name, arguments=call.arguments),
                    )
                    for call in chunk.tool_calls
                )
            case ErrorChunk():
                raise _error_chunk_error(chunk)
            case _:
                assert_never(chunk)
        if chunk.finish_reason is None:
            continue
        text = "".join(texts)
        message = ResponseMessage(
            content=text if text or not tool_calls else None,
            tool_calls=tool_calls or None,
            reasoning_content="".join(reasoning) or None,
        )
        return ChatCompletionResponse(
            id=completion_id,
            created=created,
            model=model,
            choices=[
                Choice(
                    index=0,
                    message=message,
                    finish_reason=_chat_finish_reason(chunk.finish_reason),
                    logprobs=ChoiceLogprobs(content=logprobs) if want_logprobs else None,
                )
            ],
            usage=_completion_usage(chunk.usage, counted_completion_tokens),
        )
    raise ended_without_finish()
