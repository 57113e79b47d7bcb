"""OpenAI Responses <-> internal types. The only module that knows this dialect.

Pure conversions: a wire request becomes `TextGenerationTaskParams`; the internal chunk
stream of one generation becomes either the Responses SSE events or one `ResponseObject`.
Both go through one `ResponseAssembler` (`assembler`), so the streamed
events and the final object always agree (ids, output indexes, texts).

Choices where the API leaves room:
- Thinking text (`TokenChunk.reasoning_text`) is reported as a `reasoning` output item whose
  `summary` holds the text as it was generated (exo does not summarise).
- `reasoning.effort`: "none" and "minimal" turn thinking off (`enable_thinking=False`;
  "minimal" is still passed on as `reasoning_effort` for templates that know it); "low",
  "medium", "high" turn it on with that effort; "xhigh" and "max" become "high". No effort:
  the chat template's default.
- Logprobs are returned when `include` lists `message.output_text.logprobs` or
  `top_logprobs` > 0; they belong to the answer text only (a thinking token's are dropped).
- A generation cancelled (`POST /v1/cancel/resp_…`) ends as status `cancelled`; a
  streamed one emits `response.incomplete` (the Responses stream has no cancelled event).
- Failure after the HTTP status was sent is a `response.failed` event whose response has
  `error: {code, message}` (`invalid_prompt` when the request was at fault, else
  `server_error`); the stream then ends.

A chunk stream ends with the first chunk whose `finish_reason` is set; nothing after it is
read. The caller owns the chunk iterator and closes it.
"""

from __future__ import annotations

import json
from typing import Any, assert_never

from exo.api.openai_responses.request_types import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionToolChoice,
    FunctionToolSpec,
    InputImagePart,
    InputItem,
    InputTextPart,
    MessageItem,
    NamespaceToolSpec,
    OutputTextInputPart,
    ReasoningItem,
    RefusalInputPart,
    ResponsesRequest,
    UnsupportedItem,
    UnsupportedPart,
    UnsupportedTool,
    UnsupportedToolChoice,
)
from exo.api.serving.request_checks import build_task_params
from exo.api.wire.conversation import unanswered_tool_calls
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import NO_VISION, ImageReader
from exo.api.wire.response_schema import check_response_schema, openai_schema_heading
from exo.api.wire.sampling import sampling_fields, vllm_top_k
from exo.api.wire.tools import tool_definitions
from exo.shared.types.chunks import ToolCall
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    NamedToolChoice,
    ReasoningEffort,
    ResponseFormat,
    TextGenerationTaskParams,
    ToolChoice,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# Parts of one message are joined with a newline, as the Chat Completions adapter does.
_TEXT_PART_SEPARATOR = "\n"
_NOT_SUPPORTED = "is not supported"

# Internal field -> this dialect's name, for errors raised by `build_task_params`.
_PARAM_NAMES = {
    "max_tokens": "max_output_tokens",
    "messages": "input",
    "response_format": "text.format",
    "json_schema": "text.format.schema",
    "top_logprobs": "top_logprobs",
}


# ---------------------------------------------------------------- request


def to_task_params(
    request: ResponsesRequest, images: ImageReader = NO_VISION
) -> TextGenerationTaskParams:
    """Convert a Responses request into the internal generation request.

    `instructions` becomes a leading system message; input items become chat turns
    (function calls join the assistant turn before them, reasoning items become the
    `reasoning_content` of the assistant turn after them).

    Args:
        request: A schema-valid request.
        images: Reads `input_image` parts (an `image_url`: data: or http(s) URL) of user
            messages and function call outputs, for a model with vision; `detail` has no
            effect. Without vision an image part is refused; a `file_id` always is (exo
            stores no files).

    Returns:
        The internal params; sampling fields the client left out stay None (model card
        defaults apply).

    Raises:
        InvalidRequestError: the request asks for something exo does not do (stored
            responses or conversations, background mode, a `tool_choice` forcing a hosted
            tool, file input, image input for a model without vision)
            or is inconsistent (a function call output without its
            call, a tool choice naming an unknown tool, an empty input) or invalid (a
            tool parameter schema that is not valid JSON Schema).
    """
    _refuse_unsupported_features(request)
    messages: list[ChatMessage] = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    if isinstance(request.input, str):
        messages.append(ChatMessage(role="user", content=request.input))
    else:
        messages.extend(_to_chat_messages(request, request.input, images))
    if not any(message.role != "system" for message in messages):
        raise InvalidRequestError(
            "input must contain at least one user, assistant or tool turn", "input"
        )
    enable_thinking, reasoning_effort = _thinking(request)
    include = request.include or []
    top_logprobs = request.top_logprobs or 0
    json_schema = _json_schema(request)  # its 400 is worded already: not renamed below
    try:
        return build_task_params(
            model=ModelId(request.model),
            messages=tuple(messages),
            **sampling_fields(
                max_tokens=request.max_output_tokens,
                temperature=request.temperature,
                top_p=request.top_p,
                top_k=vllm_top_k(request.top_k),
                speculative=request.speculative,
            ),
            stream=request.stream,
            tools=tool_definitions(function_tools(request), _parameter_params(request)),
            tool_choice=_tool_choice(request),
            parallel_tool_calls=(
                True if request.parallel_tool_calls is None else request.parallel_tool_calls
            ),
            response_format=_response_format(request),
            json_schema=json_schema,
            logprobs=LOGPROBS_INCLUDE in include or top_logprobs > 0,
            top_logprobs=top_logprobs,
            enable_thinking=enable_thinking,
            reasoning_effort=reasoning_effort,
        )
    except InvalidRequestError as error:
        param = _PARAM_NAMES.get(error.param or "", error.param)
        message = error.message
        for internal, external in _PARAM_NAMES.items():
            message = message.replace(f"{internal}:", f"{external}:")
        raise InvalidRequestError(message, param, error.code) from None


