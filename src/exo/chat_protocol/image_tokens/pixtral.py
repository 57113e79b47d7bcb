"""Mistral 3's image tokens (`Mistral3ForConditionalGeneration`, Pixtral's tower; facts from
transformers' `PixtralProcessor` and `PixtralImageProcessor`): the template writes `[IMG]`;
an image bigger than `size.longest_edge` on either side is scaled down to fit (sides
rounded down), then each side is rounded up to whole merged patches (`patch_size x
spatial_merge_size` pixels); each row of merged patches is written as `[IMG]` per merged
patch + `[IMG_BREAK]`, the last row's `[IMG_BREAK]` being `[IMG_END]`. Causal attention."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from exo.chat_protocol.image_tokens.base import ImageSize, OneTokenImages


@dataclass(frozen=True, slots=True)
class PixtralImageTokens(OneTokenImages):
    """Mistral 3's (Pixtral's) image tokens: one `[IMG]` per merged patch, row by row.

    Attributes:
        image / image_text: the `[IMG]` id (placeholder and soft token alike) and text.
        image_break / image_end: the ids of `[IMG_BREAK]` and `[IMG_END]`.
        patch: a merged patch's side in pixels (`patch_size x spatial_merge_size`).
        longest_edge: the largest side an image keeps, in pixels (`size.longest_edge`).
    """

    bidirectional: ClassVar[bool] = False
    model_types: ClassVar[tuple[str, ...]] = ("mistral3",)

    image_break: tuple[int, ...]
    image_end: tuple[int, ...]
    patch: int
    longest_edge: int

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> PixtralImageTokens:
        """From a Mistral 3 `config.json` and `preprocessor_config.json` (the tower's
        `image_size` as the longest edge where the latter names none)."""
        vision = config["vision_config"]
        image = int(config.get("image_token_index", config.get("image_token_id", 10)))
        longest = (preprocessor.get("size") or {}).get("longest_edge", vision.get("image_size"))
        return cls(
            image=image,
            image_text=str(tokenizer.convert_ids_to_tokens(image)),
            image_break=tuple(tokenizer.encode("[IMG_BREAK]", add_special_tokens=False)),
            image_end=tuple(tokenizer.encode("[IMG_END]", add_special_tokens=False)),
            patch=int(vision.get("patch_size", 14)) * int(config.get("spatial_merge_size", 2)),
            longest_edge=int(longest or 1540),
        )

    @property
    def image_token_ids(self) -> frozenset[int]:
        return frozenset((self.image, *self.image_break, *self.image_end))

    def grid(self, size: ImageSize) -> tuple[int, int]:
        """`(rows, cols)` of merged patches of an image of `size` (as sent): scaled down to
        fit `longest_edge` (sides rounded down), each side rounded up to whole patches."""
        width, height = size
        ratio = max(width / self.longest_edge, height / self.longest_edge)
        if ratio > 1:
            width, height = math.floor(width / ratio), math.floor(height / ratio)
        return (height - 1) // self.patch + 1, (width - 1) // self.patch + 1

    def sequence(self, size: ImageSize) -> list[int]:
        rows, cols = self.grid(size)
        ids: list[int] = []
        for row in range(rows):
            ids += [self.image] * cols
            ids += self.image_end if row == rows - 1 else self.image_break
        return ids
