"""Claude (Anthropic) Messages <-> internal types. The only module that knows this dialect.

Pure conversions: a wire request becomes `TextGenerationTaskParams` (this module); the
internal chunk stream of one generation becomes Anthropic's SSE events or one `Message`
(`response`). Routes do the I/O around them.

Choices, each said where it matters:
- A matched stop string is `stop_reason: "stop_sequence"` with `stop_sequence` set (the
  engine names it on the final chunk and leaves it out of the text, as Anthropic does).
- `message_start` reports the prompt's `input_tokens` (the runner sends the count with
  the first chunk, which the stream waits for anyway); `message_delta` repeats it with the
  output count, as Anthropic's cumulative usage does. Prompt tokens served from the
  runner's prefix cache are `cache_read_input_tokens` and left out of `input_tokens`, as
  Anthropic counts cache reads; `cache_creation_input_tokens` is always 0.
- Thinking blocks carry an empty `signature`: exo does not sign thinking.
- `output_config.effort` (anthropic 2.x) reaches the chat template as `reasoning_effort`:
  low, medium and high as they are, xhigh and max as high (the strongest effort templates
  know); whether thinking is on stays with `thinking`. `output_config.format` constrains
  the answer to its JSON schema (`response_format` "json_schema").
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any, assert_never

from exo.api.claude_messages.wire_types import (
    ContentBlockParam,
    CountTokensRequest,
    DocumentBlockParam,
    Effort,
    ErrorDetail,
    ErrorResponse,
    ImageBlockParam,
    InputMessage,
    MessagesRequest,
    OtherBlockParam,
    RedactedThinkingBlockParam,
    TextBlockParam,
    ThinkingAdaptive,
    ThinkingBetweenTools,
    ThinkingBlockParam,
    ThinkingDisabled,
    ThinkingEnabled,
    ThinkingParam,
    ToolChoiceAny,
    ToolChoiceAuto,
    ToolChoiceNone,
    ToolChoiceParam,
    ToolChoiceTool,
    ToolParam,
    ToolResultBlockParam,
    ToolResultContentBlock,
    ToolUseBlockParam,
)
from exo.api.serving.request_checks import build_task_params
from exo.api.wire.conversation import check_tool_results_answer_calls
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import NO_VISION, ImageReader
from exo.api.wire.response_schema import check_response_schema
from exo.api.wire.sampling import sampling_fields
from exo.shared.json_schema import find_invalid
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    NamedToolChoice,
    ReasoningEffort,
    TextGenerationTaskParams,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)

# Text blocks of one turn are joined with a newline (as the chat completions adapter joins
# text parts), so blocks written as paragraphs do not run into each other.
_TEXT_BLOCK_SEPARATOR = "\n"

# Claude Code's first system block: a line that changes with every prompt (a hash of it).
# Fed to the model it would make every prompt's beginning differ, so no request could reuse
# the prefix cache of the one before; it means nothing to the model and is left out.
BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# How a failed tool run is marked for the model: templates have no field for Anthropic's
# `is_error`, so it travels in the text.
TOOL_ERROR_PREFIX = "Error: "

# Anthropic's error `type` for each HTTP status (API reference, "Errors").
_ERROR_TYPE_BY_STATUS: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}

_EFFORT: dict[Effort, ReasoningEffort] = {
    "low": "low",
    "medium": "medium",
    "high": "high",
    "xhigh": "high",
    "max": "high",
}


# ---------------------------------------------------------------- errors


def error_type_for_status(status_code: int) -> str:
    """Anthropic's error `type` for an HTTP status (`not_found_error` for 404, ...)."""
    if status_code in _ERROR_TYPE_BY_STATUS:
        return _ERROR_TYPE_BY_STATUS[status_code]
    return "invalid_request_error" if 400 <= status_code < 500 else "api_error"


def error_body(status_code: int, message: str) -> dict[str, Any]:
    """Anthropic's error JSON: `{"type": "error", "error": {"type", "message"}}`."""
    return ErrorResponse(
        error=ErrorDetail(type=error_type_for_status(status_code), message=message)
    ).model_dump(mode="json")


# ---------------------------------------------------------------- request


