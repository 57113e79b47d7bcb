"""A request's messages as a chat template receives them, tool calls and results included:
in Hugging Face's chat format with the ids and fields the model's own template expects
(`native_conversation`), or, for a template that knows no tools, with calls and results
written as Hermes-format text and the tools described in a system (or first user) turn
(`fallback_conversation`, Hermes function-calling format, NousResearch).

Apart from `prompt` (choosing the template and rendering it) because this is the message
conversion alone: the tool-call ids and markup each model family was trained on.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

from exo.chat_protocol.harmony import harmony_conversation
from exo.chat_protocol.tool_call_markup import HERMES_CLOSE, HERMES_OPEN
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.shared.types.text_generation import ChatMessage, ToolDefinition

_ID_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"


_FALLBACK_TOOLS_INSTRUCTIONS = (
    "You can call functions to help answer. The available functions, one JSON schema per "
    "line:\n<tools>\n{tools}\n</tools>\n\n"
    "To call a function, answer with a JSON object naming it and giving its arguments, "
    "inside <tool_call></tool_call> tags, one block per call:\n"
    '<tool_call>\n{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}\n'
    "</tool_call>\n"
    "Function results come back inside <tool_response></tool_response> tags."
)


def tool_schema(tool: ToolDefinition) -> dict[str, Any]:
    """`tool` as chat templates take it: `{"type": "function", "function": {...}}`, its
    parameters an empty object schema when it declares none."""
    function: dict[str, Any] = {"name": tool.name}
    if tool.description is not None:
        function["description"] = tool.description
    function["parameters"] = tool.parameters or {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def _parsed_arguments(arguments: str) -> Any:
    """A call's arguments as an object (templates serialize them themselves); the raw text
    when it is not JSON."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _nine_character_id(call_id: str) -> str:
    """A stable 9-letter/digit id for `call_id` (Mistral's templates require that shape)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    characters = []
    for _ in range(9):
        digest, index = divmod(digest, len(_ID_ALPHABET))
        characters.append(_ID_ALPHABET[index])
    return "".join(characters)


def native_conversation(
    messages: Sequence[ChatMessage], short_ids: bool, tool_call_format: ToolCallFormat
) -> list[dict[str, Any]]:
    """Messages in Hugging Face's chat format, tool calls and results included, with the
    fields and ids the model's own template expects (gpt-oss: `thinking`, one call per
    assistant message; Kimi K2: `functions.NAME:IDX` ids; Mistral: 9-character ids)."""
    call_ids = _call_id_renaming(messages, short_ids, tool_call_format)
    call_names: dict[str, str] = {}
    conversation: list[dict[str, Any]] = []
    for message in messages:
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name is not None:
            entry["name"] = message.name
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": call_ids.get(call.id, call.id),
                    "type": "function",
                    "function": {"name": call.name, "arguments": _parsed_arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
            call_names.update((call.id, call.name) for call in message.tool_calls)
        if message.tool_call_id is not None:
            call_id = message.tool_call_id
            entry["tool_call_id"] = call_ids.get(call_id, call_id)
            if message.role == "tool" and message.name is None and call_id in call_names:
                entry["name"] = call_names[call_id]
        conversation.append(entry)
    if tool_call_format == "harmony":
        return harmony_conversation(conversation)
    return conversation


def _call_id_renaming(
    messages: Sequence[ChatMessage], short_ids: bool, tool_call_format: ToolCallFormat
) -> dict[str, str]:
    """The id each history call gets in the prompt: Kimi K2 was trained on
    `functions.NAME:IDX` ids counted over the conversation; Mistral's templates require 9
    letters/digits; others keep theirs."""
    renamed: dict[str, str] = {}
    calls = [call for message in messages for call in message.tool_calls]
    for index, call in enumerate(calls):
        if tool_call_format == "kimi_k2":
            renamed.setdefault(call.id, f"functions.{call.name}:{index}")
        elif short_ids:
            renamed[call.id] = _nine_character_id(call.id)
    if short_ids:
        for message in messages:
            if message.tool_call_id is not None:
                renamed.setdefault(message.tool_call_id, _nine_character_id(message.tool_call_id))
    return renamed


def fallback_conversation(
    messages: Sequence[ChatMessage],
    tools: Sequence[ToolDefinition],
    results_as_user: bool,
    tools_in_user: bool,
) -> list[dict[str, Any]]:
    """Messages for a template that knows no tools: calls and results as Hermes-format text.

    Args:
        messages: The request's conversation.
        tools: Offered tools, described in a system message (none: no message).
        results_as_user: Write `tool` turns as `<tool_response>` text in `user` turns
            (consecutive results share one turn).
        tools_in_user: Put the tool description at the start of the first user turn
            instead of a system message (for templates without a system role).
    """
    conversation: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool" and results_as_user:
            response = f"<tool_response>\n{message.content}\n</tool_response>"
            previous = conversation[-1] if conversation else None
            if previous is not None and previous.get("_tool_results"):
                previous["content"] += "\n" + response
            else:
                conversation.append({"role": "user", "content": response, "_tool_results": True})
            continue
        entry: dict[str, Any] = {"role": message.role, "content": message.content}
        if message.name is not None:
            entry["name"] = message.name
        if message.tool_call_id is not None:
            entry["tool_call_id"] = message.tool_call_id
        if message.reasoning_content is not None:
            entry["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            blocks = [
                f"{HERMES_OPEN}\n"
                + json.dumps(
                    {"name": call.name, "arguments": _parsed_arguments(call.arguments)},
                    ensure_ascii=False,
                )
                + f"\n{HERMES_CLOSE}"
                for call in message.tool_calls
            ]
            entry["content"] = "\n".join([message.content, *blocks] if message.content else blocks)
        conversation.append(entry)
    for entry in conversation:
        entry.pop("_tool_results", None)
    if tools:
        _add_tools_description(conversation, tools, tools_in_user)
    return conversation


def _add_tools_description(
    conversation: list[dict[str, Any]], tools: Sequence[ToolDefinition], tools_in_user: bool
) -> None:
    description = _FALLBACK_TOOLS_INSTRUCTIONS.format(
        tools="\n".join(json.dumps(tool_schema(tool), ensure_ascii=False) for tool in tools)
    )
    first = conversation[0] if conversation else None
    if tools_in_user:
        target = next((entry for entry in conversation if entry["role"] == "user"), None)
        if target is not None:
            target["content"] = description + "\n\n" + target["content"]
            return
    if first is not None and first["role"] == "system":
        first["content"] = (
            f"{first['content']}\n\n{description}" if first["content"] else description
        )
    else:
        conversation.insert(0, {"role": "system", "content": description})
