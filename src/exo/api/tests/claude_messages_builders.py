"""What the Claude Messages adapter's tests build and read: requests, the chunks a runner
sends, the SSE events expected, the collected message, and a cluster stand-in with model
cards and a tiny tokenizer for token counting."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import pytest

from exo.api.claude_messages.request import (
    to_task_params,
)
from exo.api.claude_messages.response import collect_message, stream_message
from exo.api.claude_messages.wire_types import (
    Message,
    MessagesRequest,
)
from exo.api.serving.cluster_client import LoadOnRequest
from exo.api.serving.node_stop import NodeStop
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import ImagePolicy
from exo.shared.types.chunks import (
    Chunk,
    ErrorChunk,
    FinishReason,
    TokenChunk,
    ToolCallChunk,
    Usage,
)
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.models import ModelCard, PypiGgufSource
from exo.shared.types.state import State
from exo.shared.types.text_generation import (
    TextGenerationTaskParams,
    ToolCall,
)
from exo.testing.chunks import ChunkSource

MODEL = "test-model"
COMMAND_ID = CommandId("command-1")
MESSAGE_ID = "msg_0123456789abcdef0123456789abcdef"


# ---------------------------------------------------------------- builders


def make_request(**fields: Any) -> MessagesRequest:
    body: dict[str, Any] = {
        "model": MODEL,
        "max_tokens": 64,
        "messages": [{"role": "user", "content": "hi"}],
    }
    body.update(fields)
    return MessagesRequest.model_validate(body)


def params_of(*messages: dict[str, Any], **fields: Any) -> TextGenerationTaskParams:
    return to_task_params(make_request(messages=list(messages), **fields))


def refusal_of(*messages: dict[str, Any], **fields: Any) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as raised:
        params_of(*messages, **fields)
    return raised.value


def token(
    text: str = "",
    reasoning: str = "",
    finish_reason: FinishReason | None = None,
    usage: Usage | None = None,
) -> TokenChunk:
    return TokenChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        text=text,
        reasoning_text=reasoning,
        token_ids=(1,) if text or reasoning else (),
        finish_reason=finish_reason,
        usage=usage,
    )


def finish(
    reason: FinishReason = "stop",
    prompt_tokens: int = 5,
    completion_tokens: int = 3,
    reasoning: int = 0,
) -> TokenChunk:
    usage = Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, reasoning_tokens=reasoning
    )
    return token(finish_reason=reason, usage=usage)


def tool_calls(
    *calls: tuple[str, str, str], finish_reason: FinishReason | None = "tool_calls"
) -> ToolCallChunk:
    return ToolCallChunk(
        command_id=COMMAND_ID,
        model=ModelId(MODEL),
        tool_calls=tuple(ToolCall(id=id_, name=name, arguments=args) for id_, name, args in calls),
        token_ids=(7, 8),
        finish_reason=finish_reason,
        usage=Usage(prompt_tokens=5, completion_tokens=4) if finish_reason else None,
    )


def error_chunk(message: str = "runner crashed", status_code: int = 500) -> ErrorChunk:
    return ErrorChunk(
        command_id=COMMAND_ID, model=ModelId(MODEL), error_message=message, status_code=status_code
    )


async def stream_events(chunks: Sequence[Chunk] | ChunkSource) -> list[tuple[str, Any]]:
    """Run the stream adapter: (event name, parsed data) per SSE event."""
    source = chunks if isinstance(chunks, ChunkSource) else ChunkSource(chunks)
    events: list[tuple[str, Any]] = []
    async for piece in stream_message(source, message_id=MESSAGE_ID, model=MODEL):
        assert piece.endswith("\n\n"), piece
        event_line, data_line = piece.removesuffix("\n\n").split("\n")
        name = event_line.removeprefix("event: ")
        data = json.loads(data_line.removeprefix("data: "))
        assert data["type"] == name
        events.append((name, data))
    return events


def usage_json(input_tokens: int, output_tokens: int, thinking: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens_details": {"thinking_tokens": thinking},
    }


MESSAGE_START = (
    "message_start",
    {
        "type": "message_start",
        "message": {
            "id": MESSAGE_ID,
            "type": "message",
            "role": "assistant",
            "model": MODEL,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": usage_json(0, 0),
        },
    },
)


def block_start(index: int, block: dict[str, Any]) -> tuple[str, Any]:
    return (
        "content_block_start",
        {"type": "content_block_start", "index": index, "content_block": block},
    )


def delta(index: int, **fields: str) -> tuple[str, Any]:
    ((kind, value),) = fields.items()
    key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}
    return (
        "content_block_delta",
        {"type": "content_block_delta", "index": index, "delta": {"type": kind, key[kind]: value}},
    )


def block_stop(index: int) -> tuple[str, Any]:
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(stop_reason: str, usage: dict[str, Any]) -> tuple[str, Any]:
    return (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": stop_reason, "stop_sequence": None},
            "usage": usage,
        },
    )


MESSAGE_STOP = ("message_stop", {"type": "message_stop"})


def error_event(error_type: str, message: str) -> tuple[str, Any]:
    return ("error", {"type": "error", "error": {"type": error_type, "message": message}})


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


USER_HI = {"role": "user", "content": "hi"}


async def collect(chunks: Sequence[Chunk]) -> Message:
    return await collect_message(ChunkSource(chunks), message_id=MESSAGE_ID, model=MODEL)


def tiny_tokenizer() -> Any:
    """A whitespace word tokenizer with a one-line chat template: every word one token."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<user>", "<system>", "<assistant>", "<tool>", "hi", "there", "be", "brief"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


class FakeCluster:
    def __init__(self, cards: dict[ModelId, ModelCard]) -> None:
        self.cards = cards
        self.state = State()
        self.load_on_request = LoadOnRequest()
        self.stop = NodeStop()
        self.image_policy = ImagePolicy()

    async def wait_until_caught_up(self, timeout: float = 0.0) -> bool:
        return True  # the state is what the test set


def card(model_id: str, source: Any) -> ModelCard:
    return ModelCard(
        model_id=ModelId(model_id),
        source=source,
        architecture="LlamaForCausalLM",
        n_layers=1,
        hidden_size=8,
        num_attention_heads=1,
        num_key_value_heads=1,
        intermediate_size=8,
        vocab_size=8,
        storage_size_bytes=1,
        context_length=64,
    )


PYPI_SOURCE = PypiGgufSource(
    package="p", version="1", wheel_sha256="0" * 64, gguf_path_in_wheel="m"
)