def to_task_params(
    request: MessagesRequest, images: ImageReader = NO_VISION
) -> TextGenerationTaskParams:
    """Convert a Messages request into the internal generation request.

    Args:
        request: A schema-valid request.
        images: Reads `image` blocks (sources `base64` and `url`) of user turns and of
            `tool_result` contents, for a model with vision; without vision they are
            refused.

    Returns:
        The internal params. `system` becomes a leading system turn (less Claude Code's
        billing line, `BILLING_HEADER_PREFIX`), a `system` message a system turn at its
        place; `tool_result` blocks
        become `tool` turns, `tool_use` blocks the assistant turn's `tool_calls`, thinking
        blocks its `reasoning_content`. Sampling fields the client left out stay None.

    Raises:
        InvalidRequestError: a turn with empty content (`""` or `[]`) other than a final
            assistant turn, an empty text block in any turn, a turn of whitespace-only text
            blocks, document input, image input
            for a model without vision or an image that cannot be read, server tools, a
            tool's `input_schema` that is not valid JSON Schema, block types exo does not
            model, blocks in the wrong role, or fields that contradict each other (a
            `tool_choice` naming a tool not in `tools`, `output_config.format` with a
            forced tool call).
    """
    output_format = request.output_config.format if request.output_config else None
    if output_format is not None and isinstance(
        request.tool_choice, ToolChoiceAny | ToolChoiceTool
    ):
        raise InvalidRequestError(
            "output_config.format cannot be combined with a forced tool call "
            "(tool_choice 'any' or 'tool')",
            "output_config.format",
        )
    if output_format is not None:
        # Anthropic's heading for a schema it refuses; its body has no param.
        check_response_schema(
            output_format.schema_,
            "output_config.format.schema: Invalid schema",
            "output_config.format.schema",
        )
    return build_task_params(
        **_prompt_fields(request, images),
        stream=request.stream,
        response_format="text" if output_format is None else "json_schema",
        json_schema=None if output_format is None else output_format.schema_,
        **sampling_fields(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop=request.stop_sequences,
            speculative=request.speculative,
        ),
    )


def count_tokens_params(
    request: CountTokensRequest, images: ImageReader = NO_VISION
) -> TextGenerationTaskParams:
    """The internal params whose prompt `count_tokens` measures (see `to_task_params`)."""
    return build_task_params(**_prompt_fields(request, images))


def _prompt_fields(request: CountTokensRequest, images: ImageReader) -> dict[str, Any]:
    if isinstance(request.tool_choice, ToolChoiceAny) and not request.tools:
        # Said in this dialect's terms: 'any' is what the internal "required" means here.
        raise InvalidRequestError(
            "tool_choice: 'any' needs at least one tool in tools", "tool_choice"
        )
    tool_choice, parallel_tool_calls = _tool_choice(request.tool_choice)
    effort = request.output_config.effort if request.output_config is not None else None
    return {
        "model": ModelId(request.model),
        "messages": _conversation(request, images),
        "tools": tuple(
            _tool_definition(tool, index) for index, tool in enumerate(request.tools or ())
        ),
        "tool_choice": tool_choice,
        "parallel_tool_calls": parallel_tool_calls,
        "enable_thinking": _enable_thinking(request.thinking),
        "reasoning_effort": _EFFORT[effort] if effort is not None else None,
    }


def _tool_definition(tool: ToolParam, index: int) -> ToolDefinition:
    if tool.type not in (None, "custom"):
        raise InvalidRequestError(
            f"tools.{index}: server tool {tool.name!r} (type {tool.type!r}) is not supported; "
            "exo offers only client tools (an `input_schema` your code executes)",
            f"tools.{index}.type",
        )
    if tool.input_schema is None:
        raise InvalidRequestError(
            f"tools.{index}.input_schema: Field required", f"tools.{index}.input_schema"
        )
    if tool.input_schema.get("type") != "object":
        # Anthropic's rule too: a tool's input is always an object.
        raise InvalidRequestError(
            f"tools.{index}.input_schema.type: Input should be 'object'",
            f"tools.{index}.input_schema.type",
        )
    problem = find_invalid(tool.input_schema)
    if problem is not None:
        # Anthropic's wording (it names the tool's union member, `custom`), then where.
        raise InvalidRequestError(
            f"tools.{index}.custom.input_schema: JSON schema is invalid. It must match JSON "
            f"Schema draft 2020-12 (https://json-schema.org/draft/2020-12). In "
            f"context={problem.context!r}, {problem.reason}.",
            f"tools.{index}.input_schema",
        )
    return ToolDefinition(
        name=tool.name, description=tool.description, parameters=tool.input_schema
    )


