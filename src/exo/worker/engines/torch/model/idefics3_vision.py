"""Idefics3's image input (`Idefics3ForConditionalGeneration`: SmolVLM, Idefics3; and SmolVLM2's
`SmolVLMForConditionalGeneration`, the same design): tiling and pixels, and the vision tower
with its connector, loaded beside the Llama text model.

Facts taken from transformers' Idefics3 image processor and model (the code here is exo's
own; the token layout and the tiling arithmetic are `exo.chat_protocol.image_tokens`):
- pixels: RGB; resized (Lanczos by default) so the longest side is `size.longest_edge`,
  then again up to whole tiles of `max_image_size.longest_edge`; an image bigger than one
  tile is cut into `rows x cols` tiles, row by row, followed by the whole image resized to
  one tile (the global view); each view is rescaled by 1/255 and normalized (mean and std
  0.5 on the published checkpoints);
- the SigLIP-style tower (`Idefics3VisionTransformer`) turns each view into
  `(image_size / patch_size)^2` patch states; the connector's pixel shuffle folds each
  `scale_factor x scale_factor` block of patches into one row (`Idefics3Connector`) and a
  linear layer projects it to the text hidden size; those rows replace the `<image>`
  tokens' embeddings in order (tiles, then the global view), unscaled (Llama's embeddings
  are not scaled either).

The tower and connector are transformers' modules filled from the checkpoint's
`model.vision_model.` and `model.connector.` tensors; they run once per request, on the
first rank, before the prompt's prefill, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from exo.chat_protocol.image_tokens import Idefics3Tiling
from exo.worker.engines.torch.model.vision_parts import (
    PixelSettings,
    TowerImageEncoder,
    VisionTower,
    decode_rgb,
    preprocessor_settings,
)

DEFAULT_PIXELS = PixelSettings(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5), resample=1)
"""Idefics3ImageProcessor's defaults where `preprocessor_config.json` names none (Lanczos)."""


@dataclass(frozen=True, slots=True)
class Idefics3Preprocessing:
    """How an image's file bytes become the tower's views (`preprocessor_config.json`).

    Attributes:
        tiling: resizing and cutting (shared with the prompt's token layout).
        pixels: resampling filter and normalization.
    """

    tiling: Idefics3Tiling
    pixels: PixelSettings = DEFAULT_PIXELS

    @classmethod
    def of_model(cls, model_dir: Path, image_size: int) -> Idefics3Preprocessing:
        """The checkpoint's preprocessing; the tower's `image_size` as the tile where its
        `preprocessor_config.json` is absent or names none."""
        settings = preprocessor_settings(model_dir)
        return cls(
            tiling=Idefics3Tiling.of_preprocessor(settings, image_size),
            pixels=DEFAULT_PIXELS.of_settings(settings),
        )

    def views(self, data: bytes) -> torch.Tensor:
        """One image file's views `[rows * cols + 1 or 1, 3, tile, tile]` float32: its
        tiles row by row, then the global view (a single view when it fits one tile).

        Raises:
            ValueError: bytes Pillow cannot decode.
        """
        image = decode_rgb(data)
        tiling, pixels = self.tiling, self.pixels
        tile = tiling.tile
        if tiling.longest_edge is not None:
            image = pixels.resized(image, tiling.resized(image.size))
        if not tiling.split:
            views = [pixels.resized(image, (tile, tile))]
        else:
            image = pixels.resized(image, tiling.tiled(image.size))
            width, height = image.size
            if width <= tile and height <= tile:
                views = [image]
            else:
                views = [
                    image.crop((left, top, left + tile, top + tile))
                    for top in range(0, height, tile)
                    for left in range(0, width, tile)
                ]
                views.append(pixels.resized(image, (tile, tile)))
        return torch.stack([pixels.normalized(view) for view in views])


class Idefics3VisionEncoder(VisionTower):
    """The vision tower and the connector: views to the rows that replace `<image>` tokens.

    Args:
        config: the checkpoint's `Idefics3Config`.
        vision_model / connector: transformers' modules (weights loaded or random).
    """

    checkpoint_prefixes = ("vision_model.", "connector.")

    def __init__(self, config: Any, vision_model: torch.nn.Module, connector: torch.nn.Module):
        super().__init__()
        self.config = config
        self.vision_model = vision_model
        self.connector = connector

    @classmethod
    def from_config(cls, config: Any) -> Idefics3VisionEncoder:
        """Random-weight modules of `config`'s shapes (float32, eval mode): Idefics3's, or
        SmolVLM2's (`model_type` "smolvlm": the same tower and connector under its names)."""
        from transformers.models.idefics3 import modeling_idefics3
        from transformers.models.smolvlm import modeling_smolvlm

        if config.model_type == "smolvlm":
            tower: torch.nn.Module = modeling_smolvlm.SmolVLMVisionTransformer(config.vision_config)
            connector: torch.nn.Module = modeling_smolvlm.SmolVLMConnector(config)
        else:
            tower = modeling_idefics3.Idefics3VisionTransformer(config.vision_config)
            connector = modeling_idefics3.Idefics3Connector(config)
        return cls(config, tower, connector).float().eval()

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`pixel_values` `[n, 3, tile, tile]` → `[n, image_seq_len, text hidden]` float32
        (every patch of every view is real: views are never padded here)."""
        count, _, height, width = pixel_values.shape
        patch = int(self.config.vision_config.patch_size)
        patches = torch.ones(
            count, height // patch, width // patch, dtype=torch.bool, device=pixel_values.device
        )
        states = self.vision_model(
            pixel_values=pixel_values.float(), patch_attention_mask=patches
        ).last_hidden_state
        return self.connector(states).float()


class Idefics3ImageEncoder(TowerImageEncoder[Idefics3VisionEncoder, Idefics3Preprocessing]):
    """A loaded Idefics3 model's images to their `<image>` tokens' rows
    (`vision_input.ImageEncoder`)."""

    tower_class = Idefics3VisionEncoder

    @classmethod
    def preprocessing_of(cls, model_dir: Path, config: Any, tokens: Any) -> Idefics3Preprocessing:
        return Idefics3Preprocessing.of_model(model_dir, int(config.vision_config.image_size))

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[views * image_seq_len, text hidden]` float32 rows, its
        tiles' first and the global view's last (every view of every image in one batch
        through the tower).

        Raises:
            ValueError: an undecodable image.
        """
        if not images:
            return []
        views = [self.preprocessing.views(data) for data in images]
        rows = self.encoder(torch.cat(views).to(self.device))  # [views, image_seq_len, hidden]
        counts = [len(image_views) for image_views in views]
        return [part.reshape(-1, part.shape[-1]) for part in rows.split(counts)]
