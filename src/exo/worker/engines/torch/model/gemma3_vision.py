"""Gemma 3's image input (`Gemma3ForConditionalGeneration`, 4B and up): preprocessing, the
image tokens of a prompt, and the vision tower with its projector, loaded beside the text
model.

Facts taken from transformers' Gemma 3 processor and model (the code here is exo's own):
- an image becomes `mm_tokens_per_image` soft tokens: where the prompt has a begin-of-image
  token the processor writes "\\n\\n" + begin + soft token x N + end-of-image + "\\n\\n"
  (`Gemma3Processor.full_image_sequence`);
- pixels: RGB, resized to the image size of `preprocessor_config.json` (896 x 896 on the
  published checkpoints; bilinear), rescaled by 1/255, normalized by its mean and std (0.5);
  pan-and-scan (extra crops of wide images) is not done here: one view per image;
- the SigLIP tower's last hidden state `[n, patches, vision hidden]` is average-pooled to
  `mm_tokens_per_image` tokens, RMS-normed (`1 + weight`) and projected to the text hidden
  size (`Gemma3MultiModalProjector`); those rows replace the soft tokens' embeddings,
  unscaled (the text embeddings carry `sqrt(hidden)`, the image rows do not).

The tower and projector are transformers' modules (`SiglipVisionModel`,
`Gemma3MultiModalProjector`) filled from the checkpoint's `vision_tower.` and
`multi_modal_projector.` tensors; they run once per image, on the first rank, before the
prompt's prefill, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exo.worker.engines.torch.model.vision_parts import (
    PixelSettings,
    TowerImageEncoder,
    VisionTower,
    decode_rgb,
    preprocessor_settings,
)

DEFAULT_PIXELS = PixelSettings(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), resample=2)
"""Gemma3ImageProcessor's defaults where a checkpoint has no preprocessor_config.json
(bilinear)."""


@dataclass(frozen=True, slots=True)
class ImagePreprocessing:
    """How an image's file bytes become pixel values (`preprocessor_config.json`).

    Attributes:
        height / width: pixels after resizing.
        pixels: resampling filter and normalization.
    """

    height: int
    width: int
    pixels: PixelSettings = DEFAULT_PIXELS

    @classmethod
    def of_model(cls, model_dir: Path, image_size: int) -> ImagePreprocessing:
        """The checkpoint's preprocessing; `image_size` (the tower's) where its
        `preprocessor_config.json` is absent or names no size."""
        settings = preprocessor_settings(model_dir)
        size = settings.get("size") or {}
        return cls(
            height=int(size.get("height", image_size)),
            width=int(size.get("width", image_size)),
            pixels=DEFAULT_PIXELS.of_settings(settings),
        )

    def pixel_values(self, data: bytes) -> torch.Tensor:
        """One image file's (PNG, JPEG, WebP, GIF: the first frame) pixel values
        `[3, height, width]` float32.

        Raises:
            ValueError: bytes Pillow cannot decode.
        """
        image = self.pixels.resized(decode_rgb(data), (self.width, self.height))
        return self.pixels.normalized(image)


class Gemma3VisionEncoder(VisionTower):
    """The SigLIP tower and the multimodal projector: pixel values to the rows that replace
    an image's soft tokens.

    Args:
        config: the checkpoint's `Gemma3Config`.
        vision_tower / projector: transformers' modules (weights loaded or random).
    """

    checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, config: Any, vision_tower: torch.nn.Module, projector: torch.nn.Module):
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    @classmethod
    def from_config(cls, config: Any) -> Gemma3VisionEncoder:
        """Random-weight modules of `config`'s shapes (float32, eval mode)."""
        from transformers import AutoModel
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        tower = AutoModel.from_config(config.vision_config)
        return cls(config, tower, Gemma3MultiModalProjector(config)).float().eval()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`pixel_values` `[n, 3, height, width]` → `[n, mm_tokens_per_image, text hidden]`
        float32."""
        states = self.vision_tower(pixel_values=pixel_values.float()).last_hidden_state
        return self.multi_modal_projector(states).float()


class Gemma3ImageEncoder(TowerImageEncoder[Gemma3VisionEncoder, ImagePreprocessing]):
    """A loaded Gemma 3 model's images to their soft tokens' rows (`vision_input.ImageEncoder`)."""

    tower_class = Gemma3VisionEncoder

    @classmethod
    def preprocessing_of(cls, model_dir: Path, config: Any, tokens: Any) -> ImagePreprocessing:
        return ImagePreprocessing.of_model(model_dir, int(config.vision_config.image_size))

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[mm_tokens_per_image, text hidden]` float32 rows (one batch
        through the tower).

        Raises:
            ValueError: an undecodable image.
        """
        if not images:
            return []
        pixels = torch.stack([self.preprocessing.pixel_values(data) for data in images])
        return list(self.encoder(pixels.to(self.device)))  # [n, per_image, hidden]