def _tool_choice(choice: ToolChoiceParam | None) -> tuple[ToolChoice, bool]:
    """(internal tool choice, parallel tool calls allowed)."""
    match choice:
        case None:
            return "auto", True
        case ToolChoiceAuto():
            return "auto", not choice.disable_parallel_tool_use
        case ToolChoiceAny():
            return "required", not choice.disable_parallel_tool_use
        case ToolChoiceTool():
            return NamedToolChoice(name=choice.name), not choice.disable_parallel_tool_use
        case ToolChoiceNone():
            return "none", True
        case _:
            assert_never(choice)


def _enable_thinking(thinking: ThinkingParam | None) -> bool | None:
    # `budget_tokens` cannot be honoured (the engine has no thinking budget); `adaptive`
    # and `between_tools` let the model decide, which for a template means "enabled".
    match thinking:
        case None:
            return None
        case ThinkingEnabled() | ThinkingAdaptive() | ThinkingBetweenTools():
            return True
        case ThinkingDisabled():
            return False
        case _:
            assert_never(thinking)


def _conversation(request: CountTokensRequest, images: ImageReader) -> tuple[ChatMessage, ...]:
    messages: list[ChatMessage] = []
    system = _system_text(request.system)
    if system:
        messages.append(ChatMessage(role="system", content=system))
    last = len(request.messages) - 1
    for index, message in enumerate(request.messages):
        where = f"messages.{index}"
        if message.role not in ("user", "assistant", "system"):
            raise InvalidRequestError(
                f'{where}: Unexpected role "{message.role}". Allowed roles are "user", '
                '"assistant" and "system".',
                f"{where}.role",
            )
        if not message.content and not (index == last and message.role == "assistant"):
            # Anthropic's rule and wording: an empty final assistant turn is a prefill of
            # nothing (the answer starts fresh); any other empty turn says nothing.
            raise InvalidRequestError(
                f"{where}: all messages must have non-empty content except for the optional "
                "final assistant message",
                f"{where}.content",
            )
        if not isinstance(message.content, str):
            _refuse_empty_text_blocks(message.content, where)
        if message.role == "system":
            # Rendered where it is, or folded into the system prompt when the model's chat
            # template takes no system turn there (`exo.chat_protocol.prompt`).
            messages.append(ChatMessage(role="system", content=_system_turn_text(message, where)))
        elif isinstance(message.content, str):
            messages.append(
                ChatMessage(
                    role="user" if message.role == "user" else "assistant",
                    content=message.content,
                )
            )
        elif message.role == "user":
            messages.extend(_user_turn(message.content, where, images))
        else:
            messages.append(_assistant_turn(message.content, where))
    check_tool_results_answer_calls(messages, "messages")
    _check_tool_uses_answered(request.messages)
    return tuple(messages)


def _check_tool_uses_answered(turns: Sequence[InputMessage]) -> None:
    """Each assistant turn's `tool_use` blocks must be answered by `tool_result` blocks in
    the next turn, as Anthropic requires (its 400 wording, naming the next turn); a final
    assistant turn is a prefill and is exempt.

    Raises:
        InvalidRequestError: naming the turn that lacks the results and the unanswered ids.
    """
    for index, turn in enumerate(turns[:-1]):
        if turn.role != "assistant" or isinstance(turn.content, str):
            continue
        asked = [block.id for block in turn.content if isinstance(block, ToolUseBlockParam)]
        if not asked:
            continue
        following = turns[index + 1].content
        answered: set[str] = set()
        if not isinstance(following, str):
            answered.update(
                block.tool_use_id for block in following if isinstance(block, ToolResultBlockParam)
            )
        missing = [tool_id for tool_id in asked if tool_id not in answered]
        if missing:
            where = f"messages.{index + 1}"
            raise InvalidRequestError(
                f"{where}: `tool_use` ids were found without `tool_result` blocks immediately "
                f"after: {', '.join(missing)}. Each `tool_use` block must have a corresponding "
                "`tool_result` block in the next message.",
                where,
            )


