"""The streamed Chat Completions token event is rendered from a template (the event with
an empty text, the token's text JSON-escaped in between); it must be byte for byte what
the pydantic models render, for any text a model can produce."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from exo.api.openai_chat.response import stream_chat_completion, text_event_renderer
from exo.api.openai_chat.wire_types import ChatCompletionChunk, ChunkChoice, ChunkDelta
from exo.api.wire.openai_sse import openai_sse
from exo.shared.types.chunks import Chunk, TokenChunk, Usage
from exo.shared.types.common import CommandId, ModelId

pytestmark = pytest.mark.anyio

TRICKY_TEXTS = [
    " Hello",
    "\n\n",
    'He said "hi"',
    "back\\slash and /slash",
    "tab\there\rcarriage\x08\x0c",
    "".join(chr(code) for code in range(0x20)) + "\x7f\x80\x9f\xa0",
    "café naïve Ωμέγα 日本語 한국어 עברית العربية",
    "\U0001f600\U0001f469\u200d\U0001f4bb\U0001f1eb\U0001f1f7",
    "\ufffd",
    "\ufffd\ufffd partial byte",
    "\u2028\u2029 line separators",
    "\ufeff\u200b\u00ad zero width",
    '"content":""',
    "</script><!-- -->",
    "\U0010ffff\ue000",
    " ",
]
IDS_AND_MODELS = [
    ("chatcmpl-0123456789abcdef0123456789abcdef", "HuggingFaceTB/SmolLM2-135M-Instruct"),
    ('odd"id', 'a "quoted" \\ model/\u00e9\U0001f600'),
]


def _reference(completion_id: str, model: str, include_usage: bool, delta: ChunkDelta) -> str:
    chunk = ChatCompletionChunk(
        id=completion_id, created=1_700_000_000, model=model,
        choices=[ChunkChoice(index=0, delta=delta)],
    )  # fmt: skip
    excluded = {"system_fingerprint"} if include_usage else {"system_fingerprint", "usage"}
    return openai_sse(chunk.model_dump_json(exclude=excluded))


@pytest.mark.parametrize("field", ["content", "reasoning_content"])
@pytest.mark.parametrize("include_usage", [True, False])
@pytest.mark.parametrize(("completion_id", "model"), IDS_AND_MODELS)
def test_the_template_renders_what_the_models_render(
    field: str, include_usage: bool, completion_id: str, model: str
) -> None:
    def render(delta: ChunkDelta) -> str:
        return _reference(completion_id, model, include_usage, delta)

    fast = text_event_renderer(render, field)
    assert fast is not None
    texts = [*TRICKY_TEXTS, *(chr(code) for code in range(0x3000)), "\U0001f600" * 50]
    for text in texts:
        assert fast(text) == render(ChunkDelta(**{field: text})), repr(text)


def test_no_template_when_the_empty_text_is_not_found_once() -> None:
    assert text_event_renderer(lambda _delta: '{"content":"","content":""}', "content") is None
    assert text_event_renderer(lambda _delta: '{"other":1}', "content") is None


async def _chunks(texts: list[tuple[str, str]]) -> AsyncIterator[Chunk]:
    command_id, model = CommandId("command"), ModelId("test/model")
    for index, (text, reasoning) in enumerate(texts):
        yield TokenChunk(
            command_id=command_id, model=model, text=text, reasoning_text=reasoning,
            token_ids=(index,),
        )  # fmt: skip
    yield TokenChunk(
        command_id=command_id, model=model, text="", token_ids=(), finish_reason="stop",
        usage=Usage(prompt_tokens=3, completion_tokens=len(texts)),
    )  # fmt: skip


@pytest.mark.parametrize("include_usage", [True, False])
async def test_a_stream_s_token_events_are_the_models_rendering(include_usage: bool) -> None:
    tokens = [(text, "") for text in TRICKY_TEXTS] + [("", 'thinking "x"\n'), ("a", "b")]
    completion_id, model = 'chatcmpl-"x"', "test/model"
    events = [
        event
        async for event in stream_chat_completion(
            _chunks(tokens), completion_id=completion_id, model=model,
            created=1_700_000_000, include_usage=include_usage,
        )
    ]  # fmt: skip
    expected = [
        _reference(
            completion_id, model, include_usage,
            ChunkDelta(content=text or None, reasoning_content=reasoning or None),
        )
        for text, reasoning in tokens
    ]  # fmt: skip
    assert events[1 : 1 + len(tokens)] == expected
    assert events[0] == _reference(
        completion_id, model, include_usage, ChunkDelta(role="assistant", content="")
    )
