"""A vision model's image input, family-neutral: the prompt's image tokens (`ImageTokens`,
shared with the API node's token counts) and a tower that turns a request's images into the
rows that replace their soft tokens (`ImageEncoder`), chosen by the checkpoint's config.

Families: Gemma 3 (`gemma3_vision.py`), Idefics3 / SmolVLM (`idefics3_vision.py`),
Mistral 3 with Pixtral's tower (`mistral3_vision.py`), Qwen2.5-VL (`qwen2_5_vl_vision.py`,
whose prompts also carry multimodal rotary positions: `multimodal_positions`) and Qwen3-VL
(`qwen3_vl_vision.py`: the same positions, and deepstack features beside each image row's
embedding). Adding
one: its `ImageTokens` subclass (a module of `exo.chat_protocol.image_tokens`), its tower
and encoder (`vision_parts.VisionTower`, `vision_parts.TowerImageEncoder`), and an entry in
`ENCODERS`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from exo.chat_protocol.image_tokens import (
    Gemma3ImageTokens,
    Idefics3ImageTokens,
    ImageTokens,
    PixtralImageTokens,
    Qwen3VLImageTokens,
    QwenVLImageTokens,
)
from exo.shared.types.text_generation import ImageInput
from exo.worker.engines.torch.batching.prompt_images import MultimodalPositions, PromptImage
from exo.worker.engines.torch.model.gemma3_vision import Gemma3ImageEncoder
from exo.worker.engines.torch.model.idefics3_vision import Idefics3ImageEncoder
from exo.worker.engines.torch.model.mistral3_vision import Mistral3ImageEncoder
from exo.worker.engines.torch.model.qwen2_5_vl_vision import QwenVLImageEncoder, prompt_positions
from exo.worker.engines.torch.model.qwen3_vl_vision import Qwen3VLImageEncoder
from exo.worker.engines.torch.model.vision_parts import TowerImageEncoder


class ImageEncoder(Protocol):
    """A family's vision tower and projector with its pixel preparation."""

    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's rows `[soft tokens of the image, text hidden]` float32, in
        the order its soft tokens come in the prompt (`ImageTokens.sequence`).

        Raises:
            ValueError: an undecodable image.
        """
        ...


ENCODERS: dict[type[ImageTokens], type[TowerImageEncoder[Any, Any]]] = {
    Gemma3ImageTokens: Gemma3ImageEncoder,
    Idefics3ImageTokens: Idefics3ImageEncoder,
    PixtralImageTokens: Mistral3ImageEncoder,
    QwenVLImageTokens: QwenVLImageEncoder,
    Qwen3VLImageTokens: Qwen3VLImageEncoder,
}
"""Each family's image encoder, by its `ImageTokens` class."""


class VisionInput:
    """A loaded vision model's image input, for the engine's prompt rendering and requests.

    Args:
        tokens: how images are written into the prompt.
        encoder: the tower.
    """

    def __init__(self, tokens: ImageTokens, encoder: ImageEncoder) -> None:
        self.tokens = tokens
        self.encoder = encoder

    @classmethod
    def of_model(
        cls, model_dir: Path, config: Any, tokenizer: Any, device: torch.device | None = None
    ) -> VisionInput | None:
        """The image input of the checkpoint in `model_dir` (`config`: its transformers
        config), its tower on `device` (default CPU); None for a model without one (a
        text-only config, or a vision family this engine has no tower for).

        Raises:
            ValueError: vision tensors missing from the checkpoint.
        """
        path = model_dir / "preprocessor_config.json"
        preprocessor = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        tokens = ImageTokens.of_config(config, tokenizer, preprocessor)
        encoder_class = None if tokens is None else ENCODERS.get(type(tokens))
        if tokens is None or encoder_class is None:
            return None
        device = device or torch.device("cpu")
        return cls(tokens, encoder_class.load(model_dir, config, tokens, device))

    def prompt_images(
        self, token_ids: Sequence[int], images: Sequence[ImageInput]
    ) -> tuple[PromptImage, ...]:
        """Run the tower once over the images of an expanded prompt (`render_prompt` with
        these `tokens`): one `PromptImage` per run of soft tokens, in prompt order.

        Raises:
            ValueError: an undecodable image; the prompt's image tokens are not those of
                `images` (their number or their sizes).
        """
        spans = self.tokens.spans(token_ids, [(image.width, image.height) for image in images])
        if not images:
            return ()
        rows = self.encoder.encode([image.data for image in images])
        prompt_images: list[PromptImage] = []
        bidirectional = self.tokens.bidirectional
        for image, image_spans, image_rows in zip(images, spans, rows, strict=True):
            if sum(length for _, length in image_spans) != image_rows.shape[0]:
                raise ValueError(
                    f"an image of {image.width}x{image.height} pixels gave "
                    f"{image_rows.shape[0]} rows for its "
                    f"{sum(length for _, length in image_spans)} image tokens"
                )
            offset = 0
            for start, length in image_spans:
                embeddings = image_rows[offset : offset + length]
                prompt_images.append(PromptImage(start, embeddings, image.sha256, bidirectional))
                offset += length
        return tuple(prompt_images)

    @property
    def multimodal_rotary(self) -> bool:
        """Whether the text model places image tokens by multimodal rotary positions
        (Qwen2.5-VL, Qwen3-VL): a prompt with images then needs `multimodal_positions`."""
        return isinstance(self.tokens, QwenVLImageTokens)

    def multimodal_positions(
        self, token_ids: Sequence[int], images: Sequence[ImageInput]
    ) -> MultimodalPositions | None:
        """The rotary positions of an expanded prompt with `images` where the family
        places image tokens by row and column (`multimodal_rotary`); None otherwise, or
        without images (text positions are then the token indices).

        Raises:
            ValueError: the prompt's image tokens are not those of `images`.
        """
        if not images or not isinstance(self.tokens, QwenVLImageTokens):
            return None
        sizes = [(image.width, image.height) for image in images]
        spans = self.tokens.spans(token_ids, sizes)
        return prompt_positions(self.tokens, len(token_ids), spans, sizes)
