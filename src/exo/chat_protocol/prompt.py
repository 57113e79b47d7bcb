"""Chat-template rendering of a request, tools included, and marker-preserving decoding.

Templates that know tools get them the way Hugging Face's chat templates expect
(transformers "Tool use" guide): `tools=[{"type": "function", "function": {...}}]`,
assistant `tool_calls` with parsed `arguments`, `tool` turns with `tool_call_id`. Templates
that do not get a system message describing the tools and asking for the Hermes format
(Hermes function-calling format, NousResearch), with history calls and results written as
that format's text.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from exo.chat_protocol.output_parsing import THINK_CLOSE, THINK_OPEN
from exo.chat_protocol.tool_call_parsing import (
    HERMES_CLOSE,
    HERMES_OPEN,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_TOOL_CALLS,
    PYTHON_TAG,
    ToolCallFormat,
)
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams, ToolDefinition

__all__ = [
    "MARKER_TOKENS",
    "RenderedPrompt",
    "ToolCallFormat",
    "decode_keeping_markers",
    "detect_tool_call_format",
    "fold_system_messages",
    "raw_prompt",
    "render_prompt",
]

# Special tokens the output parsers read; every other special token is dropped on decode.
MARKER_TOKENS = (
    MISTRAL_TOOL_CALLS,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    PYTHON_TAG,
    THINK_OPEN,
    THINK_CLOSE,
    HERMES_OPEN,
    HERMES_CLOSE,
)
_LLAMA3_HEADER = "<|start_header_id|>"
_TOOLS_VARIABLE = re.compile(r"\btools\b")
_TOOL_ROLE = re.compile(r"""['"]tool['"]""")
# Mistral's templates reject tool call ids that are not 9 letters/digits.
_NINE_CHARACTER_IDS = re.compile(r"length\s*(?:!=|==)\s*9|length 9")
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


@dataclass(frozen=True, slots=True)
class RenderedPrompt:
    """A request rendered through the model's chat template.

    `token_ids` is `text` tokenized without adding special tokens (the template writes
    them). `thinking_open`: the generation prompt ends inside an open `<think>` section,
    so the output starts as reasoning. `tools_in_template`: the template renders tools
    itself (False: exo's Hermes-format system message was used).
    """

    token_ids: list[int]
    text: str
    tool_call_format: ToolCallFormat
    thinking_open: bool
    tools_in_template: bool


def render_prompt(tokenizer: Any, params: TextGenerationTaskParams) -> RenderedPrompt:
    """Render `params`' conversation (with its offered tools) ending in the assistant's turn,
    or tokenize its raw prompt as it is (`raw_prompt`).

    Args:
        tokenizer: A Hugging Face tokenizer (with a chat template, for a conversation).
        params: The request; `offered_tools`, `enable_thinking` and `reasoning_effort`
            reach the template (the latter two only when set). A system message after the
            first turn is rendered at its place, or folded into the leading system message
            when the template rejects or drops it there (`fold_system_messages`).

    Returns:
        The prompt's text and token ids, and how to parse the model's output.

    Raises:
        ValueError: the tokenizer has no chat template, or the template rejects the
            conversation (e.g. roles that do not alternate); an empty raw prompt for a
            model without a BOS token. The message says why.
    """
    if params.prompt is not None:
        return raw_prompt(tokenizer, params.prompt)
    later_system = [message for message in params.messages[1:] if message.role == "system"]
    if not later_system:
        return _render_conversation(tokenizer, params, params.messages)
    # System turns after the first message (Claude Code's mid-conversation system
    # messages) are rendered where they are when the template takes a system turn there,
    # else folded into the leading system message: templates that raise on them, or
    # that silently drop them, get them folded.
    try:
        rendered = _render_conversation(tokenizer, params, params.messages)
    except ValueError:
        return _render_conversation(tokenizer, params, fold_system_messages(params.messages))
    if all(message.content in rendered.text for message in later_system):
        return rendered
    return _render_conversation(tokenizer, params, fold_system_messages(params.messages))


