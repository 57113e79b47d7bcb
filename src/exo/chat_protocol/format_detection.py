"""Which tool-call format a model uses, read from its chat template and vocabulary, and a
decoder that keeps the special tokens that format's parser reads."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from exo.chat_protocol.harmony import CALL, CHANNEL, HARMONY_TOKENS, RETURN
from exo.chat_protocol.output_parsing import THINK_CLOSE, THINK_OPEN
from exo.chat_protocol.tool_call_markup import (
    DEEPSEEK_CALLS_BEGIN,
    DEEPSEEK_SEP,
    FORMAT_TOKENS,
    GLM_ARG_KEY,
    HERMES_CLOSE,
    HERMES_OPEN,
    KIMI_CALL_BEGIN,
    KIMI_SECTION_BEGIN,
    MINIMAX_OPEN,
    MISTRAL_ARGS,
    MISTRAL_CALL_ID,
    MISTRAL_TOOL_CALLS,
    PYTHON_TAG,
    QWEN3_CODER_FUNCTION,
)
from exo.chat_protocol.tool_call_parsing import ToolCallFormat

# Special tokens the output parsers read whatever the format; a format's own tokens
# (`_FORMAT_MARKER_TOKENS`) are kept too; every other special token is dropped on decode.
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
_FORMAT_MARKER_TOKENS: dict[ToolCallFormat, tuple[str, ...]] = {
    **FORMAT_TOKENS,
    "harmony": HARMONY_TOKENS,
}
# A template's own tool markup, most specific first (Qwen3-Coder's and GLM's templates also
# write `<tool_call>`): the format it shows.
_TEMPLATE_SIGNS: tuple[tuple[str, ToolCallFormat], ...] = (
    (CHANNEL, "harmony"),
    (DEEPSEEK_CALLS_BEGIN, "deepseek_v3"),
    (DEEPSEEK_SEP, "deepseek_v3"),
    (KIMI_SECTION_BEGIN, "kimi_k2"),
    (KIMI_CALL_BEGIN, "kimi_k2"),
    (MINIMAX_OPEN, "minimax_m2"),
    (GLM_ARG_KEY, "glm45"),
    (QWEN3_CODER_FUNCTION, "qwen3_coder"),
    (HERMES_OPEN, "hermes"),
    (MISTRAL_TOOL_CALLS, "mistral"),
    (PYTHON_TAG, "llama3_json"),
)
_FORMATS_NEEDING_TOOLS: frozenset[ToolCallFormat] = frozenset(
    ("deepseek_v3", "kimi_k2", "minimax_m2", "glm45", "qwen3_coder")
)
# Vocabulary tokens that show a format when the template shows none.
_VOCABULARY_SIGNS: tuple[tuple[str, ToolCallFormat], ...] = (
    (CHANNEL, "harmony"),
    (DEEPSEEK_CALLS_BEGIN, "deepseek_v3"),
    (KIMI_SECTION_BEGIN, "kimi_k2"),
    (MINIMAX_OPEN, "minimax_m2"),
    (MISTRAL_TOOL_CALLS, "mistral"),
    (HERMES_OPEN, "hermes"),
    (PYTHON_TAG, "llama3_json"),
)
_LLAMA3_HEADER = "<|start_header_id|>"
TOOLS_VARIABLE = re.compile(r"\btools\b")


def detect_tool_call_format(tokenizer: Any) -> ToolCallFormat:
    """The tool-call format the model was trained on, from its chat template and vocabulary.

    The template's own markup first (`template_tool_call_format`); Llama 3 header tokens
    with tools: "llama3_json" (Llama 3.1 model card: JSON tool calling). A template without
    tools: "hermes", the format exo's fallback system message asks for — unless it is
    gpt-oss's harmony, whose channels the output parser must read with or without tools.
    Else the vocabulary's markup tokens; anything else: "generic".

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        The format name.
    """
    try:
        source = template_source(tokenizer, with_tools=True)
    except ValueError:
        return "generic"
    tools_in_template = bool(TOOLS_VARIABLE.search(source))
    shown = template_tool_call_format(source)
    if shown is not None:
        return shown
    if tools_in_template and _LLAMA3_HEADER in source:
        return "llama3_json"
    if not tools_in_template:
        return "hermes"
    for token, tool_call_format in _VOCABULARY_SIGNS:
        if _token_id(tokenizer, token) is not None:
            return tool_call_format
    return "generic"


def template_tool_call_format(source: str) -> ToolCallFormat | None:
    """The tool-call format a chat template's text shows by its own markup, or None.

    gpt-oss's `<|channel|>`: "harmony". DeepSeek's `<｜tool▁calls▁begin｜>`: "deepseek_v3".
    Kimi K2's `<|tool_calls_section_begin|>`: "kimi_k2". MiniMax-M2's `<minimax:tool_call>`:
    "minimax_m2". GLM-4.5's `<arg_key>`: "glm45". Qwen3-Coder's `<function=`:
    "qwen3_coder". `<tool_call>`: "hermes" (Hermes function-calling format, NousResearch;
    Qwen2.5/Qwen3). `[TOOL_CALLS]`: "mistral". `<|python_tag|>`: "llama3_json".

    Apart from harmony (whose channels carry every answer), the newer families' markup
    counts only in a template that takes `tools`: exo asks a template without them for
    Hermes calls (DeepSeek-R1's template writes `<｜tool▁calls▁begin｜>` in history alone).
    """
    tools_in_template = bool(TOOLS_VARIABLE.search(source))
    for sign, tool_call_format in _TEMPLATE_SIGNS:
        if sign in source:
            if tool_call_format in _FORMATS_NEEDING_TOOLS and not tools_in_template:
                continue
            return tool_call_format
    return None


def decode_keeping_markers(tokenizer: Any) -> Callable[[Sequence[int]], str]:
    """A decoder that drops special tokens except the markers the output parsers read.

    `skip_special_tokens=True` would also drop e.g. Mistral's special `[TOOL_CALLS]`, a
    special `<think>` or every one of gpt-oss's harmony markers, so the parser would never
    see them. The markers kept are `MARKER_TOKENS` and those of the model's own format
    (`detect_tool_call_format`: harmony's `<|channel|>`, `<|message|>`, ...; Kimi K2's and
    DeepSeek's call markers), so another family's special token of the same spelling (e.g.
    Phi-3's `<|end|>`) is still dropped. The set of ids to drop is computed once here; the
    returned function is called per token on a small window.

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        A function from token ids to text, keeping the vocabulary's markers.
    """
    special_ids = set(getattr(tokenizer, "all_special_ids", ()))
    added_tokens: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
    special_ids.update(
        token_id for token_id, token in added_tokens.items() if getattr(token, "special", False)
    )
    markers = MARKER_TOKENS + _FORMAT_MARKER_TOKENS.get(detect_tool_call_format(tokenizer), ())
    marker_ids = {_token_id(tokenizer, marker) for marker in markers}
    dropped = frozenset(special_ids - marker_ids)

    def decode(token_ids: Sequence[int]) -> str:
        kept = [token_id for token_id in token_ids if token_id not in dropped]
        text: str = tokenizer.decode(
            kept, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )
        return text

    return decode


def format_stop_token_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens that end an assistant turn in the model's own format, whatever its
    generation config names as EOS: harmony's `<|return|>` (answer done) and `<|call|>` (a
    tool call; the turn ends), both stop tokens of the format (OpenAI, "OpenAI Harmony
    Response Format"). A gpt-oss checkout whose generation config names only `<|return|>`
    would otherwise write on past a call. Other formats: none (their EOS is the config's).

    Args:
        tokenizer: A Hugging Face tokenizer.

    Returns:
        The token ids (empty when the format has none or the vocabulary lacks them).
    """
    if detect_tool_call_format(tokenizer) != "harmony":
        return frozenset()
    ids = (_token_id(tokenizer, marker) for marker in (RETURN, CALL))
    return frozenset(token_id for token_id in ids if token_id is not None)


def template_source(tokenizer: Any, with_tools: bool) -> str:
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


def _token_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when it is one token of the vocabulary, else None."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(token_id, int) or token_id < 0:
        return None
    return token_id if tokenizer.convert_ids_to_tokens(token_id) == token else None
