"""The official `openai` client against a tiny server that uses the Chat Completions
adapter: streamed and not, usage, errors, tool calls, prefill progress."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError

from exo.api.openai_chat.request import (
    new_completion_id,
    to_task_params,
)
from exo.api.openai_chat.response import collect_chat_completion, stream_chat_completion
from exo.api.openai_chat.wire_types import (
    ChatCompletionRequest,
)
from exo.api.tests.chat_completions_builders import (
    MODEL,
    WEATHER_TOOL,
    calls,
    error_chunk,
    finish,
    prefill,
    reasoning,
    token,
)
from exo.api.wire.errors import (
    GenerationError,
    InvalidRequestError,
    openai_error_body_for,
)
from exo.shared.types.chunks import (
    Chunk,
)
from exo.testing.chunks import ChunkSource

# ---------------------------------------------------------------- official openai client


SCRIPTED_CHUNKS: dict[str, list[Chunk]] = {
    "hello": [token("Hel"), token("lo"), token(""), finish(" world", prompt_tokens=7)],
    "crash": [token("partial"), error_chunk("runner crashed")],
    "long prompt": [prefill(256), prefill(1024), prefill(2048), token("Hi"), finish()],
    "tools": [
        reasoning("hmm"),
        calls(("get_weather", '{"city": "Paris"}'), finish_reason="tool_calls"),
    ],
}


def build_app() -> FastAPI:
    """A stand-in for the real route: the adapter fed by scripted chunks keyed by the last
    user message."""
    app = FastAPI()

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(
        request: ChatCompletionRequest,
    ) -> JSONResponse | StreamingResponse:
        try:
            params = to_task_params(request)
        except InvalidRequestError as error:
            return JSONResponse(openai_error_body_for(error), status_code=error.status_code)
        chunks = ChunkSource(SCRIPTED_CHUNKS[params.messages[-1].content])
        completion_id, created = new_completion_id(), int(time.time())
        if params.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            return StreamingResponse(
                stream_chat_completion(
                    chunks,
                    completion_id=completion_id,
                    model=request.model,
                    created=created,
                    include_usage=include_usage,
                    params=params,
                ),
                media_type="text/event-stream",
            )
        try:
            response = await collect_chat_completion(
                chunks,
                completion_id=completion_id,
                model=request.model,
                created=created,
                params=params,
            )
        except GenerationError as error:
            return JSONResponse(openai_error_body_for(error), status_code=error.status_code)
        return JSONResponse(response.model_dump(mode="json"))

    return app


def wait_until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.01)


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # the kernel picks a free port; no race with others
    port = listener.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(build_app(), log_level="warning", lifespan="off", access_log=False)
    )
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started or not thread.is_alive(), 10.0, "uvicorn to start")
        assert server.started, "uvicorn exited during startup"
        yield openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=10.0, max_retries=0
        )
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        listener.close()
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


def user_says(text: str) -> list[Any]:
    return [{"role": "user", "content": text}]


def test_openai_client_non_streaming(client: openai.OpenAI) -> None:
    completion = client.chat.completions.create(model=MODEL, messages=user_says("hello"))
    assert completion.id.startswith("chatcmpl-")
    assert completion.object == "chat.completion"
    assert completion.model == MODEL
    assert completion.choices[0].message.role == "assistant"
    assert completion.choices[0].message.content == "Hello world"
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (7, 3)
    assert completion.usage.total_tokens == 10


@pytest.mark.anyio
async def test_prefill_progress_is_a_comment_line_before_the_first_token() -> None:
    chunks: list[Chunk] = [prefill(256), prefill(1024), token("Hi"), prefill(2048), finish()]
    lines = [
        line
        async for line in stream_chat_completion(
            ChunkSource(chunks), completion_id="chatcmpl-1", model=MODEL, created=1700,
            include_usage=False, params=None,
        )
    ]  # fmt: skip
    comments = [line for line in lines if line.startswith(":")]
    first_token = next(index for index, line in enumerate(lines) if '"content":"Hi"' in line)
    assert lines[1:3] == comments[:2]  # after the opening role chunk, before the token
    assert first_token == 3
    assert [json.loads(line.removeprefix(": prefill ")) for line in comments] == [
        {"prompt_tokens": 2048, "cached_tokens": 256, "prefilled_tokens": done}
        for done in (256, 1024, 2048)
    ]
    assert all(line.endswith("\n\n") and line.count("\n") == 2 for line in comments)
    data = [line for line in lines if line.startswith("data: ")]
    assert len(data) + len(comments) == len(lines)


def test_openai_client_skips_prefill_progress(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=user_says("long prompt"), stream=True)
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == "Hi"


def test_openai_client_streaming_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=user_says("hello"),
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    content = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert content == "Hello world"
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finishes[-1] == "stop" and set(finishes[:-1]) == {None}
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == 10
    assert all(chunk.usage is None for chunk in chunks[:-1])


def test_openai_client_streaming_without_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=user_says("hello"), stream=True)
    )
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert all(chunk.usage is None for chunk in chunks)


def test_openai_client_raises_on_mid_stream_error(client: openai.OpenAI) -> None:
    received: list[str] = []
    stream = client.chat.completions.create(model=MODEL, messages=user_says("crash"), stream=True)
    with pytest.raises(openai.APIError, match="runner crashed"):
        for chunk in stream:
            received.append(chunk.choices[0].delta.content or "")
    assert "".join(received) == "partial"


def test_openai_client_raises_on_non_streaming_error(client: openai.OpenAI) -> None:
    with pytest.raises(openai.InternalServerError, match="runner crashed"):
        client.chat.completions.create(model=MODEL, messages=user_says("crash"))


def test_openai_client_gets_bad_request_for_unsupported_n(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="n=3 is not supported") as caught:
        client.chat.completions.create(model=MODEL, messages=user_says("hello"), n=3)
    assert caught.value.param == "n"


def test_seeds_outside_what_a_generator_takes_are_schema_errors() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    ChatCompletionRequest.model_validate({**base, "seed": 2**64 - 1})
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**base, "seed": 2**64})


def test_openai_client_tool_calls(client: openai.OpenAI) -> None:
    tools: Any = [WEATHER_TOOL]
    completion = client.chat.completions.create(
        model=MODEL, messages=user_says("tools"), tools=tools, tool_choice="required"
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.tool_calls is not None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id == "call_get_weather"
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert completion.usage is not None and completion.usage.completion_tokens_details is not None
    assert completion.usage.completion_tokens_details.reasoning_tokens == 2

    streamed = list(
        client.chat.completions.create(
            model=MODEL, messages=user_says("tools"), tools=tools, stream=True
        )
    )
    deltas = [
        tool_call for chunk in streamed for tool_call in (chunk.choices[0].delta.tool_calls or [])
    ]
    assert [(d.index, d.id, d.function and d.function.name) for d in deltas] == [
        (0, "call_get_weather", "get_weather")
    ]
    assert streamed[-1].choices[0].finish_reason == "tool_calls"


def test_a_streamed_forced_tool_call_accumulates_null_content(client: openai.OpenAI) -> None:
    """Trial 40: a "required" call streamed began with `content: ""`, so the SDK's
    accumulated message had content '' where OpenAI's (and exo's non-streaming) is null."""
    tools: Any = [WEATHER_TOOL]
    with client.chat.completions.stream(
        model=MODEL, messages=user_says("tools"), tools=tools, tool_choice="required"
    ) as events:
        for _ in events:
            pass
        final = events.get_final_completion()
    message = final.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert message.content is None