def _refuse_empty_text_blocks(blocks: Sequence[ContentBlockParam], where: str) -> None:
    """Anthropic's rules and wording: a text block of a turn's content list holds some text,
    in every turn (a final assistant turn's prefill included: the exception for an empty
    final turn is for its whole content, `""` or `[]`, not for an empty block); and a turn
    made only of text blocks has some non-whitespace text (`[" "]` and `["\n"]` are refused,
    `[" ", "real"]` accepted, as the Messages API answers them; a whitespace block beside
    other kinds of blocks is left alone, the API's answer there not being known)."""
    for block_index, block in enumerate(blocks):
        if isinstance(block, TextBlockParam) and not block.text:
            raise InvalidRequestError(
                "messages: text content blocks must be non-empty",
                f"{where}.content.{block_index}.text",
            )
    if blocks and all(
        isinstance(block, TextBlockParam) and not block.text.strip() for block in blocks
    ):
        raise InvalidRequestError(
            "messages: text content blocks must contain non-whitespace text",
            f"{where}.content.0.text",
        )


def _system_text(system: str | list[TextBlockParam] | None) -> str:
    if system is None or isinstance(system, str):
        return _without_billing_line(system or "")
    blocks = list(system)
    if blocks and blocks[0].text.startswith(BILLING_HEADER_PREFIX):
        blocks = blocks[1:]
    return _TEXT_BLOCK_SEPARATOR.join(block.text for block in blocks)


def _without_billing_line(text: str) -> str:
    if not text.startswith(BILLING_HEADER_PREFIX):
        return text
    return text.partition("\n")[2].lstrip("\n")


def _system_turn_text(message: InputMessage, where: str) -> str:
    if isinstance(message.content, str):
        return message.content
    texts: list[str] = []
    for block_index, block in enumerate(message.content):
        if not isinstance(block, TextBlockParam):
            at = f"{where}.content.{block_index}"
            raise InvalidRequestError(f"{at}: system messages take text blocks only", at)
        texts.append(block.text)
    return _TEXT_BLOCK_SEPARATOR.join(texts)


def _user_turn(
    blocks: Sequence[ContentBlockParam], where: str, images: ImageReader
) -> list[ChatMessage]:
    """A user turn's text (`IMAGE_MARKER` at each image's place) and images, and one
    `tool` turn per `tool_result`, in the blocks' order."""
    messages: list[ChatMessage] = []
    texts: list[str] = []
    read: list[ImageInput] = []

    def flush_texts() -> None:
        if texts:
            content = _TEXT_BLOCK_SEPARATOR.join(texts)
            messages.append(ChatMessage(role="user", content=content, images=tuple(read)))
            texts.clear()
            read.clear()

    for block_index, block in enumerate(blocks):
        at = f"{where}.content.{block_index}"
        match block:
            case TextBlockParam():
                texts.append(block.text)
            case ToolResultBlockParam():
                flush_texts()
                content, result_images = _tool_result_content(block, at, images)
                messages.append(
                    ChatMessage(
                        role="tool",
                        content=content,
                        tool_call_id=block.tool_use_id,
                        images=result_images,
                    )
                )
            case ImageBlockParam():
                read.append(_image(block, at, images))
                texts.append(IMAGE_MARKER)
            case DocumentBlockParam():
                raise _unsupported_input(block, at)
            case ThinkingBlockParam() | RedactedThinkingBlockParam() | ToolUseBlockParam():
                raise InvalidRequestError(
                    f"{at}: {block.type} blocks belong in assistant turns, not user turns", at
                )
            case OtherBlockParam():
                raise _unsupported_block(block.type, at)
            case _:
                assert_never(block)
    flush_texts()
    return messages or [ChatMessage(role="user", content="")]


