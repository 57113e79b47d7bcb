"""Decisions for every declared field of the Responses request models."""

from __future__ import annotations

from exo.api.tests.field_decisions import (
    CALL,
    RESPONSES,
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


def responses_effects() -> list[Decision]:
    function_tool = {"type": "function", **WEATHER}
    namespace_tool = {"type": "namespace", "name": "files", "tools": [function_tool]}
    call_item = {
        "type": "function_call",
        "call_id": "call_1",
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    output_item = {"type": "function_call_output", "call_id": "call_1", "output": "20C"}
    schema_format = {"type": "json_schema", "schema": SCHEMA}
    return [
        Effect(fields("ResponsesRequest.model"), RESPONSES, {}, lambda p: p.model == SMOLLM2, True),
        Effect(
            fields("ResponsesRequest.input"),
            RESPONSES,
            {"input": "Tell me"},
            lambda p: last(p).content == "Tell me",
        ),
        Effect(
            fields("ResponsesRequest.instructions"),
            RESPONSES,
            {"instructions": "be brief"},
            lambda p: p.messages[0] == ChatMessage(role="system", content="be brief"),
        ),
        Effect(
            fields("MessageItem.type", "MessageItem.role", "MessageItem.content"),
            RESPONSES,
            {"input": [{"type": "message", "role": "developer", "content": "rules"}, USER_HI]},
            lambda p: p.messages[0] == ChatMessage(role="system", content="rules"),
        ),
        Effect(
            fields("InputTextPart.type", "InputTextPart.text"),
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_text", "text": "part"}]}]},
            lambda p: last(p).content == "part",
        ),
        Effect(
            fields(
                "OutputTextInputPart.type",
                "OutputTextInputPart.text",
                "RefusalInputPart.type",
                "RefusalInputPart.refusal",
            ),
            RESPONSES,
            {
                "input": [
                    USER_HI,
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "output_text", "text": "said"},
                            {"type": "refusal", "refusal": "no"},
                        ],
                    },
                    USER_HI,
                ]
            },
            lambda p: p.messages[1].content == "said\nno",
        ),
        Refused(
            fields(
                "InputImagePart.type",
                "InputImagePart.image_url",
                "InputImagePart.file_id",
                "InputImagePart.detail",
            ),
            RESPONSES,
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_image",
                                "image_url": "data:,",
                                "file_id": "f",
                                "detail": "low",
                            }
                        ],
                    }
                ]
            },
            "input[0].content[0]",
        ),
        Refused(
            fields("UnsupportedPart.type"),
            RESPONSES,
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input_file",
        ),
        Refused(
            fields("UnsupportedItem.type"),
            RESPONSES,
            {"input": [{"type": "item_reference", "id": "x"}]},
            "input[0].type",
        ),
        Effect(
            fields(
                "FunctionCallItem.type",
                "FunctionCallItem.call_id",
                "FunctionCallItem.name",
                "FunctionCallItem.arguments",
                "FunctionCallOutputItem.type",
                "FunctionCallOutputItem.call_id",
                "FunctionCallOutputItem.output",
            ),
            RESPONSES,
            {"input": [USER_HI, call_item, output_item]},
            lambda p: (
                p.messages[1:]
                == (
                    ChatMessage(role="assistant", tool_calls=(CALL,)),
                    ChatMessage(role="tool", content="20C", tool_call_id="call_1"),
                )
            ),
        ),
        NoOp(
            fields("FunctionCallItem.id", "FunctionCallOutputItem.id"),
            RESPONSES,
            {"input": [USER_HI, {**call_item, "id": "fc_1"}, {**output_item, "id": "fco_1"}]},
            "input items' `id`",
            {"input": [USER_HI, call_item, output_item]},
        ),
        Effect(
            fields(
                "ReasoningItem.type",
                "ReasoningItem.summary",
                "SummaryTextPart.type",
                "SummaryTextPart.text",
            ),
            RESPONSES,
            {
                "input": [
                    USER_HI,
                    {"type": "reasoning", "summary": [{"type": "summary_text", "text": "think"}]},
                    {"role": "assistant", "content": "ok"},
                    USER_HI,
                ]
            },
            lambda p: p.messages[1].reasoning_content == "think",
        ),
        Effect(
            fields("ReasoningItem.content", "ReasoningTextPart.type", "ReasoningTextPart.text"),
            RESPONSES,
            {
                "input": [
                    USER_HI,
                    {"type": "reasoning", "content": [{"type": "reasoning_text", "text": "raw"}]},
                    {"role": "assistant", "content": "ok"},
                    USER_HI,
                ]
            },
            lambda p: p.messages[1].reasoning_content == "raw",
        ),
        NoOp(
            fields("ReasoningItem.id", "ReasoningItem.encrypted_content"),
            RESPONSES,
            {
                "input": [
                    USER_HI,
                    {
                        "type": "reasoning",
                        "id": "rs_1",
                        "encrypted_content": "opaque",
                        "summary": [],
                    },
                    {"role": "assistant", "content": "ok"},
                    USER_HI,
                ]
            },
            "reasoning items' `id`, `encrypted_content`",
            {
                "input": [
                    USER_HI,
                    {"type": "reasoning", "summary": []},
                    {"role": "assistant", "content": "ok"},
                    USER_HI,
                ]
            },
        ),
        Effect(
            fields("ResponsesRequest.max_output_tokens"),
            RESPONSES,
            {"max_output_tokens": 17},
            lambda p: p.max_tokens == 17,
        ),
        *sampling_effects(
            RESPONSES,
            "ResponsesRequest",
            {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "speculative": False},
        ),
        Refused(
            fields("ResponsesRequest.speculative"), RESPONSES, {"speculative": 2}, "speculative"
        ),
        Effect(
            fields(
                "ResponsesRequest.tools",
                "FunctionToolSpec.type",
                "FunctionToolSpec.name",
                "FunctionToolSpec.description",
                "FunctionToolSpec.parameters",
            ),
            RESPONSES,
            {"tools": [function_tool]},
            lambda p: (
                [(t.name, t.description, t.parameters) for t in p.tools]
                == [(WEATHER["name"], WEATHER["description"], WEATHER["parameters"])]
            ),
        ),
        NoOp(
            fields("FunctionToolSpec.strict"),
            RESPONSES,
            {"tools": [{**function_tool, "strict": True}]},
            "`tools[].strict`",
            {"tools": [function_tool]},
        ),
        Shows(
            fields("UnsupportedTool.type"),
            RESPONSES,
            {"tools": [{"type": "web_search"}]},
            lambda answer: answer["headers"].get("x-exo-tools-not-offered") == "web_search",
        ),
        Effect(
            fields("NamespaceToolSpec.type", "NamespaceToolSpec.name", "NamespaceToolSpec.tools"),
            RESPONSES,
            {"tools": [namespace_tool]},
            lambda p: [tool.name for tool in p.tools] == ["files__get_weather"],
        ),
        NoOp(
            fields("NamespaceToolSpec.description"),
            RESPONSES,
            {"tools": [{**namespace_tool, "description": "weather tools"}]},
            "namespace tools' `description`",
            {"tools": [namespace_tool]},
        ),
        Effect(
            fields("FunctionCallItem.namespace"),
            RESPONSES,
            {
                "tools": [namespace_tool],
                "input": [USER_HI, {**call_item, "namespace": "files"}, output_item],
            },
            lambda p: p.messages[1].tool_calls[0].name == "files__get_weather",
        ),
        Effect(
            fields("FunctionToolChoice.namespace"),
            RESPONSES,
            {
                "tools": [namespace_tool],
                "tool_choice": {"type": "function", "name": "get_weather", "namespace": "files"},
            },
            lambda p: p.tool_choice == NamedToolChoice(name="files__get_weather"),
        ),
        Effect(
            fields("ResponsesRequest.tool_choice"),
            RESPONSES,
            {"tools": [function_tool], "tool_choice": "required"},
            lambda p: p.tool_choice == "required",
        ),
        Effect(
            fields("FunctionToolChoice.type", "FunctionToolChoice.name"),
            RESPONSES,
            {"tools": [function_tool], "tool_choice": {"type": "function", "name": "get_weather"}},
            lambda p: p.tool_choice == NamedToolChoice(name="get_weather"),
        ),
        Refused(
            fields("UnsupportedToolChoice.type"),
            RESPONSES,
            {"tool_choice": {"type": "allowed_tools", "tools": []}},
            "tool_choice",
        ),
        Effect(
            fields("ResponsesRequest.parallel_tool_calls"),
            RESPONSES,
            {"parallel_tool_calls": False},
            lambda p: not p.parallel_tool_calls,
        ),
        Effect(
            fields("ResponsesRequest.reasoning", "ReasoningConfig.effort"),
            RESPONSES,
            {"reasoning": {"effort": "low"}},
            lambda p: (p.enable_thinking, p.reasoning_effort) == (True, "low"),
        ),
        Shows(
            fields("ReasoningConfig.summary"),
            RESPONSES,
            {"reasoning": {"summary": "concise"}},
            lambda answer: answer["json"]["reasoning"]["summary"] == "concise",
        ),
        Shows(
            fields("ReasoningConfig.generate_summary"),
            RESPONSES,
            {"reasoning": {"generate_summary": "detailed"}},
            lambda answer: answer["json"]["reasoning"]["summary"] == "detailed",
        ),
        Effect(
            fields("ResponsesRequest.text", "TextConfig.format", "TextFormatSpec.type"),
            RESPONSES,
            {"text": {"format": {"type": "json_object"}}},
            lambda p: p.response_format == "json_object",
        ),
        Effect(
            fields("TextFormatSpec.schema_"),
            RESPONSES,
            {"text": {"format": schema_format}},
            lambda p: (p.response_format, p.json_schema) == ("json_schema", SCHEMA),
        ),
        Shows(
            fields("TextFormatSpec.name", "TextFormatSpec.description", "TextFormatSpec.strict"),
            RESPONSES,
            {
                "text": {
                    "format": {**schema_format, "name": "n", "description": "d", "strict": True}
                }
            },
            lambda answer: (
                answer["json"]["text"]["format"]
                == {**schema_format, "name": "n", "description": "d", "strict": True}
            ),
        ),
        Shows(
            fields("TextConfig.verbosity"),
            RESPONSES,
            {"text": {"verbosity": "low"}},
            lambda answer: answer["json"]["text"]["verbosity"] == "low",
        ),
        Effect(fields("ResponsesRequest.stream"), RESPONSES, {"stream": True}, lambda p: p.stream),
        Effect(
            fields("ResponsesRequest.include"),
            RESPONSES,
            {"include": ["message.output_text.logprobs"]},
            lambda p: p.logprobs,
        ),
        NoOp(
            fields("ResponsesRequest.include"),
            RESPONSES,
            {"include": ["reasoning.encrypted_content", "web_search_call.results"]},
            "`include` values other than `message.output_text.logprobs`",
        ),
        Effect(
            fields("ResponsesRequest.top_logprobs"),
            RESPONSES,
            {"top_logprobs": 2},
            lambda p: (p.logprobs, p.top_logprobs) == (True, 2),
        ),
        Refused(
            fields("ResponsesRequest.previous_response_id"),
            RESPONSES,
            {"previous_response_id": "resp_1"},
            "previous_response_id",
        ),
        Refused(
            fields("ResponsesRequest.conversation"),
            RESPONSES,
            {"conversation": "conv_1"},
            "conversation",
        ),
        Refused(
            fields("ResponsesRequest.prompt"), RESPONSES, {"prompt": {"id": "pmpt_1"}}, "prompt"
        ),
        Refused(
            fields("ResponsesRequest.background"), RESPONSES, {"background": True}, "background"
        ),
        *(
            NoOp(fields(f"ResponsesRequest.{name}"), RESPONSES, {name: value}, f"`{name}`")
            for name, value in {
                "store": False,
                "metadata": {"k": "v"},
                "truncation": "auto",
                "user": "u",
                "safety_identifier": "s",
                "prompt_cache_key": "k",
                "service_tier": "auto",
                "max_tool_calls": 3,
                "stream_options": {"include_obfuscation": False},
            }.items()
        ),
    ]
