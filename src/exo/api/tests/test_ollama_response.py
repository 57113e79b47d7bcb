"""The Ollama adapter's response side: NDJSON lines while streaming, the collected
response, load responses, model listings (`/api/tags`, `/api/show`, `/api/ps`), and the
response wire types' round trip."""

from __future__ import annotations

import json

import pytest

from exo.api.ollama.model_listings import model_digest, process_model, show_response, tag_model
from exo.api.ollama.response import load_response
from exo.api.ollama.wire_types import OllamaChatResponse, OllamaGenerateResponse, OllamaShowResponse
from exo.api.tests.ollama_builders import (
    CREATED_AT,
    MODEL,
    WALL_NS,
    collected,
    done_line,
    error_chunk,
    finish,
    stream_lines,
    text_line,
    token,
    tool_calls,
)
from exo.api.wire.errors import GenerationError, InvalidRequestError
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.chunks import Chunk, TokenLogprob, TopLogprob, Usage
from exo.shared.types.common import ModelId
from exo.testing.builders import SMOLLM2, smollm2_card
from exo.testing.chunks import ChunkSource

# ---------------------------------------------------------------- streaming


@pytest.mark.anyio
async def test_stream_text_then_done_with_measured_timings() -> None:
    lines = await stream_lines(
        [token("Hel"), token("lo"), finish(prompt_tokens=9, completion_tokens=2)]
    )
    assert lines == [text_line("Hel"), text_line("lo"), done_line(prompt=9, evals=2)]


@pytest.mark.anyio
async def test_stream_thinking_and_final_text_in_the_finishing_chunk() -> None:
    last = token("!", finish_reason="length", usage=Usage(prompt_tokens=5, completion_tokens=3))
    lines = await stream_lines([token(reasoning="hmm"), token("Hi", reasoning=" ok"), last])
    assert lines == [
        text_line("", thinking="hmm"),
        text_line("Hi", thinking=" ok"),
        text_line("!"),
        done_line("length"),
    ]


@pytest.mark.anyio
async def test_stream_tool_calls_as_objects_then_done_stop() -> None:
    lines = await stream_lines(
        [
            tool_calls(("get_weather", '{"city": "Paris"}')),
            tool_calls(("get_time", "{}"), finish_reason="tool_calls"),
        ]
    )
    calls = [line["message"].get("tool_calls") for line in lines[:2]]
    assert calls == [
        [
            {
                "id": "call_0",
                "function": {"index": 0, "name": "get_weather", "arguments": {"city": "Paris"}},
            }
        ],
        [{"id": "call_0", "function": {"index": 1, "name": "get_time", "arguments": {}}}],
    ]
    assert [line["done"] for line in lines] == [False, False, True]
    assert lines[2] == done_line("stop", evals=7)


@pytest.mark.anyio
async def test_stream_logprobs_per_line() -> None:
    entry = TokenLogprob(
        token="Hi",
        token_id=5,
        logprob=-0.1,
        bytes=(72, 105),
        top_logprobs=(TopLogprob(token="Hi", token_id=5, logprob=-0.1, bytes=(72, 105)),),
    )
    lines = await stream_lines([token("Hi", logprobs=(entry,)), finish()])
    assert lines[0]["logprobs"] == [
        {
            "token": "Hi",
            "logprob": -0.1,
            "bytes": [72, 105],
            "top_logprobs": [{"token": "Hi", "logprob": -0.1, "bytes": [72, 105]}],
        }
    ]
    assert "logprobs" not in lines[1]


@pytest.mark.anyio
async def test_stream_generate_lines_use_response() -> None:
    lines = await stream_lines([token("Paris", reasoning="hm"), finish()], dialect="generate")
    assert lines[0] == {
        "model": MODEL,
        "created_at": CREATED_AT,
        "response": "Paris",
        "thinking": "hm",
        "done": False,
    }
    final = done_line()
    del final["message"]
    assert lines[1] == {**final, "response": ""}


@pytest.mark.parametrize(
    ("last", "message"),
    [
        (error_chunk("runner crashed"), "runner crashed"),
        (error_chunk("prompt too long", status_code=400), "prompt too long"),
        (finish("cancelled"), "cancelled before it finished"),
        (finish("error"), "generation failed"),
    ],
)
@pytest.mark.anyio
async def test_stream_failure_is_one_error_line(last: Chunk, message: str) -> None:
    source = ChunkSource([token("Hi"), last, token("never read")])
    lines = await stream_lines(source)
    assert lines[0] == text_line("Hi")
    assert len(lines) == 2 and set(lines[1]) == {"error"} and message in lines[1]["error"]
    assert source.taken == 2, "nothing is read after the finishing chunk"


@pytest.mark.anyio
async def test_stream_without_finish_ends_with_an_error_line() -> None:
    lines = await stream_lines([token("Hi")])
    assert lines == [text_line("Hi"), {"error": "generation stream ended without a finish"}]


# ---------------------------------------------------------------- collecting