def _refuse_unsupported_features(request: ResponsesRequest) -> None:
    if request.previous_response_id is not None:
        raise InvalidRequestError(
            "previous_response_id is not supported: exo does not store responses. Send the "
            "whole conversation in `input` instead (earlier output items can be passed back "
            "as input items)",
            "previous_response_id",
        )
    if request.conversation is not None:
        raise InvalidRequestError(
            "conversation is not supported: exo does not store conversations; send the "
            "whole conversation in `input`",
            "conversation",
        )
    if request.prompt is not None:
        raise InvalidRequestError(
            "prompt templates are not supported: exo stores no prompts; send `instructions` "
            "and `input`",
            "prompt",
        )
    if request.background:
        raise InvalidRequestError(
            "background mode is not supported: exo does not store responses; use stream=true "
            "for long generations",
            "background",
        )
    if isinstance(request.tool_choice, UnsupportedToolChoice):
        # Forcing a hosted tool cannot be done by leaving it out, unlike offering one.
        raise InvalidRequestError(
            f"tool_choice of type {request.tool_choice.type!r} {_NOT_SUPPORTED}: exo runs no "
            "hosted tools; use 'auto', 'none', 'required' or {'type': 'function', 'name': ...}",
            "tool_choice",
        )


def tools_not_offered(request: ResponsesRequest) -> list[str]:
    """The types of the request's hosted tools (`web_search`, `mcp`, ...), which the node
    cannot run and does not show the model, in order, without repeats."""
    kinds = [tool.type for tool in request.tools or [] if isinstance(tool, UnsupportedTool)]
    return list(dict.fromkeys(kinds))


def namespaced_tool_name(namespace: str, name: str) -> str:
    """The name the model sees for function `name` of a `namespace` tool: both joined
    (`mcp__files__` + `read` = `mcp__files__read`, `files` + `read` = `files__read`)."""
    return f"{namespace}{name}" if namespace.endswith("_") else f"{namespace}__{name}"


def tool_names(request: ResponsesRequest) -> dict[str, tuple[str | None, str]]:
    """The name the model sees for each function tool -> (its namespace or None, its own
    name), unique: a name taken by an earlier tool gets `_2`, `_3`, ... appended."""
    names: dict[str, tuple[str | None, str]] = {}

    def add(model_name: str, namespace: str | None, name: str) -> None:
        unique, suffix = model_name, 2
        while unique in names:
            unique, suffix = f"{model_name}_{suffix}", suffix + 1
        names[unique] = (namespace, name)

    for tool in request.tools or []:
        if isinstance(tool, FunctionToolSpec):
            add(tool.name, None, tool.name)
        elif isinstance(tool, NamespaceToolSpec):
            for function in tool.tools:
                add(namespaced_tool_name(tool.name, function.name), tool.name, function.name)
    return names


def _model_tool_name(request: ResponsesRequest, namespace: str | None, name: str) -> str:
    """The model's name for the function the client names `name` in `namespace`."""
    for model_name, (tool_namespace, tool_name) in tool_names(request).items():
        if (tool_namespace, tool_name) == (namespace, name):
            return model_name
    return name if namespace is None else namespaced_tool_name(namespace, name)


