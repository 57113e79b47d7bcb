"""Qwen2.5-VL's and Qwen3-VL's image tokens (`Qwen2_5_VLForConditionalGeneration`,
`Qwen3VLForConditionalGeneration`; facts from transformers' `Qwen2VLImageProcessor`
`smart_resize`, which both use, `Qwen2VLProcessor` and `Qwen3VLProcessor`, which expand an
image alike): the template writes
`<|vision_start|><|image_pad|><|vision_end|>`; the image is resized so each side is a
multiple of `patch_size x merge_size` pixels (each side rounded to the nearest multiple,
then the whole scaled down when the area passes `max_pixels`, or up when it is under
`min_pixels`), and `<|image_pad|>` becomes one `<|image_pad|>` per merged patch. Causal
attention; the text model places the image's tokens by row and column (multimodal rotary
positions: `exo.worker.engines.torch.model.qwen2_5_vl_vision`). Qwen3-VL's patches are 16
pixels where Qwen2.5-VL's are 14 (32- and 28-pixel merged patches), read from its config."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from exo.chat_protocol.image_tokens.base import ImageSize, OneTokenImages

QWEN_VL_MAX_ASPECT = 200
"""transformers' Qwen2-VL image processor refuses images longer than this many times their
width (or wider than their height)."""


@dataclass(frozen=True, slots=True)
class QwenVLImageTokens(OneTokenImages):
    """Qwen2.5-VL's image tokens: `<|image_pad|>` once per merged patch of the resized
    image, between the template's `<|vision_start|>` and `<|vision_end|>`.

    Attributes:
        image: the `<|image_pad|>` id (placeholder and soft token alike).
        image_text: the template's image part (`<|vision_start|><|image_pad|><|vision_end|>`).
        vision_start / vision_end: the ids of `<|vision_start|>` and `<|vision_end|>`.
        patch: a patch's side in pixels (`patch_size`).
        merge: patches per merged patch along each side (`spatial_merge_size`).
        min_pixels / max_pixels: the resized image's area bounds (`size.shortest_edge` /
            `size.longest_edge`, or the older `min_pixels` / `max_pixels`).
    """

    bidirectional: ClassVar[bool] = False
    model_types: ClassVar[tuple[str, ...]] = ("qwen2_5_vl",)

    vision_start: int
    vision_end: int
    patch: int
    merge: int
    min_pixels: int
    max_pixels: int

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> QwenVLImageTokens:
        """From a Qwen2.5-VL `config.json` and `preprocessor_config.json` (the published
        ids and transformers' processor defaults where absent)."""
        vision = config["vision_config"]
        size = preprocessor.get("size") or {}
        image = int(config.get("image_token_id", 151655))
        start = int(config.get("vision_start_token_id", 151652))
        end = int(config.get("vision_end_token_id", 151653))
        parts = tokenizer.convert_ids_to_tokens([start, image, end])
        return cls(
            image=image,
            image_text="".join(str(part) for part in parts),
            vision_start=start,
            vision_end=end,
            patch=int(preprocessor.get("patch_size", vision.get("patch_size", 14))),
            merge=int(preprocessor.get("merge_size", vision.get("spatial_merge_size", 2))),
            min_pixels=int(size.get("shortest_edge", preprocessor.get("min_pixels", 56 * 56))),
            max_pixels=int(
                size.get("longest_edge", preprocessor.get("max_pixels", 28 * 28 * 1280))
            ),
        )

    @property
    def image_token_ids(self) -> frozenset[int]:
        return frozenset((self.image, self.vision_start, self.vision_end))

    def resized(self, size: ImageSize) -> ImageSize:
        """`(width, height)` in pixels the image is resized to (transformers'
        `smart_resize`): whole merged patches, the area within `min_pixels .. max_pixels`.

        Raises:
            ValueError: a side longer than `QWEN_VL_MAX_ASPECT` times the other.
        """
        width, height = size
        if max(width, height) > QWEN_VL_MAX_ASPECT * min(width, height):
            raise ValueError(
                f"an image of {width}x{height} pixels is more than {QWEN_VL_MAX_ASPECT} "
                "times longer than wide"
            )
        factor = self.patch * self.merge
        rows, cols = round(height / factor) * factor, round(width / factor) * factor
        if rows * cols > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            rows = max(factor, math.floor(height / scale / factor) * factor)
            cols = max(factor, math.floor(width / scale / factor) * factor)
        elif rows * cols < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            rows = math.ceil(height * scale / factor) * factor
            cols = math.ceil(width * scale / factor) * factor
        return cols, rows

    def grid(self, size: ImageSize) -> tuple[int, int]:
        """`(rows, cols)` of merged patches of an image of `size` (as sent)."""
        width, height = self.resized(size)
        factor = self.patch * self.merge
        return height // factor, width // factor

    def sequence(self, size: ImageSize) -> list[int]:
        rows, cols = self.grid(size)
        return [self.image] * (rows * cols)


@dataclass(frozen=True, slots=True)
class Qwen3VLImageTokens(QwenVLImageTokens):
    """Qwen3-VL's image tokens: Qwen2.5-VL's layout (its own class so the engine picks
    Qwen3-VL's tower, whose rows also carry the deepstack features)."""

    model_types: ClassVar[tuple[str, ...]] = ("qwen3_vl",)
