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

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from exo.chat_protocol.image_tokens import QwenVLImageTokens
from exo.worker.engines.torch.batching.prompt_images import MultimodalPositions
from exo.worker.engines.torch.model.vision_parts import (
    decode_rgb,
    load_vision_tensors,
    normalized_pixels,
)

# Qwen2VLImageProcessor's defaults where `preprocessor_config.json` names none (CLIP's).
DEFAULT_MEAN = (0.48145466, 0.4578275, 0.40821073)
DEFAULT_STD = (0.26862954, 0.26130258, 0.27577711)
DEFAULT_RESCALE = 1 / 255
DEFAULT_RESAMPLE = 3  # Pillow's bicubic
DEFAULT_TEMPORAL_PATCH = 2
_PREFIXES = ("visual.",)


@dataclass(frozen=True, slots=True)
class QwenVLPreprocessing:
    """How an image's file bytes become the tower's patch rows (`preprocessor_config.json`).

    Attributes:
        tokens: the image token layout (its resize sizes the image).
        mean / std: per RGB channel, applied after rescaling.
        rescale: factor from 0..255 to the normalized range's input (1/255).
        resample: Pillow's resampling filter number (3: bicubic).
        temporal_patch: frames per patch (`temporal_patch_size`; a still image repeated).
    """

    tokens: QwenVLImageTokens
    mean: tuple[float, float, float] = DEFAULT_MEAN
    std: tuple[float, float, float] = DEFAULT_STD
    rescale: float = DEFAULT_RESCALE
    resample: int = DEFAULT_RESAMPLE
    temporal_patch: int = DEFAULT_TEMPORAL_PATCH

    @classmethod
    def of_model(
        cls, model_dir: Path, config: Any, tokens: QwenVLImageTokens
    ) -> QwenVLPreprocessing:
        """The checkpoint's preprocessing (defaults where `preprocessor_config.json` is
        absent or names none)."""
        path = model_dir / "preprocessor_config.json"
        settings: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
        temporal = getattr(config.vision_config, "temporal_patch_size", DEFAULT_TEMPORAL_PATCH)
        return cls(
            tokens=tokens,
            mean=tuple(settings.get("image_mean", DEFAULT_MEAN)),
            std=tuple(settings.get("image_std", DEFAULT_STD)),
            rescale=float(settings.get("rescale_factor", DEFAULT_RESCALE)),
            resample=int(settings.get("resample", DEFAULT_RESAMPLE)),
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
        image = image.resize((width, height), Image.Resampling(self.resample))
        pixels = normalized_pixels(image, self.rescale, self.mean, self.std)
        side, merge, frames = self.tokens.patch, self.tokens.merge, self.temporal_patch
        rows, cols = height // side, width // side
        grid = pixels.view(3, rows // merge, merge, side, cols // merge, merge, side)
        # -> [merged row, merged col, row in merge, col in merge, channel, y, x]
        grid = grid.permute(1, 4, 2, 5, 0, 3, 6)
        grid = grid[:, :, :, :, :, None].expand(*grid.shape[:5], frames, side, side)
        return grid.reshape(rows * cols, 3 * frames * side * side), (1, rows, cols)


class QwenVLVisionEncoder(nn.Module):
    """The Qwen2.5-VL vision tower with its merger: patch rows to the rows that replace an
    image's `<|image_pad|>` tokens.

    Args:
        visual: transformers' `Qwen2_5_VisionTransformerPretrainedModel` (weights loaded
            or random).
    """

    def __init__(self, visual: nn.Module) -> None:
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

    @classmethod
    def load(cls, model_dir: Path, config: Any) -> QwenVLVisionEncoder:
        """The tower of the checkpoint in `model_dir`, float32 (the published bfloat16
        weights widened).

        Raises:
            ValueError: a tensor of the tower missing from the checkpoint.
        """
        encoder = cls.from_config(config)
        load_vision_tensors(encoder, model_dir, _PREFIXES)
        return encoder

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's `patches` (`QwenVLPreprocessing.patches`) and grid →
        `[merged patches, text hidden]` float32, row by row."""
        grid_thw = torch.tensor([grid], dtype=torch.long, device=patches.device)
        output = self.visual(patches.float(), grid_thw=grid_thw)
        return output.pooler_output.float()


class QwenVLImageEncoder:
    """A loaded Qwen2.5-VL model's images to their `<|image_pad|>` tokens' rows
    (`vision_input.ImageEncoder`).

    Args:
        encoder: the vision tower and merger.
        preprocessing: pixel preparation.
    """

    def __init__(self, encoder: QwenVLVisionEncoder, preprocessing: QwenVLPreprocessing):
        self.encoder = encoder
        self.preprocessing = preprocessing

    @classmethod
    def load(
        cls, model_dir: Path, config: Any, tokens: QwenVLImageTokens, device: torch.device
    ) -> QwenVLImageEncoder:
        """The tower of a `Qwen2_5_VLForConditionalGeneration` checkpoint, on `device`.

        Raises:
            ValueError: vision tensors missing from the checkpoint.
        """
        preprocessing = QwenVLPreprocessing.of_model(model_dir, config, tokens)
        return cls(QwenVLVisionEncoder.load(model_dir, config).to(device), preprocessing)

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[merged patches, text hidden]` float32 rows (each image
        through the tower at its own size).

        Raises:
            ValueError: an undecodable image, or one too long for its width.
        """
        device = next(self.encoder.parameters()).device
        rows = []
        for data in images:
            patches, grid = self.preprocessing.patches(data)
            rows.append(self.encoder(patches.to(device), grid))
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