@pytest.mark.anyio
async def test_collect_chat_joins_everything() -> None:
    response = await collected(
        [
            token(reasoning="think "),
            token("Hel", reasoning="more"),
            tool_calls(("f", '{"a": 1}')),
            token("lo"),
            finish(),
        ]
    )
    assert response == {
        **done_line(),
        "message": {
            "role": "assistant",
            "content": "Hello",
            "thinking": "think more",
            "tool_calls": [
                {"id": "call_0", "function": {"index": 0, "name": "f", "arguments": {"a": 1}}}
            ],
        },
    }


@pytest.mark.anyio
async def test_collect_generate() -> None:
    response = await collected([token("Paris"), finish("length")], dialect="generate")
    assert response["response"] == "Paris" and response["done_reason"] == "length"
    assert "message" not in response and "context" not in response


@pytest.mark.anyio
async def test_collect_failures_raise() -> None:
    with pytest.raises(InvalidRequestError, match="too long"):
        await collected([error_chunk("too long", status_code=400)])
    with pytest.raises(GenerationError, match="crashed"):
        await collected([token("a"), error_chunk("crashed")])
    with pytest.raises(GenerationError, match="cancelled"):
        await collected([finish("cancelled")])
    with pytest.raises(GenerationError, match="without a finish"):
        await collected([token("a")])


def test_load_responses() -> None:
    chat = load_response("chat", MODEL, now_ns=lambda: WALL_NS).model_dump(mode="json")
    assert chat == {
        "model": MODEL,
        "created_at": CREATED_AT,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "load",
    }
    generate = load_response("generate", MODEL, now_ns=lambda: WALL_NS).model_dump(mode="json")
    assert generate["response"] == "" and generate["done_reason"] == "load"


# ---------------------------------------------------------------- model listings


def test_tag_entry_from_card() -> None:
    card = smollm2_card()
    entry = tag_model(card, "2024-01-01T00:00:00Z", on_gpus=False).model_dump(mode="json")
    assert entry == {
        "name": SMOLLM2,
        "model": SMOLLM2,
        "modified_at": "2024-01-01T00:00:00Z",
        "size": card.storage_size_bytes,
        "digest": model_digest(SMOLLM2),
        "details": {
            "parent_model": "",
            "format": "gguf",  # SmolLM2-135M-Instruct.Q4_1.gguf
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "135M",
            "quantization_level": "Q4_1",  # the GGUF's file type
        },
        "capabilities": ["completion", "tools"],
    }
    assert len(entry["digest"]) == 64 and entry["digest"] == model_digest(SMOLLM2)
    assert model_digest("a") != model_digest("b")


def test_show_from_card_and_template() -> None:
    card = smollm2_card()
    template = "{% for message in messages %}{{ message.content }}{% endfor %}{# tools #}"
    show = show_response(card, template, "2024-01-01T00:00:00Z", on_gpus=True)
    OllamaShowResponse.model_validate_json(show.model_dump_json())  # round trip
    assert show.template == template
    assert f"FROM {SMOLLM2}" in show.modelfile and template in show.modelfile
    assert "temperature" in show.parameters and "0.2" in show.parameters
    assert show.capabilities == ["completion", "tools"]
    assert show.details.quantization_level == "Q4_1"  # the GGUF's, on GPUs too
    assert show.model_info["general.architecture"] == "llama"
    assert show.model_info["general.parameter_count"] == 134_515_008
    assert show.model_info["llama.context_length"] == card.context_length
    assert show.model_info["llama.block_count"] == card.n_layers
    # Tool calls work without a template that names tools (exo's fallback prompt).
    assert show_response(card, "", "x", False).capabilities == ["completion", "tools"]


def test_show_capabilities_follow_the_card() -> None:
    cards = load_builtin_cards()
    qwen3 = show_response(cards[ModelId("Qwen/Qwen3-0.6B")], "", "x", False)
    assert qwen3.capabilities == ["completion", "tools", "thinking"]
    distill = cards[ModelId("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B")]
    assert show_response(distill, "", "x", False).capabilities == [
        "completion",
        "tools",
        "thinking",
    ]
    # Gemma 3 4B's card says it reads images.
    gemma = show_response(cards[ModelId("google/gemma-3-4b-it")], "", "x", False)
    assert gemma.capabilities == ["completion", "tools", "vision"]
    assert gemma.details.parameter_size == "4.3B" and gemma.details.family == "gemma3"
    assert gemma.model_info["gemma3.attention.key_length"] == 256


def test_process_entry() -> None:
    entry = process_model(smollm2_card(), size=1000, on_gpus=False).model_dump(mode="json")
    assert (entry["size"], entry["size_vram"], entry["name"]) == (1000, 0, SMOLLM2)
    assert entry["context_length"] == smollm2_card().context_length
    assert entry["expires_at"].startswith("9999-")


def test_response_wire_types_round_trip() -> None:
    chat = OllamaChatResponse.model_validate_json(json.dumps(done_line()))
    assert json.loads(chat.model_dump_json()) == done_line()
    generate_line = {"model": MODEL, "created_at": CREATED_AT, "response": "x", "done": False}
    generate = OllamaGenerateResponse.model_validate_json(json.dumps(generate_line))
    assert json.loads(generate.model_dump_json()) == generate_line
