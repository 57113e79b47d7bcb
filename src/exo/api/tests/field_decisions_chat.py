"""Decisions for every declared field of the Chat Completions request models."""

from __future__ import annotations

from exo.api.tests.field_decisions import (
    CALL,
    CHAT,
    CHAT_TOOL,
    SCHEMA,
    USER_HI,
    WEATHER,
    Decision,
    Effect,
    NoOp,
    Refused,
    Shows,
    fields,
    last,
    sampling_effects,
)
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
)
from exo.testing.builders import SMOLLM2


def chat_effects() -> list[Decision]:
    named = {"type": "function", "function": {"name": "get_weather"}}
    history = [
        USER_HI,
        {
            "role": "assistant",
            "content": "let me look",
            "name": "helper",
            "reasoning_content": "a tool knows",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "20C"},
    ]
    legacy = [
        USER_HI,
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}},
        {"role": "function", "name": "f", "content": "done"},
    ]
    return [
        Effect(fields("ChatCompletionRequest.model"), CHAT, {}, lambda p: p.model == SMOLLM2, True),
        Effect(
            fields("ChatCompletionRequest.messages", "UserMessage.role", "UserMessage.content"),
            CHAT,
            {"messages": [{"role": "user", "content": "Tell me"}]},
            lambda p: last(p) == ChatMessage(role="user", content="Tell me"),
        ),
        Effect(
            fields("UserMessage.name"),
            CHAT,
            {"messages": [{"role": "user", "content": "hi", "name": "bob"}]},
            lambda p: last(p).name == "bob",
        ),
        Effect(
            fields("SystemMessage.role", "SystemMessage.content", "SystemMessage.name"),
            CHAT,
            {"messages": [{"role": "system", "content": "rules", "name": "n"}, USER_HI]},
            lambda p: p.messages[0] == ChatMessage(role="system", content="rules", name="n"),
        ),
        Effect(
            fields("DeveloperMessage.role", "DeveloperMessage.content", "DeveloperMessage.name"),
            CHAT,
            {"messages": [{"role": "developer", "content": "rules", "name": "d"}, USER_HI]},
            lambda p: p.messages[0] == ChatMessage(role="system", content="rules", name="d"),
        ),
        Effect(
            fields("TextContentPart.type", "TextContentPart.text"),
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "part"}]}]},
            lambda p: last(p).content == "part",
        ),
        Refused(
            fields(
                "ImageContentPart.type",
                "ImageContentPart.image_url",
                "ImageUrl.url",
                "ImageUrl.detail",
            ),
            CHAT,
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}}
                        ],
                    }
                ]
            },
            "messages[0].content[0]",
        ),
        Refused(
            fields("AudioContentPart.type", "AudioContentPart.input_audio"),
            CHAT,
            {
                "messages": [
                    {"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}
                ]
            },
            "messages[0].content[0]",
        ),
        Refused(
            fields("FileContentPart.type", "FileContentPart.file"),
            CHAT,
            {"messages": [{"role": "user", "content": [{"type": "file", "file": {}}]}]},
            "messages[0].content[0]",
        ),
        Effect(
            fields(
                "AssistantMessage.role",
                "AssistantMessage.content",
                "AssistantMessage.name",
                "AssistantMessage.reasoning_content",
                "AssistantMessage.tool_calls",
                "ToolCallParam.id",
                "ToolCallParam.type",
                "ToolCallParam.function",
                "FunctionCallParam.name",
                "FunctionCallParam.arguments",
                "ToolMessage.role",
                "ToolMessage.content",
                "ToolMessage.tool_call_id",
            ),
            CHAT,
            {"messages": history},
            lambda p: (
                p.messages[1:]
                == (
                    ChatMessage(
                        role="assistant",
                        content="let me look",
                        name="helper",
                        reasoning_content="a tool knows",
                        tool_calls=(CALL,),
                    ),
                    ChatMessage(role="tool", content="20C", tool_call_id="call_1"),
                )
            ),
        ),
        Effect(
            fields("AssistantMessage.refusal"),
            CHAT,
            {"messages": [USER_HI, {"role": "assistant", "refusal": "I cannot"}, USER_HI]},
            lambda p: p.messages[1].content == "I cannot",
        ),
        Effect(
            fields("RefusalContentPart.type", "RefusalContentPart.refusal"),
            CHAT,
            {
                "messages": [
                    USER_HI,
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                    USER_HI,
                ]
            },
            lambda p: p.messages[1].content == "no",
        ),
        Effect(
            fields(
                "AssistantMessage.function_call",
                "FunctionMessage.role",
                "FunctionMessage.name",
                "FunctionMessage.content",
            ),
            CHAT,
            {"messages": legacy},
            lambda p: (
                p.messages[1].tool_calls[0].name == "f"
                and p.messages[2]
                == ChatMessage(role="tool", content="done", name="f", tool_call_id="call_1")
            ),
        ),
        Effect(
            fields("ChatCompletionRequest.max_tokens"),
            CHAT,
            {"max_tokens": 7},
            lambda p: p.max_tokens == 7,
        ),
        Effect(
            fields("ChatCompletionRequest.max_completion_tokens"),
            CHAT,
            {"max_tokens": None, "max_completion_tokens": 9},
            lambda p: p.max_tokens == 9,
        ),
        *sampling_effects(
            CHAT,
            "ChatCompletionRequest",
            {
                "temperature": 0.3,
                "top_p": 0.5,
                "top_k": 7,
                "min_p": 0.2,
                "seed": 42,
                "presence_penalty": 0.5,
                "frequency_penalty": 0.25,
                "repetition_penalty": 1.2,
                "speculative": "auto",
            },
        ),
        Refused(
            fields("ChatCompletionRequest.speculative"),
            CHAT,
            {"speculative": "sometimes"},
            "speculative",
        ),
        Effect(
            fields("ChatCompletionRequest.stop"),
            CHAT,
            {"stop": ["END"]},
            lambda p: p.stop == ("END",),
        ),
        Effect(fields("ChatCompletionRequest.stream"), CHAT, {"stream": True}, lambda p: p.stream),
        Shows(
            fields("ChatCompletionRequest.stream_options", "StreamOptions.include_usage"),
            CHAT,
            {"stream": True, "stream_options": {"include_usage": True}},
            lambda answer: any(
                event.get("usage") and not event.get("choices") for event in answer["events"]
            ),
        ),
        Refused(
            fields("ChatCompletionRequest.stream_options"),
            CHAT,
            {"stream_options": {"include_usage": True}},
            "stream_options",
        ),
        Refused(fields("ChatCompletionRequest.n"), CHAT, {"n": 2}, "n"),
        Effect(
            fields(
                "ChatCompletionRequest.tools",
                "ChatTool.type",
                "ChatTool.function",
                "FunctionDefinition.name",
                "FunctionDefinition.description",
                "FunctionDefinition.parameters",
            ),
            CHAT,
            {"tools": [CHAT_TOOL]},
            lambda p: (
                [(t.name, t.description, t.parameters) for t in p.tools]
                == [(WEATHER["name"], WEATHER["description"], WEATHER["parameters"])]
            ),
        ),
        Effect(
            fields("ChatCompletionRequest.tool_choice"),
            CHAT,
            {"tools": [CHAT_TOOL], "tool_choice": "required"},
            lambda p: p.tool_choice == "required",
        ),
        Effect(
            fields(
                "NamedToolChoiceParam.type", "NamedToolChoiceParam.function", "NamedFunction.name"
            ),
            CHAT,
            {"tools": [CHAT_TOOL], "tool_choice": named},
            lambda p: p.tool_choice == NamedToolChoice(name="get_weather"),
        ),
        Effect(
            fields("ChatCompletionRequest.parallel_tool_calls"),
            CHAT,
            {"parallel_tool_calls": False},
            lambda p: not p.parallel_tool_calls,
        ),
        Effect(
            fields("ChatCompletionRequest.functions"),
            CHAT,
            {"functions": [WEATHER]},
            lambda p: [t.name for t in p.tools] == ["get_weather"],
        ),
        Effect(
            fields("ChatCompletionRequest.function_call"),
            CHAT,
            {"functions": [WEATHER], "function_call": {"name": "get_weather"}},
            lambda p: p.tool_choice == NamedToolChoice(name="get_weather"),
        ),
        Effect(
            fields("ChatCompletionRequest.logprobs"), CHAT, {"logprobs": True}, lambda p: p.logprobs
        ),
        Effect(
            fields("ChatCompletionRequest.top_logprobs"),
            CHAT,
            {"logprobs": True, "top_logprobs": 3},
            lambda p: p.top_logprobs == 3,
        ),
        Effect(
            fields("ChatCompletionRequest.response_format", "ResponseFormat.type"),
            CHAT,
            {"response_format": {"type": "json_object"}},
            lambda p: p.response_format == "json_object",
        ),
        Effect(
            fields("ResponseFormat.json_schema", "JsonSchemaSpec.schema_"),
            CHAT,
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            lambda p: (p.response_format, p.json_schema) == ("json_schema", SCHEMA),
        ),
        NoOp(
            fields("JsonSchemaSpec.name", "JsonSchemaSpec.description", "JsonSchemaSpec.strict"),
            CHAT,
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {
                        "name": "n",
                        "description": "d",
                        "strict": True,
                        "schema": SCHEMA,
                    },
                }
            },
            "`response_format.json_schema.name`, `description`, `strict`",
            {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
        ),
        NoOp(
            fields("FunctionDefinition.strict"),
            CHAT,
            {"tools": [{"type": "function", "function": {**WEATHER, "strict": True}}]},
            "`tools[].function.strict`",
            {"tools": [CHAT_TOOL]},
        ),
        Effect(
            fields("ChatCompletionRequest.chat_template_kwargs"),
            CHAT,
            {"chat_template_kwargs": {"enable_thinking": False}},
            lambda p: p.enable_thinking is False,
        ),
        Refused(
            fields("ChatCompletionRequest.chat_template_kwargs"),
            CHAT,
            {"chat_template_kwargs": {"tools_in_user_message": True}},
            "chat_template_kwargs.tools_in_user_message",
        ),
        Effect(
            fields("ChatCompletionRequest.reasoning_effort"),
            CHAT,
            {"reasoning_effort": "low"},
            lambda p: p.reasoning_effort == "low",
        ),
        Effect(
            fields("ChatCompletionRequest.logit_bias"),
            CHAT,
            {"logit_bias": {"7042": -100}},
            lambda p: p.logit_bias == {7042: -100.0},
        ),
        Refused(
            fields("ChatCompletionRequest.logit_bias"),
            CHAT,
            {"logit_bias": {"Paris": -100}},
            "logit_bias",
        ),
        Refused(
            fields("ChatCompletionRequest.logit_bias"),
            CHAT,
            {"logit_bias": {"49152": 1}},
            "logit_bias",
        ),
        Refused(
            fields("ChatCompletionRequest.logit_bias"),
            CHAT,
            {"logit_bias": {"5": 101}},
            "logit_bias",
        ),
        NoOp(fields("ChatCompletionRequest.user"), CHAT, {"user": "u-1"}, "`user`"),
        NoOp(fields("ChatCompletionRequest.store"), CHAT, {"store": True}, "`store`"),
        NoOp(
            fields("ChatCompletionRequest.metadata"), CHAT, {"metadata": {"k": "v"}}, "`metadata`"
        ),
        NoOp(
            fields("ChatCompletionRequest.service_tier"),
            CHAT,
            {"service_tier": "auto"},
            "`service_tier`",
        ),
    ]
