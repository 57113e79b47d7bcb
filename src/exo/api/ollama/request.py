"""Ollama's native API <-> internal types, with `response` (a generation's chunks as
newline-delimited JSON lines or one response object) and `model_listings` (model cards as
`/api/tags`, `/api/show` and `/api/ps` entries). This module turns `/api/chat` and
`/api/generate` bodies into `TextGenerationTaskParams`. Routes do the I/O (and supply the
clocks) around them.

Wire facts (ollama/ollama `docs/api.md`): streaming is the default; every line is a JSON
object; the last has `done: true`, a `done_reason` and the statistics, durations in
nanoseconds. A failure after the 200 went out is one `{"error": "..."}` line, which the
official client raises as `ResponseError` (ollama-python 0.6, `Client._request`).

`options.num_ctx` bounds the request's prompt and reply together (`context_tokens`), below
the model's own context and KV budget (a larger value changes nothing: Ollama would stretch
the window past what the model was trained on); a prompt over it is refused as any over the
context is. Deliberate differences, each also said in a docstring below: `context` is never
returned (and a
non-empty one is refused); `digest` is the SHA-256 of the model id, not of a blob.
`load_duration` is the request's wait for its model to load, as Ollama's
(`exo.api.serving.load_wait`, `response._Timer`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Literal, assert_never

from exo.api.ollama.wire_types import (
    OllamaChatRequest,
    OllamaGenerateRequest,
    OllamaMessage,
    OllamaOptions,
    ThinkSetting,
)
from exo.api.serving.request_checks import build_task_params
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import NO_VISION, ImageReader
from exo.api.wire.response_schema import check_response_schema
from exo.api.wire.sampling import sampling_fields
from exo.api.wire.tools import openai_tool_choice, tool_definitions
from exo.shared.types.commands import KeepAlive
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    ReasoningEffort,
    ResponseFormat,
    TextGenerationTaskParams,
    ToolCall,
    ToolChoice,
    ToolDefinition,
)

NDJSON_MEDIA_TYPE = "application/x-ndjson"
# The version `/api/version` reports: the Ollama API release whose wire format this
# module follows (clients compare it to enable features: `codex --oss` wants 0.13.4, the
# release that serves `/v1/responses`). What that release has and exo does not is listed in
# docs/compatibility.md ("Ollama clients").
OLLAMA_COMPATIBLE_VERSION = "0.13.4"
# Ollama reports a model kept loaded forever (`keep_alive: -1`) with a far-future expiry;
# so does exo for an instance without a keep-alive (kept until deleted).
NEVER_EXPIRES = "9999-12-31T23:59:59Z"
LATEST_TAG = ":latest"

NanosecondClock = Callable[[], int]
Dialect = Literal["chat", "generate"]

# Internal parameter names in validation messages, as an Ollama client spells them.
_OLLAMA_PARAM_NAMES = {
    "max_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "seed": "options.seed",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "repetition_penalty": "options.repeat_penalty",
    "stop": "options.stop",
    "tool_choice": "tool_choice",
    "response_format": "format",
}


# ---------------------------------------------------------------- names and times


def resolve_model_name(name: str, known: Sequence[ModelId]) -> ModelId | None:
    """The known model an Ollama model name means: the id itself, or the id with Ollama's
    default `:latest` tag appended; None when unknown."""
    for candidate in (name, name.removesuffix(LATEST_TAG)):
        if candidate in known:
            return ModelId(candidate)
    return None


def rfc3339_nano(unix_ns: int) -> str:
    """UTC time in Go's RFC3339Nano form (`2024-05-01T12:00:00.123456789Z`, trailing zeros
    of the fraction dropped), which Ollama uses for `created_at`."""
    seconds, nanoseconds = divmod(unix_ns, 1_000_000_000)
    stamp = datetime.fromtimestamp(seconds, UTC).strftime("%Y-%m-%dT%H:%M:%S")
    fraction = f"{nanoseconds:09d}".rstrip("0")
    return f"{stamp}.{fraction}Z" if fraction else f"{stamp}Z"


_DURATION_UNITS_SECONDS = {
    "ns": 1e-9,
    "us": 1e-6,
    "\u00b5s": 1e-6,
    "\u03bcs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_DURATION_PART = re.compile(r"(\d+\.?\d*|\.\d+)(ns|us|\u00b5s|\u03bcs|ms|s|m|h)")


def parse_keep_alive(value: str | float | None) -> KeepAlive | None:
    """Ollama's `keep_alive`: a number of seconds or a Go duration (`"5m"`, `"1h30m"`,
    `"30s"`, `"0"`); negative means kept until deleted. None (or "") when not given.

    Raises:
        InvalidRequestError: a string that is not a duration (400 naming `keep_alive`).
    """
    if value is None or value == "":
        return None
    seconds = float(value) if isinstance(value, int | float) else _go_duration_seconds(value)
    if math.isnan(seconds) or seconds == math.inf:
        raise InvalidRequestError(f"keep_alive must be finite, not {value!r}", "keep_alive")
    return KeepAlive(seconds=None if seconds < 0 else seconds)


def _go_duration_seconds(text: str) -> float:
    """Seconds in a Go `time.ParseDuration` string: an optional sign, then numbers each
    with a unit (ns, us, ms, s, m, h); "0" needs none."""
    body = text.strip()
    sign = -1.0 if body.startswith("-") else 1.0
    body = body.lstrip("+-")
    if body == "0":
        return 0.0
    position, seconds = 0, 0.0
    while position < len(body):
        part = _DURATION_PART.match(body, position)
        if part is None:
            raise InvalidRequestError(
                f"keep_alive {text!r} is not a duration: use seconds (300) or a duration "
                'such as "5m", "30s" or "1h" (negative: keep the model loaded)',
                "keep_alive",
            )
        seconds += float(part.group(1)) * _DURATION_UNITS_SECONDS[part.group(2)]
        position = part.end()
    if position == 0:
        raise InvalidRequestError(f"keep_alive {text!r} is not a duration", "keep_alive")
    return sign * seconds


# ---------------------------------------------------------------- requests


def chat_to_task_params(
    request: OllamaChatRequest,
    model_id: ModelId,
    capabilities: Sequence[str] = ("text",),
    images: ImageReader = NO_VISION,
) -> TextGenerationTaskParams:
    """Convert an `/api/chat` body (with at least one message) into the internal request.

    Args:
        request: A schema-valid body.
        model_id: The known model its `model` names (`resolve_model_name`).
        capabilities: The model card's capabilities (decides the wording of an image refusal).
        images: Reads a user or tool message's `images` (base64 strings) for a model with
            vision: they come before the message's text, as Ollama places them.

    `tool_choice` is an exo extension (Ollama cannot force a tool call); it takes
    OpenAI's forms.

    Raises:
        InvalidRequestError: images for a model without vision (or that cannot be read),
            malformed replayed tool-call arguments, a tool parameter schema that is not
            valid JSON Schema, a `tool_choice` naming no offered tool, or option values
            out of range.
    """
    messages = _chat_messages(request.messages, request.model, capabilities, images)
    tools = tool_definitions(
        [tool.function for tool in request.tools or ()],
        [f"tools[{index}].function.parameters" for index in range(len(request.tools or ()))],
    )
    return _task_params(request, model_id, messages, tools, openai_tool_choice(request.tool_choice))


def generate_to_task_params(
    request: OllamaGenerateRequest,
    model_id: ModelId,
    capabilities: Sequence[str] = ("text",),
    images: ImageReader = NO_VISION,
) -> TextGenerationTaskParams:
    """Convert an `/api/generate` body with a non-empty prompt into the internal request:
    `system` (if any) and `prompt` become a system and a user turn of the chat template;
    with `raw: true` the prompt reaches the model as it is (no template), which is how a
    base model (no chat template) is served. `images` (base64 strings) join the user turn,
    before the prompt, for a model with vision (`images` reads them).

    Raises:
        InvalidRequestError: `suffix` (fill-in-the-middle), a `template` override, a
            non-empty `context`, images for a model without vision (or that cannot be read)
            or with `raw`, `system` or `think` with `raw` (a raw prompt has
            no turns to put them in; Ollama refuses `system` with `raw` too), or option
            values out of range.
    """
    if request.images and not images.vision:
        raise InvalidRequestError(_no_vision_message(request.model, capabilities), "images")
    refusals = (
        (request.raw and request.images, "images", "raw mode does not support images: an "
         "image takes its place through the chat template, which a raw prompt skips"),
        (request.suffix, "suffix", "suffix (fill-in-the-middle) is not supported yet"),
        (request.template, "template", "a template override is not supported yet; the "
         "model's own chat template is used"),
        (request.context, "context", "context (token ids of an earlier answer) is not "
         "supported: exo never returns it; send the conversation to /api/chat instead"),
        (request.raw and request.system, "system", "raw mode does not support system: a "
         "raw prompt is used as it is; write the system text into the prompt"),
        (request.raw and request.think is not None, "think", "raw mode does not support "
         "think: thinking is switched in the chat template, which a raw prompt skips"),
    )  # fmt: skip
    for value, param, message in refusals:
        if value:
            raise InvalidRequestError(message, param)
    if request.raw:
        return _task_params(request, model_id, (), (), "auto", prompt=request.prompt or "")
    messages: list[ChatMessage] = []
    if request.system:
        messages.append(ChatMessage(role="system", content=request.system))
    content, prompt_images = _with_images(request.prompt or "", request.images, "images", images)
    messages.append(ChatMessage(role="user", content=content, images=prompt_images))
    return _task_params(request, model_id, tuple(messages), (), "auto")


def _task_params(
    request: OllamaChatRequest | OllamaGenerateRequest,
    model_id: ModelId,
    messages: tuple[ChatMessage, ...],
    tools: tuple[ToolDefinition, ...],
    tool_choice: ToolChoice,
    prompt: str | None = None,
) -> TextGenerationTaskParams:
    options = request.options or OllamaOptions()
    _refuse_unsupported_options(options)
    enable_thinking, reasoning_effort = _thinking(request.think)
    if request.top_logprobs and not request.logprobs:
        raise InvalidRequestError("top_logprobs requires logprobs: true", "top_logprobs")
    if isinstance(request.format, dict):
        check_response_schema(request.format, "format: invalid JSON schema", "format")
    try:
        return build_task_params(
            model=model_id,
            messages=messages,
            prompt=prompt,
            stream=request.stream,
            **sampling_fields(
                max_tokens=_max_tokens(options.num_predict),
                temperature=options.temperature,
                top_p=options.top_p,
                # Ollama (like llama.cpp) spells "no top-k filter" as 0 or any negative value.
                top_k=None if options.top_k is None else max(options.top_k, 0),
                min_p=options.min_p,
                # -1 is llama.cpp's and Ollama's "random seed".
                seed=None if options.seed == -1 else options.seed,
                stop=options.stop,
                presence_penalty=options.presence_penalty,
                frequency_penalty=options.frequency_penalty,
                # Ollama's `repeat_last_n: 0` switches the repeat penalty off.
                repetition_penalty=1.0 if options.repeat_last_n == 0 else options.repeat_penalty,
                speculative=options.speculative,
            ),
            repetition_window=_repetition_window(options.repeat_last_n),
            context_tokens=_context_tokens(options.num_ctx),
            tools=tools,
            tool_choice=tool_choice,
            response_format=_response_format(request.format),
            json_schema=request.format if isinstance(request.format, dict) else None,
            logprobs=bool(request.logprobs),
            top_logprobs=request.top_logprobs or 0,
            enable_thinking=enable_thinking,
            reasoning_effort=reasoning_effort,
        )
    except InvalidRequestError as error:
        raise _in_ollama_terms(error) from None


# Ollama's default `repeat_last_n` (its `api.DefaultOptions`): the repeat penalty counts the
# last 64 tokens when a request does not say.
OLLAMA_DEFAULT_REPEAT_LAST_N = 64


def _repetition_window(repeat_last_n: int | None) -> int | None:
    """The repeat penalty's window in tokens for Ollama's `repeat_last_n`: N > 0 the last N
    tokens, unset Ollama's default (`OLLAMA_DEFAULT_REPEAT_LAST_N`), -1 the whole context
    (None; 0 turns the penalty off, which the caller does; below -1 is refused by
    `_refuse_unsupported_options`)."""
    if repeat_last_n is None:
        return OLLAMA_DEFAULT_REPEAT_LAST_N
    return repeat_last_n if repeat_last_n > 0 else None


def _refuse_unsupported_options(options: OllamaOptions) -> None:
    """A 400 naming the first option asking for sampling exo does not do; neutral values
    (Ollama's "off") pass. (`repeat_last_n` is honoured by the caller: N > 0 the last N
    tokens, -1 the whole context, 0 off; below -1 Ollama has no meaning for it.)

    Raises:
        InvalidRequestError: `typical_p` or `tfs_z` below 1, `mirostat` other than 0,
            `penalize_newline: false`, or a `repeat_last_n` below -1.
    """
    window = options.repeat_last_n
    refusals = (
        (options.typical_p is not None and options.typical_p < 1.0, "typical_p",
         "locally typical sampling is not supported; leave typical_p at 1 (off)"),
        (options.tfs_z is not None and options.tfs_z < 1.0, "tfs_z",
         "tail-free sampling is not supported; leave tfs_z at 1 (off)"),
        (options.mirostat not in (None, 0), "mirostat",
         "mirostat sampling is not supported; use mirostat 0 (off) with temperature, "
         "top_k, top_p or min_p"),
        (options.penalize_newline is False, "penalize_newline",
         "newlines are penalized like every other token; leave penalize_newline out"),
        (window is not None and window < -1, "repeat_last_n",
         f"{window} is no repeat penalty window: use N > 0 (the last N tokens), -1 (the "
         "whole context) or 0 (off)"),
    )  # fmt: skip
    for refused, name, message in refusals:
        if refused:
            raise InvalidRequestError(f"options.{name}: {message}", f"options.{name}")


def _in_ollama_terms(error: InvalidRequestError) -> InvalidRequestError:
    if error.param is None or error.param not in _OLLAMA_PARAM_NAMES:
        return error
    name = _OLLAMA_PARAM_NAMES[error.param]
    return InvalidRequestError(error.message.replace(f"{error.param}:", f"{name}:"), name)


def _max_tokens(num_predict: int | None) -> int | None:
    # Ollama's runner stops at num_predict only when it is positive: -1 ("infinite"), -2
    # ("fill the context") and 0 all mean no limit.
    if num_predict is None or num_predict <= 0:
        return None
    return num_predict


def _context_tokens(num_ctx: int | None) -> int | None:
    # The request's context window; 0 or a negative value leaves the model's own.
    if num_ctx is None or num_ctx <= 0:
        return None
    return num_ctx


def _thinking(think: ThinkSetting | None) -> tuple[bool | None, ReasoningEffort | None]:
    match think:
        case None:
            return None, None
        case bool():
            return think, None
        case "low" | "medium" | "high":
            return True, think
        case _:
            assert_never(think)


def _response_format(format_: str | dict[str, object] | None) -> ResponseFormat:
    if format_ is None or format_ == "":
        return "text"
    if format_ == "json":
        return "json_object"
    if isinstance(format_, dict):
        return "json_schema"
    raise InvalidRequestError(
        f'invalid format {format_!r}: expected "json" or a JSON schema', "format"
    )


def _no_vision_message(model: str, capabilities: Sequence[str]) -> str:
    if "vision" in capabilities:
        return f"image input is not supported yet (model '{model}')"
    return (
        f"model '{model}' does not support images: it has no vision capability "
        f"(capabilities: {', '.join(capabilities) or 'none'}); send text only"
    )


def _with_images(
    text: str, encoded: Sequence[str] | None, param: str, images: ImageReader
) -> tuple[str, tuple[ImageInput, ...]]:
    """`text` after one `IMAGE_MARKER` per image (Ollama puts a message's images before its
    text), and the images read from their base64 strings."""
    read = tuple(
        images.read_base64(data, f"{param}[{index}]") for index, data in enumerate(encoded or ())
    )
    if not read:
        return text, ()
    return "\n".join([IMAGE_MARKER] * len(read) + ([text] if text else [])), read


def _chat_messages(
    messages: Sequence[OllamaMessage],
    model: str,
    capabilities: Sequence[str],
    images: ImageReader,
) -> tuple[ChatMessage, ...]:
    converted: list[ChatMessage] = []
    # Calls made by the assistant that no tool message has answered yet: Ollama's tool
    # messages name the tool (`tool_name`), ours tie to a call id.
    unanswered: list[ToolCall] = []
    for index, message in enumerate(messages):
        param = f"messages[{index}].images"
        if message.images and not images.vision:
            raise InvalidRequestError(_no_vision_message(model, capabilities), param)
        if message.images and message.role not in ("user", "tool"):
            raise InvalidRequestError(
                f"images belong in user and tool messages, not {message.role} messages", param
            )
        content, message_images = _with_images(message.content or "", message.images, param, images)
        match message.role:
            case "system" | "user":
                converted.append(
                    ChatMessage(role=message.role, content=content, images=message_images)
                )
            case "assistant":
                calls = tuple(
                    ToolCall(
                        id=call.id or f"call_{index}_{call_index}",
                        name=call.function.name,
                        arguments=_arguments_text(
                            call.function.arguments,
                            f"messages[{index}].tool_calls[{call_index}].function.arguments",
                        ),
                    )
                    for call_index, call in enumerate(message.tool_calls or ())
                )
                unanswered = list(calls)
                converted.append(
                    ChatMessage(
                        role="assistant",
                        content=content,
                        tool_calls=calls,
                        reasoning_content=message.thinking or None,
                    )
                )
            case "tool":
                call = _answered_call(unanswered, message)
                converted.append(
                    ChatMessage(
                        role="tool",
                        content=content,
                        name=message.tool_name or (call.name if call else None),
                        tool_call_id=message.tool_call_id or (call.id if call else None),
                        images=message_images,
                    )
                )
            case _:
                assert_never(message.role)
    return tuple(converted)


def _answered_call(unanswered: list[ToolCall], message: OllamaMessage) -> ToolCall | None:
    """The pending call a tool message answers (by id, else by tool name, else the oldest);
    removed from `unanswered`."""
    for call in unanswered:
        if message.tool_call_id is not None and call.id == message.tool_call_id:
            break
        if message.tool_call_id is None and message.tool_name in (None, call.name):
            break
    else:
        return None
    unanswered.remove(call)
    return call


def _arguments_text(arguments: dict[str, object] | str, param: str) -> str:
    if isinstance(arguments, dict):
        return json.dumps(arguments, ensure_ascii=False)
    try:
        parsed = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict):
        raise InvalidRequestError("tool call arguments must be a JSON object", param)
    return json.dumps(parsed, ensure_ascii=False)
