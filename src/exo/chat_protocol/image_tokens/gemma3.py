"""Gemma 3's image tokens (`Gemma3ForConditionalGeneration`; facts from transformers'
`Gemma3Processor` and the published chat template): the template writes
`<start_of_image>` for an image part, and the processor writes "\\n\\n" +
`<start_of_image>` + the image soft token x `mm_tokens_per_image` + `<end_of_image>` +
"\\n\\n" in its place, whatever the image's size. The image's soft tokens attend to each
other in both directions."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from exo.chat_protocol.image_tokens.base import ImageSize, ImageTokens


@dataclass(frozen=True, slots=True)
class Gemma3ImageTokens(ImageTokens):
    """Gemma 3's image tokens: the same sequence for every image.

    Attributes:
        begin / soft_id / end: begin-of-image, image soft token and end-of-image ids.
        newlines: the ids of "\\n\\n" (written before the begin and after the end token).
        per_image: soft tokens per image (`mm_tokens_per_image`).
        begin_text: the begin-of-image token's text, written where a marker was.
    """

    bidirectional: ClassVar[bool] = True
    model_types: ClassVar[tuple[str, ...]] = ("gemma3",)

    begin: int
    soft_id: int
    end: int
    newlines: tuple[int, ...]
    per_image: int
    begin_text: str

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> Gemma3ImageTokens:
        """From a Gemma 3 vision `config.json` (transformers' defaults for absent ids); the
        preprocessor's settings change nothing here."""
        begin = int(config.get("boi_token_index", 255999))
        return cls(
            begin=begin,
            soft_id=int(config.get("image_token_index", 262144)),
            end=int(config.get("eoi_token_index", 256000)),
            newlines=tuple(tokenizer.encode("\n\n", add_special_tokens=False)),
            per_image=int(config.get("mm_tokens_per_image", 256)),
            begin_text=str(tokenizer.convert_ids_to_tokens(begin)),
        )

    @property
    def placeholder(self) -> int:
        return self.begin

    @property
    def placeholder_text(self) -> str:
        return self.begin_text

    @property
    def soft(self) -> int:
        return self.soft_id

    @property
    def image_token_ids(self) -> frozenset[int]:
        return frozenset((self.begin, self.soft_id, self.end))

    def sequence(self, size: ImageSize) -> list[int]:
        soft = [self.soft_id] * self.per_image
        return [*self.newlines, self.begin, *soft, self.end, *self.newlines]