def function_tools(request: ResponsesRequest) -> list[FunctionToolSpec]:
    """Every function the model is offered, under the name it sees (`tool_names`):
    function tools, and the functions of `namespace` tools."""
    functions: list[FunctionToolSpec] = []
    for tool in request.tools or []:
        if isinstance(tool, FunctionToolSpec):
            functions.append(tool)
        elif isinstance(tool, NamespaceToolSpec):
            functions.extend(tool.tools)
    return [
        function.model_copy(update={"name": model_name})
        for function, model_name in zip(functions, tool_names(request), strict=True)
    ]


def _parameter_params(request: ResponsesRequest) -> list[str]:
    """The request field of each function's parameter schema, in `function_tools`' order."""
    params: list[str] = []
    for index, tool in enumerate(request.tools or []):
        if isinstance(tool, FunctionToolSpec):
            params.append(f"tools[{index}].parameters")
        elif isinstance(tool, NamespaceToolSpec):
            params.extend(
                f"tools[{index}].tools[{inner}].parameters" for inner in range(len(tool.tools))
            )
    return params


def _tool_choice(request: ResponsesRequest) -> ToolChoice:
    """The internal tool choice, checked against the tools and `text.format` here (rather
    than by the internal model's validator) so that the error names this dialect's field."""
    choice = request.tool_choice
    names = [tool.name for tool in function_tools(request)]
    converted: ToolChoice
    match choice:
        case None:
            converted = "auto"
        case FunctionToolChoice():
            choice = choice.model_copy(
                update={"name": _model_tool_name(request, choice.namespace, choice.name)}
            )
            if choice.name not in names:
                raise InvalidRequestError(
                    f"tool_choice names {choice.name!r}, which is not among the function tools "
                    f"({', '.join(names) or 'none given'})",
                    "tool_choice",
                )
            converted = NamedToolChoice(name=choice.name)
        case UnsupportedToolChoice():  # refused earlier
            raise AssertionError("unsupported tool_choice reached conversion")
        case "required" if not names:
            raise InvalidRequestError(
                "tool_choice 'required' needs at least one tool in `tools`", "tool_choice"
            )
        case _:
            converted = choice
    forced = converted == "required" or isinstance(converted, NamedToolChoice)
    response_format = _response_format(request)
    if forced and response_format != "text":
        raise InvalidRequestError(
            f"text.format {response_format!r} cannot be combined with a forced function call "
            "(tool_choice 'required' or a named function)",
            "text.format",
        )
    return converted


def _response_format(request: ResponsesRequest) -> ResponseFormat:
    if request.text is None or request.text.format is None:
        return "text"
    return request.text.format.type


def _json_schema(request: ResponsesRequest) -> dict[str, Any] | None:
    """The schema of a `json_schema` text format (any object when it gives none); one that
    is invalid or matches no value is a 400 (`check_response_schema`)."""
    text_format = request.text.format if request.text else None
    if text_format is None or text_format.type != "json_schema":
        return None
    if text_format.schema_ is None:
        return {"type": "object"}
    heading = openai_schema_heading(text_format.name)
    check_response_schema(text_format.schema_, heading, "text.format.schema")
    return text_format.schema_


def _thinking(request: ResponsesRequest) -> tuple[bool | None, ReasoningEffort | None]:
    """(enable_thinking, reasoning_effort) for the request's `reasoning.effort`."""
    effort = request.reasoning.effort if request.reasoning else None
    match effort:
        case None:
            return None, None
        case "none":
            return False, None
        case "minimal":
            return False, "minimal"
        case "low" | "medium" | "high":
            return True, effort
        case "xhigh" | "max":
            return True, "high"
        case _:
            assert_never(effort)


