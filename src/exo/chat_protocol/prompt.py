"""Chat-template rendering of a request, tools included, and marker-preserving decoding.

Templates that know tools get them the way Hugging Face's chat templates expect
(transformers "Tool use" guide): `tools=[{"type": "function", "function": {...}}]`,
assistant `tool_calls` with parsed `arguments`, `tool` turns with `tool_call_id`. Templates
that do not get a system message describing the tools and asking for the Hermes format
(Hermes function-calling format, NousResearch), with history calls and results written as
that format's text. The messages' conversion for either is
`exo.chat_protocol.tool_conversation`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from jinja2.exceptions import TemplateError

from exo.chat_protocol.format_detection import (
    MARKER_TOKENS,
    TOOLS_VARIABLE,
    decode_keeping_markers,
    detect_tool_call_format,
    template_source,
    template_tool_call_format,
)
from exo.chat_protocol.image_tokens import ImageTokens
from exo.chat_protocol.output_parsing import THINK_OPEN
from exo.chat_protocol.tool_call_parsing import ToolCallFormat
from exo.chat_protocol.tool_conversation import (
    fallback_conversation,
    native_conversation,
    tool_schema,
)
from exo.chat_protocol.typed_image_text import TypedImageText
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    TextGenerationTaskParams,
)

__all__ = [
    "MARKER_TOKENS",
    "RenderedPrompt",
    "ToolCallFormat",
    "decode_keeping_markers",
    "detect_tool_call_format",
    "fold_system_messages",
    "raw_prompt",
    "render_prompt",
    "template_tool_call_format",
]

_TOOL_ROLE = re.compile(r"""['"]tool['"]""")
# Mistral's templates reject tool call ids that are not 9 letters/digits.
_NINE_CHARACTER_IDS = re.compile(r"length\s*(?:!=|==)\s*9|length 9")


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


def render_prompt(
    tokenizer: Any, params: TextGenerationTaskParams, image_tokens: ImageTokens | None = None
) -> RenderedPrompt:
    """Render `params`' conversation (with its offered tools) ending in the assistant's turn,
    or tokenize its raw prompt as it is (`raw_prompt`).

    Args:
        tokenizer: A Hugging Face tokenizer (with a chat template, for a conversation).
        params: The request; `offered_tools`, `enable_thinking` and `reasoning_effort`
            reach the template (the latter two only when set). A system message after the
            first turn is rendered at its place, or folded into the leading system message
            when the template rejects or drops it there (`fold_system_messages`).
        image_tokens: a vision model's image tokens (pass them with or without images):
            each message's `IMAGE_MARKER` becomes the template's image part, then the
            image's whole token sequence for its width and height (the text keeps the
            template's part); the family's image token texts a client typed stay
            ordinary text (`typed_image_text`). None: markers are text (a model without
            them).

    Returns:
        The prompt's text and token ids, and how to parse the model's output.

    Raises:
        ValueError: the tokenizer has no chat template, or the template rejects the
            conversation (e.g. roles that do not alternate); an empty raw prompt for a
            model without a BOS token. The message says why.
    """
    if params.prompt is not None:
        return raw_prompt(tokenizer, params.prompt, image_tokens)
    if image_tokens is None:
        return _render_messages(tokenizer, params, _template_tokenizing(tokenizer))
    typed = TypedImageText.of(image_tokens, tokenizer)
    escaped = typed.escape_params(params)
    sizes = [(image.width, image.height) for message in params.messages for image in message.images]
    messages = escaped.messages
    if sizes:
        # A template of content parts writes its own image part for each image part.
        source = template_source(tokenizer, with_tools=bool(escaped.offered_tools))
        if not reads_content_parts(tokenizer, source):
            messages = image_tokens.template_messages(messages)
    rendered = _render_messages(
        tokenizer,
        escaped.model_copy(update={"messages": messages}),
        lambda text: typed.token_ids(tokenizer, text),
    )
    token_ids, _ = image_tokens.expand(rendered.token_ids, sizes)
    return dataclasses.replace(rendered, token_ids=token_ids, text=typed.restore(rendered.text))


def _template_tokenizing(tokenizer: Any) -> Callable[[str], list[int]]:
    """Tokenizing a rendered template's text: its special tokens parsed, none added."""
    return lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _render_messages(
    tokenizer: Any, params: TextGenerationTaskParams, tokenize: Callable[[str], list[int]]
) -> RenderedPrompt:
    """`render_prompt` of a conversation, its text tokenized by `tokenize`."""
    later_system = [message for message in params.messages[1:] if message.role == "system"]
    if not later_system:
        return _render_conversation(tokenizer, params, params.messages, tokenize)
    # System turns after the first message (Claude Code's mid-conversation system
    # messages) are rendered where they are when the template takes a system turn there,
    # else folded into the leading system message: templates that raise on them, or
    # that silently drop them, get them folded.
    folded = fold_system_messages(params.messages)
    try:
        rendered = _render_conversation(tokenizer, params, params.messages, tokenize)
    except ValueError:
        return _render_conversation(tokenizer, params, folded, tokenize)
    if all(message.content in rendered.text for message in later_system):
        return rendered
    return _render_conversation(tokenizer, params, folded, tokenize)


