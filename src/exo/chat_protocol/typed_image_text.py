"""A client's text that holds a vision model's image token text stays text.

A chat template's output is tokenized with its special tokens parsed (it writes them
itself), so a message that holds `<|image_pad|>`, `<start_of_image>`, `<image>` or `[IMG]`
would get the image token itself: an image place without an image (the model reads the
token's embedding, never trained as text), or a request refused for placing more images
than it has. What OpenAI's and Anthropic's users see instead: typed text is text, and only
a request's image parts place images.

So before the template runs, each such string in the text a client wrote (messages'
content, reasoning, names, tool calls; tool definitions) becomes a sentinel of letters and
digits that holds a random nonce of this rendering (no client can type it in advance; it
survives the JSON escaping templates apply to tool arguments). The rendered text is
tokenized piece by piece between sentinels as before, and each sentinel becomes the
ordinary tokens of the string it stands for (`ordinary_token_ids`: the tokenizer's
normalizer, pre-tokenizer and model, without its added tokens). Only the template's own
image parts (written for `IMAGE_MARKER`) stay image tokens.

Only image tokens are kept as text: other special tokens a client types (`<|im_end|>`,
`<end_of_turn>`) are still parsed as the tokens they name, as llama.cpp's server and vLLM
do with a chat prompt.
"""

from __future__ import annotations

import re
import secrets
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from exo.chat_protocol.image_tokens import ImageTokens
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolCall,
)

_TEXTS: weakref.WeakKeyDictionary[Any, dict[frozenset[int], tuple[str, ...]]] = (
    weakref.WeakKeyDictionary()
)