def _assistant_turn(blocks: Sequence[ContentBlockParam], where: str) -> ChatMessage:
    texts: list[str] = []
    reasoning: list[str] = []
    tool_calls: list[ToolCall] = []
    for block_index, block in enumerate(blocks):
        at = f"{where}.content.{block_index}"
        match block:
            case TextBlockParam():
                texts.append(block.text)
            case ThinkingBlockParam():
                reasoning.append(block.thinking)
            case RedactedThinkingBlockParam():
                pass  # encrypted by Anthropic; nothing a template could show
            case ToolUseBlockParam():
                tool_calls.append(
                    ToolCall(id=block.id, name=block.name, arguments=json.dumps(block.input))
                )
            case ToolResultBlockParam():
                raise InvalidRequestError(
                    f"{at}: tool_result blocks belong in user turns, not assistant turns", at
                )
            case ImageBlockParam():
                raise InvalidRequestError(
                    f"{at}: image blocks belong in user turns, not assistant turns", at
                )
            case DocumentBlockParam():
                raise _unsupported_input(block, at)
            case OtherBlockParam():
                raise _unsupported_block(block.type, at)
            case _:
                assert_never(block)
    return ChatMessage(
        role="assistant",
        content=_TEXT_BLOCK_SEPARATOR.join(texts),
        tool_calls=tuple(tool_calls),
        reasoning_content=_TEXT_BLOCK_SEPARATOR.join(reasoning) if reasoning else None,
    )


def _tool_result_content(
    block: ToolResultBlockParam, at: str, images: ImageReader
) -> tuple[str, tuple[ImageInput, ...]]:
    """A tool result's text (`IMAGE_MARKER` at each image's place) and images."""
    read: list[ImageInput] = []
    if isinstance(block.content, str):
        text = block.content
    else:
        texts: list[str] = []
        for part_index, part in enumerate(block.content):
            part_at = f"{at}.content.{part_index}"
            match part:
                case TextBlockParam():
                    texts.append(part.text)
                case ImageBlockParam():
                    read.append(_image(part, part_at, images))
                    texts.append(IMAGE_MARKER)
                case DocumentBlockParam():
                    raise _unsupported_input(part, part_at)
                case OtherBlockParam():
                    raise _unsupported_block(part.type, part_at)
                case _:
                    assert_never(part)
        text = _TEXT_BLOCK_SEPARATOR.join(texts)
    return (TOOL_ERROR_PREFIX + text if block.is_error else text), tuple(read)


# The media types Anthropic accepts in a base64 image source.
_CLAUDE_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image(block: ImageBlockParam, at: str, images: ImageReader) -> ImageInput:
    """An `image` block's image: a `base64` source (`media_type` and `data`) or a `url`
    one. The declared media type must be one Anthropic accepts; the bytes decide the one
    the runner is told."""
    if not images.vision:
        raise _unsupported_input(block, at)
    source, source_at = block.source, f"{at}.source"
    match source.get("type"):
        case "base64":
            media_type, data = source.get("media_type"), source.get("data")
            if media_type not in _CLAUDE_IMAGE_TYPES:
                raise InvalidRequestError(
                    f"{source_at}.media_type: Input should be "
                    f"{', '.join(repr(name) for name in _CLAUDE_IMAGE_TYPES)}",
                    f"{source_at}.media_type",
                )
            if not isinstance(data, str):
                raise InvalidRequestError(
                    f"{source_at}.data: Field required (base64 text)", f"{source_at}.data"
                )
            return images.read_base64(data, source_at)
        case "url":
            url = source.get("url")
            if not isinstance(url, str):
                raise InvalidRequestError(f"{source_at}.url: Field required", f"{source_at}.url")
            return images.read_url(url, source_at)
        case "file":
            raise InvalidRequestError(
                f"{source_at}: image sources of type 'file' are not supported: exo stores no "
                "files; send a base64 or url source",
                f"{source_at}.type",
            )
        case other:
            raise InvalidRequestError(
                f"{source_at}.type: Input should be 'base64' or 'url' (got {other!r})",
                f"{source_at}.type",
            )


def _unsupported_input(
    block: ImageBlockParam | DocumentBlockParam | ToolResultContentBlock, at: str
) -> InvalidRequestError:
    if isinstance(block, ImageBlockParam):
        reason = "the model has no vision capability"
    else:
        reason = "exo reads no documents"
    return InvalidRequestError(
        f"{at}: {block.type} input is not supported: {reason}; send text blocks", at
    )


def _unsupported_block(block_type: str, at: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{at}: content blocks of type {block_type!r} are not supported; exo accepts text, "
        "tool_use, tool_result, thinking and redacted_thinking blocks",
        at,
    )
