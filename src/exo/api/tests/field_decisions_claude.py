"""Decisions for every declared field of the Claude Messages request models (count_tokens
included)."""

from __future__ import annotations

from exo.api.tests.field_decisions import (
    CALL,
    CLAUDE,
    CLAUDE_TOOL,
    COUNT_TOKENS,
    SCHEMA,
    USER_HI,
    Decision,
    Effect,
    NoOp,
    Refused,
    fields,
    last,
    sampling_effects,
)
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
)
from exo.testing.builders import SMOLLM2


def claude_effects() -> list[Decision]:
    history = [
        USER_HI,
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "a tool knows", "signature": "sig"},
                {"type": "text", "text": "let me look"},
                {
                    "type": "tool_use",
                    "id": "call_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {
                    "type": "tool_result",
                    "tool_use_id": "call_1",
                    "content": [{"type": "text", "text": "20C"}],
                    "is_error": True,
                }
            ],
        },
    ]
    schema_config = {"format": {"type": "json_schema", "schema": SCHEMA}}
    decisions: list[Decision] = [
        Effect(
            fields("MessagesRequest.max_tokens"),
            CLAUDE,
            {"max_tokens": 7},
            lambda p: p.max_tokens == 7,
        ),
        *sampling_effects(
            CLAUDE,
            "MessagesRequest",
            {"temperature": 0.3, "top_p": 0.5, "top_k": 7, "speculative": True},
        ),
        Refused(
            fields("MessagesRequest.speculative"), CLAUDE, {"speculative": "always"}, "speculative"
        ),
        Effect(
            fields("MessagesRequest.stop_sequences"),
            CLAUDE,
            {"stop_sequences": ["END", ""]},
            lambda p: p.stop == ("END",),
        ),
        Effect(fields("MessagesRequest.stream"), CLAUDE, {"stream": True}, lambda p: p.stream),
        Effect(
            fields(
                "InputMessage.role",
                "InputMessage.content",
                "TextBlockParam.type",
                "TextBlockParam.text",
                "ThinkingBlockParam.type",
                "ThinkingBlockParam.thinking",
                "ToolUseBlockParam.type",
                "ToolUseBlockParam.id",
                "ToolUseBlockParam.name",
                "ToolUseBlockParam.input",
                "ToolResultBlockParam.type",
                "ToolResultBlockParam.tool_use_id",
                "ToolResultBlockParam.content",
                "ToolResultBlockParam.is_error",
            ),
            CLAUDE,
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
                    ChatMessage(role="tool", content="Error: 20C", tool_call_id="call_1"),
                )
            ),
        ),
        NoOp(
            fields("ThinkingBlockParam.signature"),
            CLAUDE,
            {
                "messages": [
                    USER_HI,
                    {
                        "role": "assistant",
                        "content": [{"type": "thinking", "thinking": "t", "signature": "s"}],
                    },
                    USER_HI,
                ]
            },
            "thinking blocks' `signature`",
            {
                "messages": [
                    USER_HI,
                    {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}]},
                    USER_HI,
                ]
            },
        ),
        NoOp(
            fields("RedactedThinkingBlockParam.type", "RedactedThinkingBlockParam.data"),
            CLAUDE,
            {
                "messages": [
                    USER_HI,
                    {
                        "role": "assistant",
                        "content": [
                            {"type": "redacted_thinking", "data": "x"},
                            {"type": "text", "text": "ok"},
                        ],
                    },
                    USER_HI,
                ]
            },
            "`redacted_thinking` blocks",
            {
                "messages": [
                    USER_HI,
                    {"role": "assistant", "content": [{"type": "text", "text": "ok"}]},
                    USER_HI,
                ]
            },
        ),
        Refused(
            fields("ImageBlockParam.type", "ImageBlockParam.source"),
            CLAUDE,
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
            "messages.0.content.0",
        ),
        Refused(
            fields("DocumentBlockParam.type", "DocumentBlockParam.source"),
            CLAUDE,
            {"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]},
            "messages.0.content.0",
        ),
        Refused(
            fields("OtherBlockParam.type"),
            CLAUDE,
            {"messages": [{"role": "user", "content": [{"type": "search_result"}]}]},
            "search_result",
        ),
        Refused(
            fields("ToolParam.type"),
            CLAUDE,
            {"tools": [{"name": "web", "type": "web_search_20250305"}]},
            "type 'web_search_20250305'",
        ),
        NoOp(
            fields("ThinkingEnabled.budget_tokens"),
            CLAUDE,
            {"thinking": {"type": "enabled", "budget_tokens": 2048}},
            "`thinking.budget_tokens`",
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
        ),
    ]
    # The prompt fields are shared with count_tokens: each is checked on both routes.
    for endpoint, model in ((CLAUDE, "MessagesRequest"), (COUNT_TOKENS, "CountTokensRequest")):
        decisions += [
            Effect(fields(f"{model}.model"), endpoint, {}, lambda p: p.model == SMOLLM2, True),
            Effect(
                fields(f"{model}.messages"),
                endpoint,
                {"messages": [{"role": "user", "content": "Tell me"}]},
                lambda p: last(p).content == "Tell me",
            ),
            Effect(
                fields(f"{model}.system"),
                endpoint,
                {"system": [{"type": "text", "text": "rules"}]},
                lambda p: p.messages[0] == ChatMessage(role="system", content="rules"),
            ),
            Effect(
                fields(
                    f"{model}.tools",
                    "ToolParam.name",
                    "ToolParam.description",
                    "ToolParam.input_schema",
                ),
                endpoint,
                {"tools": [CLAUDE_TOOL]},
                lambda p: (
                    [(t.name, t.description, t.parameters) for t in p.tools]
                    == [("get_weather", "Weather", SCHEMA)]
                ),
            ),
            Effect(
                fields(
                    f"{model}.tool_choice",
                    "ToolChoiceAny.type",
                    "ToolChoiceAny.disable_parallel_tool_use",
                ),
                endpoint,
                {
                    "tools": [CLAUDE_TOOL],
                    "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
                },
                lambda p: (p.tool_choice, p.parallel_tool_calls) == ("required", False),
            ),
            Effect(
                fields("ToolChoiceAuto.type", "ToolChoiceAuto.disable_parallel_tool_use"),
                endpoint,
                {
                    "tools": [CLAUDE_TOOL],
                    "tool_choice": {"type": "auto", "disable_parallel_tool_use": True},
                },
                lambda p: (p.tool_choice, p.parallel_tool_calls) == ("auto", False),
            ),
            Effect(
                fields(
                    "ToolChoiceTool.type",
                    "ToolChoiceTool.name",
                    "ToolChoiceTool.disable_parallel_tool_use",
                ),
                endpoint,
                {
                    "tools": [CLAUDE_TOOL],
                    "tool_choice": {
                        "type": "tool",
                        "name": "get_weather",
                        "disable_parallel_tool_use": True,
                    },
                },
                lambda p: (
                    (p.tool_choice, p.parallel_tool_calls)
                    == (NamedToolChoice(name="get_weather"), False)
                ),
            ),
            Effect(
                fields("ToolChoiceNone.type"),
                endpoint,
                {"tools": [CLAUDE_TOOL], "tool_choice": {"type": "none"}},
                lambda p: p.tool_choice == "none",
            ),
            Effect(
                fields(f"{model}.thinking", "ThinkingEnabled.type"),
                endpoint,
                {"thinking": {"type": "enabled", "budget_tokens": 1024}},
                lambda p: p.enable_thinking is True,
            ),
            Effect(
                fields("ThinkingDisabled.type"),
                endpoint,
                {"thinking": {"type": "disabled"}},
                lambda p: p.enable_thinking is False,
            ),
            Effect(
                fields("ThinkingAdaptive.type"),
                endpoint,
                {"thinking": {"type": "adaptive"}},
                lambda p: p.enable_thinking is True,
            ),
            Effect(
                fields("ThinkingBetweenTools.type"),
                endpoint,
                {"thinking": {"type": "between_tools"}},
                lambda p: p.enable_thinking is True,
            ),
            Effect(
                fields(f"{model}.output_config", "OutputConfig.effort"),
                endpoint,
                {"output_config": {"effort": "max"}},
                lambda p: p.reasoning_effort == "high",
            ),
        ]
    decisions.append(
        Effect(
            fields("OutputConfig.format", "JsonOutputFormat.type", "JsonOutputFormat.schema_"),
            CLAUDE,
            {"output_config": schema_config},
            lambda p: (p.response_format, p.json_schema) == ("json_schema", SCHEMA),
        )
    )
    return decisions
