"""Qwen2.5-VL's image input (`Qwen2_5_VLForConditionalGeneration`): pixels, the vision
tower with its patch merger, and the multimodal rotary positions of a prompt with images.

Facts taken from transformers' Qwen2-VL image processor and Qwen2.5-VL model (the code here
is exo's own; the token layout and the resize arithmetic are
`exo.chat_protocol.image_tokens.QwenVLImageTokens`):
- pixels: RGB, resized (bicubic by default) to `QwenVLImageTokens.resized` (whole merged
  patches), rescaled by 1/255 and normalized by CLIP's mean and std; then cut into
  `patch_size` patches ordered merged patch by merged patch (row-major over merged
  patches, and inside each its `merge x merge` patches row-major), each patch flattened as
  channel, time, row, column with the still image repeated `temporal_patch_size` times;
- the tower (`Qwen2_5_VisionTransformerPretrainedModel`: windowed attention with some
  full-attention blocks, 2-D rotary positions) takes those rows and the image's grid
  `(1, rows, cols)` in patches and returns one row per merged patch through its merger,
  in the text model's width; the rows replace the `<|image_pad|>` tokens' embeddings, in
  order, unscaled;
- positions: `batching.prompt_images.MultimodalPositions` (transformers' `get_rope_index`
  for images), applied by the direct forward with the text config's `mrope_section`
  (`direct_forward_parts.multimodal_rotary_tables`).

The tower is transformers' module filled from the checkpoint's `visual.` tensors; it runs
once per request, on the first rank, before the prompt's prefill, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exo.chat_protocol.image_tokens import QwenVLImageTokens
from exo.worker.engines.torch.batching.prompt_images import MultimodalPositions
from exo.worker.engines.torch.model.vision_parts import (
    CLIP_PIXELS,
    PixelSettings,
    TowerImageEncoder,
    VisionTower,
    decode_rgb,
    preprocessor_settings,
)

DEFAULT_TEMPORAL_PATCH = 2


@dataclass(frozen=True, slots=True)
class QwenVLPreprocessing:
    """How an image's file bytes become the tower's patch rows (`preprocessor_config.json`).

    Attributes:
        tokens: the image token layout (its resize sizes the image).
        pixels: resampling filter and normalization (Qwen2VLImageProcessor's defaults:
            CLIP's, bicubic).
        temporal_patch: frames per patch (`temporal_patch_size`; a still image repeated).
    """

    tokens: QwenVLImageTokens
    pixels: PixelSettings = CLIP_PIXELS
    temporal_patch: int = DEFAULT_TEMPORAL_PATCH

    @classmethod
    def of_model(
        cls, model_dir: Path, config: Any, tokens: QwenVLImageTokens
    ) -> QwenVLPreprocessing:
        """The checkpoint's preprocessing (defaults where `preprocessor_config.json` is
        absent or names none)."""
        settings = preprocessor_settings(model_dir)
        temporal = getattr(config.vision_config, "temporal_patch_size", DEFAULT_TEMPORAL_PATCH)
        return cls(
            tokens=tokens,
            pixels=CLIP_PIXELS.of_settings(settings),
            temporal_patch=int(settings.get("temporal_patch_size", temporal)),
        )

    def patches(self, data: bytes) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """One image file's patch rows `[rows x cols patches, 3 x temporal x patch x patch]`
        float32 (merged patch by merged patch) and its grid `(1, rows, cols)` in patches.

        Raises:
            ValueError: bytes Pillow cannot decode, or a side over 200 times the other.
        """
        image = decode_rgb(data)
        width, height = self.tokens.resized(image.size)
        pixels = self.pixels.normalized(self.pixels.resized(image, (width, height)))
        side, merge, frames = self.tokens.patch, self.tokens.merge, self.temporal_patch
        rows, cols = height // side, width // side
        grid = pixels.view(3, rows // merge, merge, side, cols // merge, merge, side)
        # -> [merged row, merged col, row in merge, col in merge, channel, y, x]
        grid = grid.permute(1, 4, 2, 5, 0, 3, 6)
        grid = grid[:, :, :, :, :, None].expand(*grid.shape[:5], frames, side, side)
        return grid.reshape(rows * cols, 3 * frames * side * side), (1, rows, cols)


class QwenVLVisionEncoder(VisionTower):
    """The Qwen2.5-VL vision tower with its merger: patch rows to the rows that replace an
    image's `<|image_pad|>` tokens.

    Args:
        visual: transformers' `Qwen2_5_VisionTransformerPretrainedModel` (weights loaded
            or random).
    """

    checkpoint_prefixes = ("visual.",)

    def __init__(self, visual: torch.nn.Module) -> None:
        super().__init__()
        self.visual = visual

    @classmethod
    def from_config(cls, config: Any) -> QwenVLVisionEncoder:
        """Random-weight modules of `config`'s shapes (float32, eval mode)."""
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(config.vision_config)
        return cls(visual).float().eval()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's `patches` (`QwenVLPreprocessing.patches`) and grid →
        `[merged patches, text hidden]` float32, row by row."""
        grid_thw = torch.tensor([grid], dtype=torch.long, device=patches.device)
        output = self.visual(patches.float(), grid_thw=grid_thw)
        return output.pooler_output.float()


class QwenVLImageEncoder(TowerImageEncoder[QwenVLVisionEncoder, QwenVLPreprocessing]):
    """A loaded Qwen2.5-VL model's images to their `<|image_pad|>` tokens' rows
    (`vision_input.ImageEncoder`)."""

    tower_class = QwenVLVisionEncoder

    @classmethod
    def preprocessing_of(
        cls, model_dir: Path, config: Any, tokens: QwenVLImageTokens
    ) -> QwenVLPreprocessing:
        return QwenVLPreprocessing.of_model(model_dir, config, tokens)

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[merged patches, text hidden]` float32 rows (each image
        through the tower at its own size).

        Raises:
            ValueError: an undecodable image, or one too long for its width.
        """
        rows = []
        for data in images:
            patches, grid = self.preprocessing.patches(data)
            rows.append(self.encoder(patches.to(self.device), grid))
        return rows


def prompt_positions(
    tokens: QwenVLImageTokens,
    length: int,
    spans: Sequence[Sequence[tuple[int, int]]],
    sizes: Sequence[tuple[int, int]],
) -> MultimodalPositions:
    """The multimodal rotary positions of an expanded prompt of `length` tokens whose
    images (`(width, height)` in `sizes`) have their `<|image_pad|>` runs at `spans`
    (`ImageTokens.spans`: one run per image here)."""
    images = []
    for image_spans, size in zip(spans, sizes, strict=True):
        rows, cols = tokens.grid(size)
        images += [(start, rows, cols) for start, _ in image_spans]
    return MultimodalPositions.of_prompt(length, images)
