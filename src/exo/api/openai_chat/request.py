"""OpenAI Chat Completions <-> internal types. The only modules that know this dialect:
this one converts a wire request into `TextGenerationTaskParams`; `response`
turns the internal chunk stream of one generation into OpenAI's SSE events or one
`ChatCompletionResponse`. Routes do the I/O around them.
"""

from __future__ import annotations

import json
import uuid
from typing import Any, assert_never

from exo.api.openai_chat.wire_types import (
    AssistantContentPart,
    AssistantMessage,
    AudioContentPart,
    ChatCompletionRequest,
    DeveloperMessage,
    FileContentPart,
    FunctionMessage,
    ImageContentPart,
    RefusalContentPart,
    RequestMessage,
    SystemMessage,
    TextContentPart,
    ToolMessage,
    UserContentPart,
    UserMessage,
)
from exo.api.serving.request_checks import build_task_params
from exo.api.wire.conversation import check_tool_results_answer_calls, unanswered_tool_calls
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import NO_VISION, ImageReader
from exo.api.wire.response_schema import check_response_schema, openai_schema_heading
from exo.api.wire.sampling import logit_bias_from_wire, openai_sampling_fields
from exo.api.wire.tools import openai_tool_choice, tool_definitions
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    NamedToolChoice,
    ReasoningEffort,
    ResponseFormat,
    TextGenerationTaskParams,
    ToolCall,
    ToolChoice,
)

# vLLM joins the text parts of one message with a newline; so do we, so that parts written
# as separate paragraphs do not run into each other.
_TEXT_PART_SEPARATOR = "\n"

_NOT_SUPPORTED_YET = "is not supported yet"
# The chat template keyword arguments a request may set (vLLM's `chat_template_kwargs`).
_TEMPLATE_KWARGS = ("enable_thinking",)


def new_completion_id() -> str:
    """A fresh id in OpenAI's format (`chatcmpl-` + 32 hex digits)."""
    return f"chatcmpl-{uuid.uuid4().hex}"


# ---------------------------------------------------------------- request


def to_task_params(
    request: ChatCompletionRequest, images: ImageReader = NO_VISION
) -> TextGenerationTaskParams:
    """Convert a Chat Completions request into the internal generation request.

    Args:
        request: A schema-valid request.
        images: Reads a user turn's `image_url` parts (data: and http(s) URLs) for a model
            with vision; `detail` is accepted and has no effect (the model's own processor
            decides the resolution). Without vision an image part is refused.

    Returns:
        The internal params; sampling fields the client left out stay None (model card
        defaults apply), `stop` becomes a tuple without empty strings. `functions` and
        `function_call` (deprecated) become tools and a tool choice like their successors.

    Raises:
        InvalidRequestError: the request asks for something exo does not do (n > 1,
            image input for a model without vision, audio/file input, template keyword
            arguments other than `enable_thinking`), an image that cannot be read, holds a
            malformed value (a `logit_bias` key that is not a token id, a bias outside
            [-100, 100], a tool parameter schema that is not valid JSON Schema) or its
            fields contradict each other (`max_tokens` != `max_completion_tokens`, both
            `tools` and `functions`, `top_logprobs` without `logprobs`, a tool choice
            naming no given tool).
    """
    _refuse_unsupported_features(request)
    enable_thinking, reasoning_effort = _thinking(request)
    return build_task_params(
        model=ModelId(request.model),
        messages=_to_chat_messages(request.messages, images),
        **openai_sampling_fields(request, max_tokens=_max_tokens(request)),
        stream=request.stream,
        # The deprecated `functions` are tools too (a request may not send both).
        tools=tool_definitions(
            [tool.function for tool in request.tools or ()] + list(request.functions or ()),
            [f"tools[{index}].function.parameters" for index in range(len(request.tools or ()))]
            + [f"functions[{index}].parameters" for index in range(len(request.functions or ()))],
        ),
        tool_choice=_tool_choice(request),
        parallel_tool_calls=(
            True if request.parallel_tool_calls is None else request.parallel_tool_calls
        ),
        response_format=_response_format(request),
        json_schema=_json_schema(request),
        logit_bias=logit_bias_from_wire(request.logit_bias, "logit_bias"),
        logprobs=bool(request.logprobs),
        top_logprobs=request.top_logprobs or 0,
        enable_thinking=enable_thinking,
        reasoning_effort=reasoning_effort,
    )


