"""Mistral 3's image input (`Mistral3ForConditionalGeneration`: Mistral Small 3.1 and later,
Pixtral's vision encoder): pixels, and the tower with its projector, loaded beside the
Mistral text model.

Facts taken from transformers' Pixtral image processor and Mistral 3 model (the code here is
exo's own; the token layout and the size arithmetic are `exo.chat_protocol.image_tokens`):
- pixels: RGB, resized (bicubic by default) to the merged-patch grid of
  `PixtralImageTokens.grid` (rows x merged patch, cols x merged patch), rescaled by 1/255
  and normalized by CLIP's mean and std (the published checkpoints' values);
- the Pixtral tower embeds 2-D patches of `patch_size` pixels with rotary positions over
  their row and column (each image at its own size); the hidden states of
  `vision_feature_layer` go through the projector: RMSNorm, the patch merger (each
  `spatial_merge_size x spatial_merge_size` block of patches concatenated and projected
  back to the tower's width), then linear, GELU, linear to the text hidden size; those rows
  replace the `[IMG]` tokens' embeddings in row order, unscaled.

The tower and projector are transformers' modules (`PixtralVisionModel`,
`Mistral3MultiModalProjector`) filled from the checkpoint's `vision_tower.` and
`multi_modal_projector.` tensors; they run once per request, on the first rank, before the
prompt's prefill, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exo.chat_protocol.image_tokens import PixtralImageTokens
from exo.worker.engines.torch.model.vision_parts import (
    CLIP_PIXELS,
    PixelSettings,
    TowerImageEncoder,
    VisionTower,
    decode_rgb,
    preprocessor_settings,
)


@dataclass(frozen=True, slots=True)
class PixtralPreprocessing:
    """How an image's file bytes become the tower's pixels (`preprocessor_config.json`).

    Attributes:
        tokens: the image token layout (its grid sizes the image).
        pixels: resampling filter and normalization (PixtralImageProcessor's defaults:
            CLIP's, bicubic).
    """

    tokens: PixtralImageTokens
    pixels: PixelSettings = CLIP_PIXELS

    @classmethod
    def of_model(cls, model_dir: Path, tokens: PixtralImageTokens) -> PixtralPreprocessing:
        """The checkpoint's preprocessing (defaults where `preprocessor_config.json` is
        absent or names none)."""
        return cls(tokens=tokens, pixels=CLIP_PIXELS.of_settings(preprocessor_settings(model_dir)))

    def pixel_values(self, data: bytes) -> torch.Tensor:
        """One image file's pixels `[3, rows x merged patch, cols x merged patch]` float32.

        Raises:
            ValueError: bytes Pillow cannot decode, or an image too thin to keep a row.
        """
        image = decode_rgb(data)
        rows, cols = self.tokens.grid(image.size)
        if rows < 1 or cols < 1:
            raise ValueError(f"an image of {image.width}x{image.height} pixels is too thin")
        side = self.tokens.patch
        image = self.pixels.resized(image, (cols * side, rows * side))
        return self.pixels.normalized(image)


class Mistral3VisionEncoder(VisionTower):
    """The Pixtral tower and the multimodal projector: pixels to the rows that replace an
    image's `[IMG]` tokens.

    Args:
        config: the checkpoint's `Mistral3Config`.
        vision_tower / projector: transformers' modules (weights loaded or random).
    """

    checkpoint_prefixes = ("vision_tower.", "multi_modal_projector.")

    def __init__(self, config: Any, vision_tower: torch.nn.Module, projector: torch.nn.Module):
        super().__init__()
        self.config = config
        self.vision_tower = vision_tower
        self.multi_modal_projector = projector

    @classmethod
    def from_config(cls, config: Any) -> Mistral3VisionEncoder:
        """Random-weight modules of `config`'s shapes (float32, eval mode)."""
        from transformers.models.mistral3.modeling_mistral3 import Mistral3MultiModalProjector
        from transformers.models.pixtral.modeling_pixtral import PixtralVisionModel

        tower = PixtralVisionModel(config.vision_config)
        return cls(config, tower, Mistral3MultiModalProjector(config)).float().eval()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """One image's `pixel_values` `[3, height, width]` (whole merged patches) →
        `[merged patches, text hidden]` float32, row by row."""
        size = [tuple(pixel_values.shape[1:])]
        output = self.vision_tower(
            pixel_values.float()[None], image_sizes=size, output_hidden_states=True
        )
        layer = self.config.vision_feature_layer
        layers = [layer] if isinstance(layer, int) else list(layer)
        states = torch.cat([output.hidden_states[index] for index in layers], dim=-1)
        return self.multi_modal_projector(states.squeeze(0), size).float()


class Mistral3ImageEncoder(TowerImageEncoder[Mistral3VisionEncoder, PixtralPreprocessing]):
    """A loaded Mistral 3 model's images to their `[IMG]` tokens' rows
    (`vision_input.ImageEncoder`)."""

    tower_class = Mistral3VisionEncoder

    @classmethod
    def preprocessing_of(
        cls, model_dir: Path, config: Any, tokens: PixtralImageTokens
    ) -> PixtralPreprocessing:
        return PixtralPreprocessing.of_model(model_dir, tokens)

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[merged patches, text hidden]` float32 rows (each image
        through the tower at its own size).

        Raises:
            ValueError: an undecodable or too thin image.
        """
        pixels = [self.preprocessing.pixel_values(data) for data in images]
        return [self.encoder(image.to(self.device)) for image in pixels]
