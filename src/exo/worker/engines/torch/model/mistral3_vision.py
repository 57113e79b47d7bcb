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

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from exo.chat_protocol.image_tokens import PixtralImageTokens
from exo.worker.engines.torch.model.vision_parts import (
    decode_rgb,
    load_vision_tensors,
    normalized_pixels,
)

# PixtralImageProcessor's defaults where `preprocessor_config.json` names none (CLIP's).
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_RESCALE = 1 / 255
DEFAULT_RESAMPLE = 3  # Pillow's bicubic
_PREFIXES = ("vision_tower.", "multi_modal_projector.")


@dataclass(frozen=True, slots=True)
class PixtralPreprocessing:
    """How an image's file bytes become the tower's pixels (`preprocessor_config.json`).

    Attributes:
        tokens: the image token layout (its grid sizes the image).
        mean / std: per RGB channel, applied after rescaling.
        rescale: factor from 0..255 to the normalized range's input (1/255).
        resample: Pillow's resampling filter number (3: bicubic).
    """

    tokens: PixtralImageTokens
    mean: tuple[float, float, float] = DEFAULT_MEAN
    std: tuple[float, float, float] = DEFAULT_STD
    rescale: float = DEFAULT_RESCALE
    resample: int = DEFAULT_RESAMPLE

    @classmethod
    def of_model(cls, model_dir: Path, tokens: PixtralImageTokens) -> PixtralPreprocessing:
        """The checkpoint's preprocessing (defaults where `preprocessor_config.json` is
        absent or names none)."""
        path = model_dir / "preprocessor_config.json"
        settings: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        return cls(
            tokens=tokens,
            mean=tuple(settings.get("image_mean", DEFAULT_MEAN)),
            std=tuple(settings.get("image_std", DEFAULT_STD)),
            rescale=float(settings.get("rescale_factor", DEFAULT_RESCALE)),
            resample=int(settings.get("resample", DEFAULT_RESAMPLE)),
        )

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
        image = image.resize((cols * side, rows * side), Image.Resampling(self.resample))
        return normalized_pixels(image, self.rescale, self.mean, self.std)


class Mistral3VisionEncoder(nn.Module):
    """The Pixtral tower and the multimodal projector: pixels to the rows that replace an
    image's `[IMG]` tokens.

    Args:
        config: the checkpoint's `Mistral3Config`.
        vision_tower / projector: transformers' modules (weights loaded or random).
    """

    def __init__(self, config: Any, vision_tower: nn.Module, projector: nn.Module) -> None:
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

    @classmethod
    def load(cls, model_dir: Path, config: Any) -> Mistral3VisionEncoder:
        """The tower and projector of the checkpoint in `model_dir`, float32 (the
        published bfloat16 weights widened).

        Raises:
            ValueError: a tensor of the tower or projector missing from the checkpoint.
        """
        encoder = cls.from_config(config)
        load_vision_tensors(encoder, model_dir, _PREFIXES)
        return encoder

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


class Mistral3ImageEncoder:
    """A loaded Mistral 3 model's images to their `[IMG]` tokens' rows
    (`vision_input.ImageEncoder`).

    Args:
        encoder: the vision tower and projector.
        preprocessing: pixel preparation.
    """

    def __init__(self, encoder: Mistral3VisionEncoder, preprocessing: PixtralPreprocessing):
        self.encoder = encoder
        self.preprocessing = preprocessing

    @classmethod
    def load(
        cls, model_dir: Path, config: Any, tokens: PixtralImageTokens, device: torch.device
    ) -> Mistral3ImageEncoder:
        """The tower of a `Mistral3ForConditionalGeneration` checkpoint, on `device`.

        Raises:
            ValueError: vision tensors missing from the checkpoint.
        """
        preprocessing = PixtralPreprocessing.of_model(model_dir, tokens)
        return cls(Mistral3VisionEncoder.load(model_dir, config).to(device), preprocessing)

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[merged patches, text hidden]` float32 rows (each image
        through the tower at its own size).

        Raises:
            ValueError: an undecodable or too thin image.
        """
        pixels = [self.preprocessing.pixel_values(data) for data in images]
        device = next(self.encoder.parameters()).device
        return [self.encoder(image.to(device)) for image in pixels]