def _refuse_unsupported_features(request: ChatCompletionRequest) -> None:
    if request.n is not None and request.n > 1:
        raise InvalidRequestError(
            f"n={request.n} is not supported: exo returns exactly one choice per request; "
            "send several requests (with different seeds) instead",
            "n",
        )
    if request.top_logprobs and not request.logprobs:
        # OpenAI's own answer to this combination.
        raise InvalidRequestError(
            "top_logprobs requires logprobs to be set to true", "top_logprobs"
        )
    if request.tools and request.functions:
        raise InvalidRequestError(
            "send either tools or the deprecated functions, not both", "functions"
        )


def _response_format(request: ChatCompletionRequest) -> ResponseFormat:
    return "text" if request.response_format is None else request.response_format.type


def _json_schema(request: ChatCompletionRequest) -> dict[str, Any] | None:
    """The schema of a `json_schema` response format (any object when it gives none); one
    that is invalid or matches no value is a 400 (`check_response_schema`)."""
    response_format = request.response_format
    if response_format is None or response_format.type != "json_schema":
        return None
    if response_format.json_schema is None:
        raise InvalidRequestError(
            "response_format of type 'json_schema' needs a `json_schema` object with the "
            "`schema` the answer must follow",
            "response_format.json_schema",
        )
    schema = response_format.json_schema.schema_
    if schema is None:
        return {"type": "object"}
    check_response_schema(
        schema, openai_schema_heading(response_format.json_schema.name), "response_format"
    )
    return schema


def _tool_choice(request: ChatCompletionRequest) -> ToolChoice:
    """`tool_choice`, or else its deprecated form `function_call`."""
    if request.tool_choice is None and request.function_call is not None:
        legacy = request.function_call
        return legacy if isinstance(legacy, str) else NamedToolChoice(name=legacy.name)
    return openai_tool_choice(request.tool_choice)


def _thinking(request: ChatCompletionRequest) -> tuple[bool | None, ReasoningEffort | None]:
    enable_thinking: bool | None = None
    kwargs = request.chat_template_kwargs or {}
    for key in kwargs:
        if key not in _TEMPLATE_KWARGS:
            raise InvalidRequestError(
                f"chat_template_kwargs.{key} is not supported; exo passes only "
                f"{', '.join(_TEMPLATE_KWARGS)} to the chat template",
                f"chat_template_kwargs.{key}",
            )
    if "enable_thinking" in kwargs:
        value = kwargs["enable_thinking"]
        if not isinstance(value, bool):
            raise InvalidRequestError(
                "chat_template_kwargs.enable_thinking must be a boolean",
                "chat_template_kwargs.enable_thinking",
            )
        enable_thinking = value
    effort = request.reasoning_effort
    match effort:
        case None:
            return enable_thinking, None
        case "none":
            return False, None
        case "minimal" | "low" | "medium" | "high":
            return (True if enable_thinking is None else enable_thinking), effort
        case _:
            assert_never(effort)


def _max_tokens(request: ChatCompletionRequest) -> int | None:
    # `max_completion_tokens` is OpenAI's newer name for `max_tokens`.
    legacy, current = request.max_tokens, request.max_completion_tokens
    if legacy is not None and current is not None and legacy != current:
        raise InvalidRequestError(
            f"max_tokens ({legacy}) and max_completion_tokens ({current}) disagree; "
            "they are the same setting, send only one",
            "max_completion_tokens",
        )
    return current if current is not None else legacy


