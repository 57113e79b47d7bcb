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

from typing import Any

import torch

from exo.worker.engines.torch.model.qwen2_5_vl_vision import (
    QwenVLImageEncoder,
    QwenVLVisionEncoder,
)


class Qwen3VLVisionEncoder(QwenVLVisionEncoder):
    """The Qwen3-VL vision tower with its mergers: patch rows to the rows that replace an
    image's `<|image_pad|>` tokens, with their deepstack features (Qwen2.5-VL's wrapper,
    checkpoint names and inputs; another tower and output).

    Args:
        visual: transformers' `Qwen3VLVisionModel` (weights loaded or random).
    """

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


class Qwen3VLImageEncoder(QwenVLImageEncoder):
    """A loaded Qwen3-VL model's images to their `<|image_pad|>` tokens' rows with their
    deepstack features, `[merged patches, text hidden x (1 + deepstack layers)]` each
    (`vision_input.ImageEncoder`; Qwen2.5-VL's preprocessing and loop over images)."""

    tower_class = Qwen3VLVisionEncoder