def ordinary_token_ids(tokenizer: Any, text: str) -> list[int]:
    """The ids `text` gets as ordinary text: none of the tokenizer's added tokens (special
    or not) is matched in it. A fast tokenizer's normalizer, pre-tokenizer and model run
    on it (what Hugging Face `tokenizers` does with the text between added tokens); a slow
    one tokenizes it with `split_special_tokens`."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        encoded = tokenizer(text, add_special_tokens=False, split_special_tokens=True)
        return list(encoded["input_ids"])
    normalized = backend.normalizer.normalize_str(text) if backend.normalizer else text
    if backend.pre_tokenizer is None:
        pieces = [normalized]
    else:
        pieces = [piece for piece, _ in backend.pre_tokenizer.pre_tokenize_str(normalized)]
    return [token.id for piece in pieces for token in backend.model.tokenize(piece)]


def image_token_texts(image_tokens: ImageTokens, tokenizer: Any) -> tuple[str, ...]:
    """The texts a client could type that the tokenizer reads as one of the family's image
    tokens (`ImageTokens.image_token_ids`), longest first; found once per tokenizer."""
    ids = image_tokens.image_token_ids
    known = _TEXTS.setdefault(tokenizer, {})
    texts = known.get(ids)
    if texts is None:
        found: set[str] = set()
        for token_id in sorted(ids):
            text = tokenizer.convert_ids_to_tokens(token_id)
            if not isinstance(text, str) or not text:
                continue
            if list(tokenizer(text, add_special_tokens=False)["input_ids"]) != [token_id]:
                continue  # typing it gives other tokens anyway
            if ordinary_token_ids(tokenizer, text) == [token_id]:
                continue  # an ordinary word of the vocabulary: nothing to keep apart
            found.add(text)
        texts = known[ids] = tuple(sorted(found, key=lambda text: (-len(text), text)))
    return texts


@dataclass(frozen=True, slots=True)
class TypedImageText:
    """One rendering's sentinels for the image token texts a client typed.

    Attributes:
        texts: the image token texts, longest first (`image_token_texts`).
        nonce: this rendering's random part of every sentinel.
    """

    texts: tuple[str, ...]
    nonce: str

    @classmethod
    def of(cls, image_tokens: ImageTokens, tokenizer: Any) -> TypedImageText:
        """The sentinels of a rendering for `image_tokens`' model, with a fresh nonce."""
        return cls(image_token_texts(image_tokens, tokenizer), secrets.token_hex(8))

    @property
    def _typed(self) -> re.Pattern[str] | None:
        if not self.texts:
            return None
        return re.compile("|".join(re.escape(text) for text in self.texts))

    @property
    def _sentinel(self) -> re.Pattern[str]:
        return re.compile(f"exotyped{self.nonce}n([0-9]+)e")

    def escape(self, text: str) -> str:
        """`text` with each image token text a sentinel."""
        typed = self._typed
        if typed is None or not any(typed_text in text for typed_text in self.texts):
            return text  # the common case, found by plain substring searches
        index = {text: position for position, text in enumerate(self.texts)}
        return typed.sub(lambda match: f"exotyped{self.nonce}n{index[match[0]]}e", text)

    def restore(self, text: str) -> str:
        """`text` with each sentinel the image token text it stands for."""
        if self.nonce not in text:
            return text
        return self._sentinel.sub(lambda match: self.texts[int(match[1])], text)

    def escape_params(self, params: TextGenerationTaskParams) -> TextGenerationTaskParams:
        """`params` with the sentinels in every text a chat template renders: messages'
        content, names, reasoning and tool calls; tools' names, descriptions and schemas
        (a named `tool_choice` alike, so it still names its tool)."""
        if not self.texts:
            return params
        choice = params.tool_choice
        if isinstance(choice, NamedToolChoice):
            choice = NamedToolChoice(name=self.escape(choice.name))
        tools = tuple(
            tool.model_copy(
                update={
                    "name": self.escape(tool.name),
                    "description": self._escape_optional(tool.description),
                    "parameters": self._escape_json(tool.parameters),
                }
            )
            for tool in params.tools
        )
        messages = tuple(self._escape_message(message) for message in params.messages)
        return params.model_copy(
            update={"messages": messages, "tools": tools, "tool_choice": choice}
        )

    def token_ids(self, tokenizer: Any, text: str) -> list[int]:
        """A rendered (escaped) text's token ids: the text between sentinels tokenized as
        the template's text (its special tokens parsed), each run of sentinels as the
        ordinary tokens of the texts they stand for.

        Returns:
            The ids, without the special tokens the tokenizer adds by itself.
        """
        pieces = self._sentinel.split(text) if self.nonce in text else [text]
        if len(pieces) == 1:
            return list(tokenizer(text, add_special_tokens=False)["input_ids"])
        ids: list[int] = []
        typed = ""
        # `split` alternates text and a sentinel's index: text, index, text, ..., text.
        for position, piece in enumerate(pieces):
            if position % 2:
                typed += self.texts[int(piece)]
                continue
            if typed and piece:
                ids += ordinary_token_ids(tokenizer, typed)
                typed = ""
            if piece:
                ids += tokenizer(piece, add_special_tokens=False)["input_ids"]
        if typed:
            ids += ordinary_token_ids(tokenizer, typed)
        return ids

    def raw_token_ids(self, tokenizer: Any, prompt: str) -> list[int]:
        """A raw prompt's ids: tokenized with the special tokens the tokenizer adds by
        itself (its BOS, say) and its other special tokens parsed, each image token text
        as ordinary tokens."""
        escaped = self.escape(prompt)
        if escaped == prompt:
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        # The added tokens around any text, found from one letter with and without them.
        bare = list(tokenizer("a", add_special_tokens=False)["input_ids"])
        full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
        token_ids = self.token_ids(tokenizer, escaped)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return full[:start] + token_ids + full[start + len(bare) :]
        return token_ids

    def _escape_optional(self, text: str | None) -> str | None:
        return None if text is None else self.escape(text)

    def _escape_json(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.escape(value)
        if isinstance(value, Mapping):
            return {self.escape(str(key)): self._escape_json(item) for key, item in value.items()}
        if isinstance(value, Sequence):
            return [self._escape_json(item) for item in value]
        return value

    def _escape_message(self, message: ChatMessage) -> ChatMessage:
        calls = tuple(
            ToolCall(id=call.id, name=self.escape(call.name), arguments=self.escape(call.arguments))
            for call in message.tool_calls
        )
        return message.model_copy(
            update={
                "content": self.escape(message.content),
                "name": self._escape_optional(message.name),
                "reasoning_content": self._escape_optional(message.reasoning_content),
                "tool_calls": calls,
            }
        )