def _to_chat_messages(
    messages: list[RequestMessage], images: ImageReader
) -> tuple[ChatMessage, ...]:
    converted: list[ChatMessage] = []
    # Ids of legacy `function_call`s, so a `function` message can name its call.
    legacy_call_ids: dict[str, str] = {}
    for index, message in enumerate(messages):
        param = f"messages[{index}]"
        match message:
            case SystemMessage() | DeveloperMessage():
                converted.append(
                    ChatMessage(
                        role="system", content=_text_content(message.content), name=message.name
                    )
                )
            case UserMessage():
                content, message_images = _user_content(message.content, param, images)
                converted.append(
                    ChatMessage(
                        role="user", content=content, name=message.name, images=message_images
                    )
                )
            case AssistantMessage():
                calls = [
                    ToolCall(
                        id=call.id,
                        name=call.function.name,
                        arguments=_arguments_text(
                            call.function.arguments, f"{param}.tool_calls[{call_index}]"
                        ),
                    )
                    for call_index, call in enumerate(message.tool_calls or ())
                ]
                if message.function_call is not None:
                    call_id = f"call_{index}"
                    legacy_call_ids[message.function_call.name] = call_id
                    calls.append(
                        ToolCall(
                            id=call_id,
                            name=message.function_call.name,
                            arguments=_arguments_text(
                                message.function_call.arguments, f"{param}.function_call"
                            ),
                        )
                    )
                converted.append(
                    ChatMessage(
                        role="assistant",
                        content=_assistant_content(message.content, message.refusal),
                        name=message.name,
                        tool_calls=tuple(calls),
                        reasoning_content=message.reasoning_content or None,
                    )
                )
            case ToolMessage():
                converted.append(
                    ChatMessage(
                        role="tool",
                        content=_text_content(message.content),
                        tool_call_id=message.tool_call_id,
                    )
                )
            case FunctionMessage():
                converted.append(
                    ChatMessage(
                        role="tool",
                        content=message.content or "",
                        name=message.name,
                        tool_call_id=legacy_call_ids.get(message.name),
                    )
                )
            case _:
                assert_never(message)
    check_tool_results_answer_calls(converted, "messages")
    unanswered = unanswered_tool_calls(converted, directly_after=True)
    if unanswered:
        # OpenAI's wording (400 invalid_request_error).
        _, missing = unanswered[0]
        raise InvalidRequestError(
            "An assistant message with 'tool_calls' must be followed by tool messages "
            "responding to each 'tool_call_id'. The following tool_call_ids did not have "
            f"response messages: {', '.join(missing)}",
            "messages",
        )
    return tuple(converted)


def _arguments_text(arguments: str, param: str) -> str:
    """Replayed call arguments, checked to be a JSON object (templates parse them)."""
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequestError(
            "tool call arguments must be a JSON object (as text)", f"{param}.function.arguments"
        )
    return arguments if arguments.strip() else "{}"


def _text_content(content: str | list[TextContentPart]) -> str:
    if isinstance(content, str):
        return content
    return _TEXT_PART_SEPARATOR.join(part.text for part in content)


def _user_content(
    content: str | list[UserContentPart], param: str, images: ImageReader
) -> tuple[str, tuple[ImageInput, ...]]:
    """A user turn's text, with `IMAGE_MARKER` at each image's place, and its images."""
    if isinstance(content, str):
        return content, ()
    texts: list[str] = []
    read: list[ImageInput] = []
    for part_index, part in enumerate(content):
        part_param = f"{param}.content[{part_index}]"
        match part:
            case TextContentPart():
                texts.append(part.text)
            case ImageContentPart():
                if not images.vision:
                    raise InvalidRequestError(
                        "image input: the model has no vision capability; send text content "
                        "parts only",
                        part_param,
                    )
                read.append(images.read_url(part.image_url.url, f"{part_param}.image_url"))
                texts.append(IMAGE_MARKER)
            case AudioContentPart():
                raise InvalidRequestError(f"audio input {_NOT_SUPPORTED_YET}", part_param)
            case FileContentPart():
                raise InvalidRequestError(f"file input {_NOT_SUPPORTED_YET}", part_param)
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts), tuple(read)


def _assistant_content(
    content: str | list[AssistantContentPart] | None, refusal: str | None
) -> str:
    # A replayed refusal is what the assistant said, so it stays in the history as text.
    if content is None:
        return refusal or ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        match part:
            case TextContentPart():
                texts.append(part.text)
            case RefusalContentPart():
                texts.append(part.refusal)
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts)