def fold_system_messages(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """`messages` with every system message's text joined, in order, into one leading
    system message (paragraphs apart)."""
    system = "\n\n".join(
        message.content for message in messages if message.role == "system" and message.content
    )
    rest = tuple(message for message in messages if message.role != "system")
    return ((ChatMessage(role="system", content=system),) if system else ()) + rest


def _render_conversation(
    tokenizer: Any, params: TextGenerationTaskParams, messages: Sequence[ChatMessage]
) -> RenderedPrompt:
    tools = params.offered_tools
    source = _template_source(tokenizer, with_tools=bool(tools))
    tools_in_template = bool(_TOOLS_VARIABLE.search(source))
    template_kwargs: dict[str, Any] = {}
    if params.enable_thinking is not None:
        template_kwargs["enable_thinking"] = params.enable_thinking
    if params.reasoning_effort is not None:
        template_kwargs["reasoning_effort"] = params.reasoning_effort
    short_ids = bool(_NINE_CHARACTER_IDS.search(source))

    attempts: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    if tools_in_template:
        conversation = _native_conversation(messages, short_ids)
        attempts.append((conversation, [_tool_schema(tool) for tool in tools] or None))
    else:
        # Try the most faithful rendering first; fall back to plainer shapes when the
        # template rejects a `tool` role or a system message.
        results_as_user_first = not _TOOL_ROLE.search(source)
        variants = [(results_as_user_first, False), (True, False), (results_as_user_first, True)]
        variants.append((True, True))
        for results_as_user, tools_in_user in dict.fromkeys(variants):
            conversation = _fallback_conversation(messages, tools, results_as_user, tools_in_user)
            attempts.append((conversation, None))

    first_error: Exception | None = None
    for conversation, tool_schemas in attempts:
        try:
            text = _apply_template(tokenizer, source, conversation, tool_schemas, template_kwargs)
        except TemplateError as error:
            first_error = first_error or error
            continue
        token_ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
        return RenderedPrompt(
            token_ids=token_ids,
            text=text,
            tool_call_format=detect_tool_call_format(tokenizer),
            thinking_open=text.rstrip().endswith(THINK_OPEN),
            tools_in_template=tools_in_template,
        )
    raise ValueError(f"the model's chat template rejected the conversation: {first_error}")


def raw_prompt(tokenizer: Any, prompt: str) -> RenderedPrompt:
    """A raw prompt (no chat template): its tokens with the special tokens the tokenizer
    adds by itself (Gemma's and Llama's BOS; none for SmolLM2), which is how transformers
    tokenizes a prompt for `generate`. An empty prompt starts from the BOS token alone.

    Raises:
        ValueError: the prompt is empty and the model has no BOS token to start from.
    """
    token_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if not token_ids:
        bos_token_id = getattr(tokenizer, "bos_token_id", None)
        if bos_token_id is None:
            raise ValueError(
                "the prompt is empty and the model has no beginning-of-sequence token to "
                "start from; send at least one character"
            )
        token_ids = [int(bos_token_id)]
    # No tools with a raw prompt (the request type refuses them), so the format is unused.
    return RenderedPrompt(
        token_ids=token_ids,
        text=prompt,
        tool_call_format="generic",
        thinking_open=False,
        tools_in_template=False,
    )


def detect_tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format the model was trained on, from its chat template and vocabulary.

    `<tool_call>` in the template: "hermes" (Hermes function-calling format, NousResearch;
    Qwen2.5/Qwen3). `[TOOL_CALLS]`: "mistral" (Mistral tokenizer v3 and later).
    `<|python_tag|>`, or Llama 3 header tokens with tools: "llama3_json" (Llama 3.1 model
    card: JSON tool calling). A template without tools: "hermes", the format exo's fallback
    system message asks for. Anything else: "generic".

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        The format name.
    """
    try:
        source = _template_source(tokenizer, with_tools=True)
    except ValueError:
        return "generic"
    tools_in_template = bool(_TOOLS_VARIABLE.search(source))
    if HERMES_OPEN in source:
        return "hermes"
    if MISTRAL_TOOL_CALLS in source:
        return "mistral"
    if PYTHON_TAG in source or (tools_in_template and _LLAMA3_HEADER in source):
        return "llama3_json"
    if not tools_in_template:
        return "hermes"
    if _token_id(tokenizer, MISTRAL_TOOL_CALLS) is not None:
        return "mistral"
    if _token_id(tokenizer, HERMES_OPEN) is not None:
        return "hermes"
    if _token_id(tokenizer, PYTHON_TAG) is not None:
        return "llama3_json"
    return "generic"


def decode_keeping_markers(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """A decoder that drops special tokens except the markers the output parsers read.

    `skip_special_tokens=True` would also drop e.g. Mistral's special `[TOOL_CALLS]` or a
    special `<think>`, so the parser would never see them. The set of ids to drop is
    computed once here; the returned function is called per token on a small window.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        A function from token ids to text, keeping the vocabulary's `MARKER_TOKENS`.
    """
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    added_tokens: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    special_ids.update(
        token_id for token_id, token in added_tokens.items() if getattr(token, "special", False)
    )
    marker_ids = {_token_id(tokenizer, marker) for marker in MARKER_TOKENS}
    dropped = frozenset(special_ids - marker_ids)

    def decode(token_ids: Sequence[int]) -> str:
        kept = [token_id for token_id in token_ids if token_id not in dropped]
        text: str = tokenizer.decode(
            kept, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text

    return decode


# -- helpers -----------------------------------------------------------------------------------


def _template_source(tokenizer: Any, with_tools: bool) -> str:
    """The template text Hugging Face would use (a "tool_use" variant when tools are given).

    Raises:
        ValueError: the tokenizer has no chat template.
    """
    try:
        source = tokenizer.get_chat_template(None, [{}] if with_tools else None)
    except ValueError as error:
        raise ValueError(f"the model has no chat template: {error}") from error
    if not isinstance(source, str):
        raise ValueError("the model has no chat template")
    return source


def _apply_template(
    tokenizer: Any,
    source: str,
    conversation: list[dict[str, Any]],
    tool_schemas: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
) -> str:
    # A conversation that ends with an assistant turn is a prefill (Anthropic's term): the
    # reply continues that turn instead of starting a new one.
    last = conversation[-1] if conversation else {}
    continuing = (
        last.get("role") == "assistant"
        and isinstance(last.get("content"), str)
        and bool(last["content"].strip())
        and not last.get("tool_calls")
    )
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tool_schemas,
            chat_template=source,
            add_generation_prompt=not continuing,
            continue_final_message=continuing,
            tokenize=False,
            **template_kwargs,
        )
    except ValueError:
        if not continuing:
            raise
        # The template rewrote the final turn's text (so it cannot be continued in place):
        # answer with a new turn instead.
        text = tokenizer.apply_chat_template(
            conversation,
            tools=tool_schemas,
            chat_template=source,
            add_generation_prompt=True,
            tokenize=False,
            **template_kwargs,
        )
    assert isinstance(text, str)
    return text


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one token of the vocabulary, else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id < 0:
        return None
    return token_id if tokenizer.convert_ids_to_tokens(token_id) == token else None


def _tool_schema(tool: ToolDefinition) -> dict[str, Any]:
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


def _native_conversation(messages: Sequence[ChatMessage], short_ids: bool) -> list[dict[str, Any]]:
    """Messages in Hugging Face's chat format, tool calls and results included."""
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
                    "id": _nine_character_id(call.id) if short_ids else call.id,
                    "type": "function",
                    "function": {"name": call.name, "arguments": _parsed_arguments(call.arguments)},
                }
                for call in message.tool_calls
            ]
            call_names.update((call.id, call.name) for call in message.tool_calls)
        if message.tool_call_id is not None:
            call_id = message.tool_call_id
            entry["tool_call_id"] = _nine_character_id(call_id) if short_ids else call_id
            if message.role == "tool" and message.name is None and call_id in call_names:
                entry["name"] = call_names[call_id]
        conversation.append(entry)
    return conversation


def _fallback_conversation(
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
        tools="\n".join(json.dumps(_tool_schema(tool), ensure_ascii=False) for tool in tools)
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
