"""Qwen3-VL's image input (`Qwen3VLForConditionalGeneration`): the vision tower with its
patch merger and its deepstack mergers.

Facts taken from transformers' Qwen3-VL model (the code here is exo's own):
- pixels and patches as Qwen2.5-VL's (`qwen2_5_vl_vision.QwenVLPreprocessing`: transformers
  gives Qwen3-VL the same `Qwen2VLImageProcessor`), with 16-pixel patches;
- the tower (`Qwen3VLVisionModel`: full attention over each image, 2-D rotary positions,
  learned position embeddings interpolated to the image's grid) returns one row per merged
  patch through its merger, in the text model's width, and, for each of its
  `deepstack_visual_indexes` blocks, the same rows through that block's own merger: the
  deepstack features;
- the text model (Qwen3's decoder with interleaved multimodal rotary positions) takes the
  merger's rows in place of the `<|image_pad|>` tokens' embeddings, and adds the k-th
  deepstack feature to those tokens' hidden states after its decoder layer k
  (`Qwen3VLTextModel._deepstack_process`);
- positions: Qwen2.5-VL's for still images (`batching.prompt_images.MultimodalPositions`),
  the rotary frequencies interleaved over the three position rows
  (`direct_forward_parts.multimodal_rotary_tables`).

An image's rows here are therefore `[merged patches, text hidden x (1 + deepstack layers)]`:
the embeddings, then each deepstack layer's addition (`PromptImage.embeddings`, which the
direct forward splits). The tower is transformers' module filled from the checkpoint's
`model.visual.` tensors; it runs once per request, on the first rank, before the prompt's
prefill, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from exo.chat_protocol.image_tokens import Qwen3VLImageTokens
from exo.worker.engines.torch.model.qwen2_5_vl_vision import QwenVLPreprocessing
from exo.worker.engines.torch.model.vision_parts import TowerImageEncoder, VisionTower


class Qwen3VLVisionEncoder(VisionTower):
    """The Qwen3-VL vision tower with its mergers: patch rows to the rows that replace an
    image's `<|image_pad|>` tokens, with their deepstack features.

    Args:
        visual: transformers' `Qwen3VLVisionModel` (weights loaded or random).
    """

    checkpoint_prefixes = ("visual.",)

    def __init__(self, visual: torch.nn.Module) -> None:
        super().__init__()
        self.visual = visual

    @classmethod
    def from_config(cls, config: Any) -> Qwen3VLVisionEncoder:
        """Random-weight modules of `config`'s shapes (float32, eval mode)."""
        from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

        return cls(Qwen3VLVisionModel._from_config(config.vision_config)).float().eval()

    @torch.inference_mode()
    def forward(self, patches: torch.Tensor, grid: tuple[int, int, int]) -> torch.Tensor:
        """One image's `patches` (`QwenVLPreprocessing.patches`) and grid →
        `[merged patches, text hidden x (1 + deepstack layers)]` float32, row by row: the
        merger's rows, then each deepstack merger's, side by side."""
        grid_thw = torch.tensor([grid], dtype=torch.long, device=patches.device)
        output = self.visual(patches.float(), grid_thw=grid_thw)
        return torch.cat([output.pooler_output, *output.deepstack_features], dim=-1).float()


class Qwen3VLImageEncoder(TowerImageEncoder[Qwen3VLVisionEncoder, QwenVLPreprocessing]):
    """A loaded Qwen3-VL model's images to their `<|image_pad|>` tokens' rows with their
    deepstack features (`vision_input.ImageEncoder`)."""

    tower_class = Qwen3VLVisionEncoder

    @classmethod
    def preprocessing_of(
        cls, model_dir: Path, config: Any, tokens: Qwen3VLImageTokens
    ) -> QwenVLPreprocessing:
        return QwenVLPreprocessing.of_model(model_dir, config, tokens)

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's `[merged patches, text hidden x (1 + deepstack layers)]` float32
        rows (each image through the tower at its own size).

        Raises:
            ValueError: an undecodable image, or one too long for its width.
        """
        rows = []
        for data in images:
            patches, grid = self.preprocessing.patches(data)
            rows.append(self.encoder(patches.to(self.device), grid))
        return rows