def fold_system_messages(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """`messages` with every system message's text joined, in order, into one leading
    system message (paragraphs apart)."""
    system = "\n\n".join(
        message.content for message in messages if message.role == "system" and message.content
    )
    rest = tuple(message for message in messages if message.role != "system")
    return ((ChatMessage(role="system", content=system),) if system else ()) + rest


def _render_conversation(
    tokenizer: Any,
    params: TextGenerationTaskParams,
    messages: Sequence[ChatMessage],
    tokenize: Callable[[str], list[int]],
) -> RenderedPrompt:
    tools = params.offered_tools
    source = template_source(tokenizer, with_tools=bool(tools))
    tools_in_template = bool(TOOLS_VARIABLE.search(source))
    tool_call_format = detect_tool_call_format(tokenizer)
    template_kwargs = _template_kwargs(params, tool_call_format)
    short_ids = bool(_NINE_CHARACTER_IDS.search(source))

    attempts: list[tuple[list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    if tools_in_template:
        conversation = native_conversation(messages, short_ids, tool_call_format)
        attempts.append((conversation, [tool_schema(tool) for tool in tools] or None))
    else:
        # Try the most faithful rendering first; fall back to plainer shapes when the
        # template rejects a `tool` role or a system message.
        results_as_user_first = not _TOOL_ROLE.search(source)
        variants = [(results_as_user_first, False), (True, False), (results_as_user_first, True)]
        variants.append((True, True))
        for results_as_user, tools_in_user in dict.fromkeys(variants):
            conversation = fallback_conversation(messages, tools, results_as_user, tools_in_user)
            attempts.append((conversation, None))

    first_error: Exception | None = None
    for conversation, tool_schemas in attempts:
        try:
            text = _apply_template(tokenizer, source, conversation, tool_schemas, template_kwargs)
        except TemplateError as error:
            first_error = first_error or error
            continue
        token_ids = tokenize(text)
        return RenderedPrompt(
            token_ids=token_ids,
            text=text,
            tool_call_format=tool_call_format,
            thinking_open=text.rstrip().endswith(THINK_OPEN),
            tools_in_template=tools_in_template,
        )
    raise ValueError(f"the model's chat template rejected the conversation: {first_error}")


def raw_prompt(
    tokenizer: Any, prompt: str, image_tokens: ImageTokens | None = None
) -> RenderedPrompt:
    """A raw prompt (no chat template): its tokens with the special tokens the tokenizer
    adds by itself (Gemma's and Llama's BOS; none for SmolLM2), which is how transformers
    tokenizes a prompt for `generate`. An empty prompt starts from the BOS token alone.

    The client writes the whole prompt, special tokens included, and they are parsed as
    such, except a vision model's image token texts (`image_tokens`): a raw prompt takes
    no images, so those stay ordinary text (`typed_image_text`), never an image's place.

    Raises:
        ValueError: the prompt is empty and the model has no BOS token to start from.
    """
    if image_tokens is None:
        token_ids = list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    else:
        token_ids = TypedImageText.of(image_tokens, tokenizer).raw_token_ids(tokenizer, prompt)
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


# -- helpers -----------------------------------------------------------------------------------


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
    if reads_content_parts(tokenizer, source):
        conversation = [_with_content_parts(entry) for entry in conversation]
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


_CONTENT_PROBE = "exo-content-probe"
_READS_CONTENT_PARTS: dict[str, bool] = {}


def reads_content_parts(tokenizer: Any, source: str) -> bool:
    """Whether the chat template `source` reads a message's content only as a list of
    parts (`{"type": "text", "text": ...}`, `{"type": "image"}`), as Idefics2/3's and
    SmolVLM's do: a plain string there renders as nothing. Found once per template by
    rendering a probe message as a string."""
    known = _READS_CONTENT_PARTS.get(source)
    if known is None:
        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": _CONTENT_PROBE}], chat_template=source,
                add_generation_prompt=True, tokenize=False,
            )  # fmt: skip
        except (TemplateError, ValueError, TypeError):
            text = _CONTENT_PROBE  # a template that needs more than a user turn: as before
        known = _CONTENT_PROBE not in str(text)
        _READS_CONTENT_PARTS[source] = known
    return known


def _with_content_parts(entry: dict[str, Any]) -> dict[str, Any]:
    """A template message whose string content is a list of parts: text, and an image
    part at each `IMAGE_MARKER` (an empty content is one empty text part)."""
    content = entry.get("content")
    if not isinstance(content, str):
        return entry
    parts: list[dict[str, Any]] = []
    for index, text in enumerate(content.split(IMAGE_MARKER)):
        if index:
            parts.append({"type": "image"})
        if text:
            parts.append({"type": "text", "text": text})
    return {**entry, "content": parts or [{"type": "text", "text": ""}]}


def _template_kwargs(
    params: TextGenerationTaskParams, tool_call_format: ToolCallFormat
) -> dict[str, Any]:
    """The request's thinking switches as the template's variables: `enable_thinking` and
    `reasoning_effort` when set. gpt-oss knows the efforts low / medium / high only and
    always reasons ("minimal", or thinking turned off, is "low"); DeepSeek-V3.1's template
    reads `thinking` instead of `enable_thinking`."""
    template_kwargs: dict[str, Any] = {}
    enable_thinking, effort = params.enable_thinking, params.reasoning_effort
    if enable_thinking is not None:
        template_kwargs["enable_thinking"] = enable_thinking
        if tool_call_format == "deepseek_v3":
            template_kwargs["thinking"] = enable_thinking
    if tool_call_format == "harmony" and (effort == "minimal" or enable_thinking is False):
        effort = "low"
    if effort is not None:
        template_kwargs["reasoning_effort"] = effort
    return template_kwargs
