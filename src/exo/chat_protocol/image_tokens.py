"""A vision model's image tokens in a rendered prompt: each `IMAGE_MARKER` of a message
becomes the chat template's image part and then the model's whole image sequence, so the
API node's token counts and the runner's prompt agree (both render through `render_prompt`
with the model's `ImageTokens`).

Gemma 3 (`Gemma3ForConditionalGeneration`; facts from transformers' `Gemma3Processor` and the
published chat template, the code is exo's own): the template writes `<start_of_image>` for
an image part, and the processor writes "\\n\\n" + `<start_of_image>` + the image soft token
x `mm_tokens_per_image` + `<end_of_image>` + "\\n\\n" in its place.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from exo.shared.types.text_generation import IMAGE_MARKER, ChatMessage


@dataclass(frozen=True, slots=True)
class ImageTokens:
    """The token ids around and of an image.

    Attributes:
        begin / soft / end: begin-of-image, image soft token and end-of-image ids.
        newlines: the ids of "\\n\\n" (written before the begin and after the end token).
        per_image: soft tokens per image (`mm_tokens_per_image`).
        begin_text: the begin-of-image token's text, written where a marker was.
    """

    begin: int
    soft: int
    end: int
    newlines: tuple[int, ...]
    per_image: int
    begin_text: str

    @classmethod
    def of_model(cls, directory: Path, tokenizer: Any) -> ImageTokens | None:
        """The image tokens of the Gemma 3 vision checkpoint whose `config.json` is in
        `directory`; None for any other model or where the file is absent or unreadable."""
        try:
            config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return cls.of_config(config, tokenizer)

    @classmethod
    def of_config(cls, config: Any, tokenizer: Any) -> ImageTokens | None:
        """As `of_model`, from the parsed `config.json` (a dict) or a transformers config."""
        if not isinstance(config, dict):
            config = config.to_dict()
        if config.get("model_type") != "gemma3" or not config.get("vision_config"):
            return None
        begin = int(config.get("boi_token_index", 255999))
        return cls(
            begin=begin,
            soft=int(config.get("image_token_index", 262144)),
            end=int(config.get("eoi_token_index", 256000)),
            newlines=tuple(tokenizer.encode("\n\n", add_special_tokens=False)),
            per_image=int(config.get("mm_tokens_per_image", 256)),
            begin_text=str(tokenizer.convert_ids_to_tokens(begin)),
        )

    def template_messages(self, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
        """`messages` with each `IMAGE_MARKER` as the template's image part."""
        return tuple(
            message.model_copy(
                update={"content": message.content.replace(IMAGE_MARKER, self.begin_text)}
            )
            if IMAGE_MARKER in message.content
            else message
            for message in messages
        )

    def expand(self, token_ids: Sequence[int], images: int) -> tuple[list[int], list[int]]:
        """Each begin-of-image token of `token_ids` expanded to the image's full sequence.

        Returns:
            `(ids, starts)`: the expanded ids and each image's first soft-token position.

        Raises:
            ValueError: the prompt's begin-of-image tokens are not `images` in number (a
                message's text holding the token's own text, say).
        """
        ids: list[int] = []
        starts: list[int] = []
        for token in token_ids:
            if token != self.begin:
                ids.append(token)
                continue
            ids += [*self.newlines, self.begin]
            starts.append(len(ids))
            ids += [self.soft] * self.per_image + [self.end, *self.newlines]
        if len(starts) != images:
            raise ValueError(f"the prompt places {len(starts)} images, the request has {images}")
        return ids, starts
