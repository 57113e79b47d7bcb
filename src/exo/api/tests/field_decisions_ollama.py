"""Decisions for every declared field of Ollama's native request models."""

from __future__ import annotations

from typing import Any

from exo.api.tests.field_decisions import (
    CALL,
    OLLAMA_CHAT,
    OLLAMA_DELETE,
    OLLAMA_GENERATE,
    OLLAMA_PULL,
    OLLAMA_SHOW,
    OLLAMA_TOOL,
    SCHEMA,
    THINKING_MODEL,
    USER_HI,
    WEATHER,
    Decision,
    Effect,
    NoOp,
    Refused,
    Sends,
    Shows,
    fields,
    last,
)
from exo.shared.types.commands import KeepAlive
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
)
from exo.testing.builders import SMOLLM2


def ollama_effects() -> list[Decision]:
    options = {"num_predict": 4}
    history: list[dict[str, Any]] = [
        USER_HI,
        {
            "role": "assistant",
            "content": "let me look",
            "thinking": "a tool knows",
            "tool_calls": [
                {
                    "id": "call_1",
                    "function": {"name": "get_weather", "arguments": {"city": "Paris"}},
                }
            ],
        },
        {"role": "tool", "content": "20C", "tool_name": "get_weather", "tool_call_id": "call_1"},
    ]
    decisions: list[Decision] = [
        Effect(
            fields("OllamaChatRequest.messages", "OllamaMessage.role", "OllamaMessage.content"),
            OLLAMA_CHAT,
            {"messages": [{"role": "user", "content": "Tell me"}]},
            lambda p: last(p) == ChatMessage(role="user", content="Tell me"),
        ),
        Effect(
            fields(
                "OllamaMessage.thinking",
                "OllamaMessage.tool_calls",
                "OllamaMessage.tool_name",
                "OllamaMessage.tool_call_id",
                "OllamaToolCall.id",
                "OllamaToolCall.function",
                "OllamaToolCallFunction.name",
                "OllamaToolCallFunction.arguments",
            ),
            OLLAMA_CHAT,
            {"messages": history},
            lambda p: (
                p.messages[1:]
                == (
                    ChatMessage(
                        role="assistant",
                        content="let me look",
                        reasoning_content="a tool knows",
                        tool_calls=(CALL,),
                    ),
                    ChatMessage(
                        role="tool", content="20C", name="get_weather", tool_call_id="call_1"
                    ),
                )
            ),
        ),
        NoOp(
            fields("OllamaToolCallFunction.index"),
            OLLAMA_CHAT,
            {
                "messages": [
                    *history[:1],
                    {
                        **history[1],
                        "tool_calls": [
                            {
                                "id": "call_1",
                                "function": {
                                    "name": "get_weather",
                                    "arguments": {"city": "Paris"},
                                    "index": 0,
                                },
                            }
                        ],
                    },
                    history[2],
                ]
            },
            "tool calls' `function.index`",
            {"messages": history},
        ),
        Refused(
            fields("OllamaMessage.images"),
            OLLAMA_CHAT,
            {"messages": [{"role": "user", "content": "what?", "images": ["aGk="]}]},
            "images",
        ),
        Effect(
            fields(
                "OllamaChatRequest.tools",
                "OllamaTool.type",
                "OllamaTool.function",
                "OllamaFunctionDefinition.name",
                "OllamaFunctionDefinition.description",
                "OllamaFunctionDefinition.parameters",
            ),
            OLLAMA_CHAT,
            {"tools": [OLLAMA_TOOL]},
            lambda p: (
                [(t.name, t.description, t.parameters) for t in p.tools]
                == [(WEATHER["name"], WEATHER["description"], WEATHER["parameters"])]
            ),
        ),
        Effect(
            fields("OllamaChatRequest.tool_choice"),
            OLLAMA_CHAT,
            {"tools": [OLLAMA_TOOL], "tool_choice": "required"},
            lambda p: p.tool_choice == "required",
        ),
        Effect(
            fields(
                "OllamaNamedToolChoice.type",
                "OllamaNamedToolChoice.function",
                "OllamaNamedFunction.name",
            ),
            OLLAMA_CHAT,
            {
                "tools": [OLLAMA_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
            lambda p: p.tool_choice == NamedToolChoice(name="get_weather"),
        ),
        Effect(
            fields("OllamaOptions.num_predict"),
            OLLAMA_CHAT,
            {"options": {"num_predict": 7}},
            lambda p: p.max_tokens == 7,
        ),
        *(
            Effect(
                fields(f"OllamaOptions.{name}"),
                OLLAMA_CHAT,
                {"options": {**options, name: value}},
                check,
            )
            for name, value, check in (
                ("temperature", 0.3, lambda p: p.temperature == 0.3),
                ("top_p", 0.5, lambda p: p.top_p == 0.5),
                ("top_k", 7, lambda p: p.top_k == 7),
                ("min_p", 0.2, lambda p: p.min_p == 0.2),
                ("seed", 42, lambda p: p.seed == 42),
                ("stop", ["END"], lambda p: p.stop == ("END",)),
                ("repeat_penalty", 1.2, lambda p: p.repetition_penalty == 1.2),
                ("presence_penalty", 0.5, lambda p: p.presence_penalty == 0.5),
                ("frequency_penalty", 0.25, lambda p: p.frequency_penalty == 0.25),
                ("speculative", True, lambda p: p.speculative is True),
            )
        ),
        Effect(
            fields("OllamaOptions.num_ctx"),
            OLLAMA_CHAT,
            {"options": {**options, "num_ctx": 2048}},
            lambda p: p.context_tokens == 2048,
        ),
        Effect(
            fields("OllamaOptions.repeat_last_n"),
            OLLAMA_GENERATE,
            {"options": {**options, "repeat_penalty": 1.3, "repeat_last_n": 0}},
            lambda p: p.repetition_penalty == 1.0,
        ),
        NoOp(
            fields("OllamaOptions.repeat_last_n"),
            OLLAMA_GENERATE,
            {"options": {**options, "repeat_penalty": 1.3, "repeat_last_n": 64}},
            "`repeat_last_n` 64 (Ollama's default, as without it)",
            {"options": {**options, "repeat_penalty": 1.3}},
        ),
        Effect(
            fields("OllamaOptions.repeat_last_n"),
            OLLAMA_GENERATE,
            {"options": {**options, "repeat_penalty": 1.3, "repeat_last_n": 8}},
            lambda p: p.repetition_window == 8 and p.repetition_penalty == 1.3,
        ),
        Effect(
            fields("OllamaOptions.repeat_last_n"),
            OLLAMA_GENERATE,
            {"options": {**options, "repeat_penalty": 1.3, "repeat_last_n": -1}},
            lambda p: p.repetition_window is None and p.repetition_penalty == 1.3,
        ),
        *(
            Refused(
                fields("OllamaOptions.speculative"),
                endpoint,
                {"options": {**options, "speculative": "sometimes"}},
                "speculative",
            )
            for endpoint in (OLLAMA_CHAT, OLLAMA_GENERATE)
        ),
        Refused(
            fields("OllamaOptions.repeat_last_n"),
            OLLAMA_GENERATE,
            {"options": {**options, "repeat_last_n": -2}},
            "options.repeat_last_n",
        ),
        *(
            Refused(
                fields(f"OllamaOptions.{name}"),
                OLLAMA_GENERATE,
                {"options": {**options, name: value}},
                f"options.{name}",
            )
            for name, value in (
                ("typical_p", 0.7),
                ("tfs_z", 0.9),
                ("mirostat", 2),
                ("penalize_newline", False),
            )
        ),
        *(
            NoOp(
                fields(f"OllamaOptions.{name}"),
                OLLAMA_GENERATE,
                {"options": {**options, name: value}},
                f"`{name}`",
                {"options": options},
            )
            for name, value in (
                ("typical_p", 1.0),
                ("tfs_z", 1.0),
                ("mirostat", 0),
                ("mirostat_tau", 4.0),
                ("mirostat_eta", 0.2),
                ("penalize_newline", True),
                ("num_keep", 5),
                ("numa", True),
                ("num_batch", 256),
                ("num_gpu", 1),
                ("main_gpu", 0),
                ("low_vram", True),
                ("f16_kv", True),
                ("logits_all", True),
                ("vocab_only", False),
                ("use_mmap", False),
                ("use_mlock", True),
                ("embedding_only", False),
                ("num_thread", 2),
            )
        ),
        Effect(
            fields("OllamaGenerateRequest.prompt"),
            OLLAMA_GENERATE,
            {"prompt": "Tell me"},
            lambda p: last(p).content == "Tell me",
        ),
        Effect(
            fields("OllamaGenerateRequest.system"),
            OLLAMA_GENERATE,
            {"system": "rules"},
            lambda p: p.messages[0] == ChatMessage(role="system", content="rules"),
        ),
        Effect(
            fields("OllamaGenerateRequest.raw"),
            OLLAMA_GENERATE,
            {"raw": True},
            lambda p: p.is_raw and p.prompt == "hi",
        ),
        Refused(
            fields("OllamaGenerateRequest.suffix"), OLLAMA_GENERATE, {"suffix": "end"}, "suffix"
        ),
        Refused(
            fields("OllamaGenerateRequest.template"),
            OLLAMA_GENERATE,
            {"template": "{{ .Prompt }}"},
            "template",
        ),
        Refused(
            fields("OllamaGenerateRequest.context"), OLLAMA_GENERATE, {"context": [1, 2]}, "context"
        ),
        Refused(
            fields("OllamaGenerateRequest.images"), OLLAMA_GENERATE, {"images": ["aGk="]}, "images"
        ),
        Shows(
            fields("OllamaShowRequest.model"),
            OLLAMA_SHOW,
            {"model": SMOLLM2},
            lambda answer: answer["status"] == 200 and "details" in answer["json"],
        ),
        Shows(
            fields("OllamaShowRequest.name"),
            OLLAMA_SHOW,
            {"name": SMOLLM2},
            lambda answer: answer["status"] == 200 and "details" in answer["json"],
        ),
        NoOp(
            fields("OllamaShowRequest.verbose"),
            OLLAMA_SHOW,
            {"model": SMOLLM2, "verbose": True},
            "`/api/show` `verbose`",
            {"model": SMOLLM2},
        ),
    ]
    # Pulling and deleting a model's files.
    decisions += [
        Shows(
            fields("OllamaPullRequest.model"),
            OLLAMA_PULL,
            {"model": "no-such-model"},
            lambda answer: answer["status"] == 404,
        ),
        Shows(
            fields("OllamaPullRequest.stream"),
            OLLAMA_PULL,
            {"stream": False},
            lambda answer: answer["json"] == {"status": "success"},
        ),
        Shows(
            fields("OllamaDeleteRequest.model"),
            OLLAMA_DELETE,
            {"model": SMOLLM2},
            lambda answer: answer["status"] == 409,  # in use by the placed instance
        ),
    ]
    # Fields both /api/chat and /api/generate take.
    for endpoint, model in (
        (OLLAMA_CHAT, "OllamaChatRequest"),
        (OLLAMA_GENERATE, "OllamaGenerateRequest"),
    ):
        decisions += [
            Effect(fields(f"{model}.model"), endpoint, {}, lambda p: p.model == SMOLLM2, True),
            Effect(
                fields(f"{model}.format"),
                endpoint,
                {"format": "json"},
                lambda p: p.response_format == "json_object",
            ),
            Effect(
                fields(f"{model}.format"),
                endpoint,
                {"format": SCHEMA},
                lambda p: (p.response_format, p.json_schema) == ("json_schema", SCHEMA),
            ),
            Effect(
                fields(f"{model}.options"),
                endpoint,
                {"options": {"num_predict": 9, "temperature": 0.1}},
                lambda p: (p.max_tokens, p.temperature) == (9, 0.1),
            ),
            Effect(fields(f"{model}.stream"), endpoint, {"stream": True}, lambda p: p.stream),
            Sends(
                fields(f"{model}.keep_alive"),
                endpoint,
                {"keep_alive": "5m"},
                lambda command: command.keep_alive == KeepAlive(seconds=300.0),
            ),
            Effect(
                fields(f"{model}.think"),
                endpoint,
                {"think": "low", "model": THINKING_MODEL},
                lambda p: (p.enable_thinking, p.reasoning_effort) == (True, "low"),
            ),
            Effect(
                fields(f"{model}.think"),
                endpoint,
                {"think": False},
                lambda p: p.enable_thinking is False,
            ),
            # As Ollama answers it: a model without the "thinking" capability cannot think.
            Refused(
                fields(f"{model}.think"), endpoint, {"think": True}, "does not support thinking"
            ),
            Effect(fields(f"{model}.logprobs"), endpoint, {"logprobs": True}, lambda p: p.logprobs),
            Effect(
                fields(f"{model}.top_logprobs"),
                endpoint,
                {"logprobs": True, "top_logprobs": 2},
                lambda p: p.top_logprobs == 2,
            ),
        ]
    return decisions