def _to_chat_messages(
    request: ResponsesRequest, items: list[InputItem], images: ImageReader
) -> list[ChatMessage]:
    messages: list[ChatMessage] = []
    pending_reasoning: list[str] = []
    call_ids: set[str] = set()
    # Function calls join the assistant turn they directly follow (its text, or earlier
    # calls of the same turn); anything else in between starts a new turn.
    previous_was_assistant = False
    for index, item in enumerate(items):
        param = f"input[{index}]"
        match item:
            case MessageItem():
                role = "system" if item.role == "developer" else item.role
                content, message_images = _parts_content(
                    item.content, f"{param}.content", images, image_turn=role == "user"
                )
                reasoning = None
                if role == "assistant" and pending_reasoning:
                    reasoning = _TEXT_PART_SEPARATOR.join(pending_reasoning)
                    pending_reasoning.clear()
                messages.append(
                    ChatMessage(
                        role=role,
                        content=content,
                        reasoning_content=reasoning,
                        images=message_images,
                    )
                )
                previous_was_assistant = role == "assistant"
            case FunctionCallItem():
                _check_arguments_object(item.arguments, f"{param}.arguments")
                name = _model_tool_name(request, item.namespace, item.name)
                call = ToolCall(id=item.call_id, name=name, arguments=item.arguments)
                call_ids.add(item.call_id)
                if previous_was_assistant and not pending_reasoning:
                    last = messages[-1]
                    messages[-1] = last.model_copy(update={"tool_calls": (*last.tool_calls, call)})
                else:
                    messages.append(
                        ChatMessage(
                            role="assistant",
                            tool_calls=(call,),
                            reasoning_content=(
                                _TEXT_PART_SEPARATOR.join(pending_reasoning)
                                if pending_reasoning
                                else None
                            ),
                        )
                    )
                    pending_reasoning.clear()
                previous_was_assistant = True
            case FunctionCallOutputItem():
                if item.call_id not in call_ids:
                    raise InvalidRequestError(
                        f"no function_call with call_id {item.call_id!r} precedes this "
                        "function_call_output; exo stores no responses, so the call must be "
                        "in `input` too",
                        f"{param}.call_id",
                    )
                content, message_images = _parts_content(
                    item.output, f"{param}.output", images, image_turn=True
                )
                messages.append(
                    ChatMessage(
                        role="tool",
                        content=content,
                        tool_call_id=item.call_id,
                        images=message_images,
                    )
                )
                previous_was_assistant = False
            case ReasoningItem():
                # A reasoning item with no assistant turn after it has nowhere to go and is
                # dropped.
                texts = [part.text for part in item.summary] or [
                    part.text for part in item.content or []
                ]
                text = _TEXT_PART_SEPARATOR.join(texts)
                if text:
                    pending_reasoning.append(text)
                previous_was_assistant = False
            case UnsupportedItem():
                raise InvalidRequestError(_unsupported_item_message(item.type), f"{param}.type")
            case _:
                assert_never(item)
    unanswered = unanswered_tool_calls(messages, directly_after=False)
    if unanswered:
        # OpenAI's wording (400 invalid_request_error on `input`).
        _, missing = unanswered[0]
        raise InvalidRequestError(f"No tool output found for function call {missing[0]}.", "input")
    return messages


def _check_arguments_object(arguments: str, param: str) -> None:
    try:
        value = json.loads(arguments)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise InvalidRequestError("a function call's arguments must be a JSON object", param)


def _unsupported_item_message(kind: str) -> str:
    if kind == "item_reference":
        return (
            "input items of type 'item_reference' are not supported: exo does not store "
            "responses; send the item itself"
        )
    return (
        f"input items of type {kind!r} {_NOT_SUPPORTED}; exo accepts 'message', "
        "'function_call', 'function_call_output' and 'reasoning' items"
    )


def _parts_content(
    content: str | list[ContentPart], param: str, images: ImageReader, *, image_turn: bool
) -> tuple[str, tuple[ImageInput, ...]]:
    """A message's (or function output's) text, with `IMAGE_MARKER` at each image's place,
    and its images. `image_turn` False: a turn that cannot hold images (system, assistant)."""
    if isinstance(content, str):
        return content, ()
    texts: list[str] = []
    read: list[ImageInput] = []
    for index, part in enumerate(content):
        match part:
            case InputTextPart() | OutputTextInputPart():
                texts.append(part.text)
            case RefusalInputPart():
                # A replayed refusal is what the assistant said.
                texts.append(part.refusal)
            case InputImagePart():
                read.append(_input_image(part, f"{param}[{index}]", images, image_turn))
                texts.append(IMAGE_MARKER)
            case UnsupportedPart():
                raise InvalidRequestError(
                    f"content parts of type {part.type!r} {_NOT_SUPPORTED}; send input_text parts",
                    f"{param}[{index}]",
                )
            case _:
                assert_never(part)
    return _TEXT_PART_SEPARATOR.join(texts), tuple(read)


def _input_image(
    part: InputImagePart, param: str, images: ImageReader, image_turn: bool
) -> ImageInput:
    if not images.vision:
        raise InvalidRequestError(
            "image input is not supported: the model has no vision; send input_text parts only",
            param,
        )
    if not image_turn:
        raise InvalidRequestError(
            "input_image parts belong in user messages and function call outputs", param
        )
    if part.file_id is not None:
        raise InvalidRequestError(
            "input_image with a file_id is not supported: exo stores no files; send the image "
            "as image_url (a data: or http(s) URL)",
            f"{param}.file_id",
        )
    if part.image_url is None:
        raise InvalidRequestError("an input_image needs an image_url", f"{param}.image_url")
    return images.read_url(part.image_url, f"{param}.image_url")
