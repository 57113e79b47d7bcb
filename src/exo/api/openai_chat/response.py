"""Chat Completions output: one generation's chunks as OpenAI's SSE events or one
`ChatCompletionResponse` (see `request` for the request side).

Failure after the HTTP status has been sent is reported in-band (`exo.api.wire.openai_sse`).
The chunks are read through `exo.api.wire.stream.generation_events`, which ends with the
first chunk whose `finish_reason` is set. The caller owns the chunk iterator and closes it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator
from typing import assert_never

from exo.api.openai_chat.wire_types import (
    ChatCompletionChunk,
    ChatCompletionResponse,
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
from exo.api.wire import stream
from exo.api.wire.logprobs import logprob_entries
from exo.api.wire.openai_sse import OpenAIChunkStream
from exo.shared.types.chunks import Chunk, TokenLogprob, Usage
from exo.shared.types.text_generation import TextGenerationTaskParams

# ---------------------------------------------------------------- response


def completion_usage(usage: Usage, *, reasoning_tokens: bool = True) -> CompletionUsage:
    """OpenAI's usage object of the internal usage: token counts, the prompt tokens served
    from the prefix cache, and (unless `reasoning_tokens` is False, as on legacy
    Completions, which reports no details of the completion) the thinking tokens."""
    return CompletionUsage(
        prompt_tokens=usage.prompt_tokens,
        completion_tokens=usage.completion_tokens,
        total_tokens=usage.total_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        completion_tokens_details=(
            CompletionTokensDetails(reasoning_tokens=usage.reasoning_tokens)
            if reasoning_tokens
            else None
        ),
    )


def _logprob_entries(entries: tuple[TokenLogprob, ...]) -> list[LogprobEntry]:
    return logprob_entries(entries, LogprobEntry, TopLogprobEntry)


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
    events: OpenAIChunkStream[ChunkChoice] = OpenAIChunkStream(
        ChatCompletionChunk, completion_usage, completion_id, created, model, include_usage
    )

    def delta_event(delta: ChunkDelta) -> str:
        return events.event([ChunkChoice(index=0, delta=delta)])

    # The common token (text only, no logprobs) skips the models: see `text_event_renderer`.
    content_event = text_event_renderer(delta_event, "content")
    reasoning_event = text_event_renderer(delta_event, "reasoning_content")
    tool_call_count = 0

    def render(piece: stream.Text | stream.ToolCalls) -> Iterator[str]:
        nonlocal tool_call_count
        match piece:
            case stream.Text(text=text, reasoning=reasoning):
                logprobs = (
                    ChoiceLogprobs(content=_logprob_entries(piece.logprobs))
                    if want_logprobs and piece.logprobs
                    else None
                )
                if logprobs is None and text and not reasoning and content_event:
                    yield content_event(text)
                elif logprobs is None and reasoning and not text and reasoning_event:
                    yield reasoning_event(reasoning)
                elif text or reasoning or logprobs is not None:
                    delta = ChunkDelta(content=text or None, reasoning_content=reasoning or None)
                    if delta.content is None and delta.reasoning_content is None:
                        delta = ChunkDelta(content="")
                    yield events.event([ChunkChoice(index=0, delta=delta, logprobs=logprobs)])
            case stream.ToolCalls():
                for call in piece.calls:
                    delta_call = DeltaToolCall(
                        index=tool_call_count,
                        id=call.id,
                        type="function",
                        function=DeltaFunctionCall(name=call.name, arguments=call.arguments),
                    )
                    tool_call_count += 1
                    yield delta_event(ChunkDelta(tool_calls=[delta_call]))
            case _:
                assert_never(piece)

    # OpenAI opens a text answer with `content: ""` and a tool-call answer without text;
    # a forced call ("required" or a named tool) is known to be the latter, so its
    # accumulated message keeps `content` null, as in the non-streaming answer.
    forced_call = params is not None and params.forces_tool_call
    opening = [delta_event(ChunkDelta(role="assistant", content=None if forced_call else ""))]
    async for line in events.events(
        chunks,
        "messages",
        opening,
        render,
        lambda end: ChunkChoice(index=0, delta=ChunkDelta(), finish_reason=end.completed_reason),
    ):
        yield line


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
    generation = await stream.collect_generation(chunks, conversation_param="messages")
    tool_calls = [
        ResponseToolCall(
            id=call.id, function=ResponseFunctionCall(name=call.name, arguments=call.arguments)
        )
        for call in generation.tool_calls
    ]
    text = generation.text
    message = ResponseMessage(
        content=text if text or not tool_calls else None,
        tool_calls=tool_calls or None,
        reasoning_content=generation.reasoning or None,
    )
    logprobs = _logprob_entries(generation.logprobs) if want_logprobs else None
    choice = Choice(
        index=0,
        message=message,
        finish_reason=generation.finished.completed_reason,
        logprobs=ChoiceLogprobs(content=logprobs) if logprobs is not None else None,
    )
    return ChatCompletionResponse(
        id=completion_id, created=created, model=model, choices=[choice],
        usage=completion_usage(generation.finished.final_usage),
    )  # fmt: skip
