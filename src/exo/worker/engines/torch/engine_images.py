"""What the engine does with images: whether this rank of a shard runs a vision tower (a
vision card's checkpoint with its tower's weights here, on a single rank or on the rank of a
split instance whose parallelism carries images: `runs_vision_tower`), why it refuses
images otherwise, and the image tokens its prompts keep (a vision checkpoint's, tower or
not: the image token texts a client types stay text, as the API node counts them); then a
request's images through the tower, before its prompt's prefill.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from loguru import logger

from exo.chat_protocol.image_tokens import ImageTokens
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ImageInput, TextGenerationTaskParams
from exo.worker.engines.torch.batching.prompt_images import MultimodalPositions, PromptImage
from exo.worker.engines.torch.model.loading import model_config
from exo.worker.engines.torch.model.vision_input import VisionInput
from exo.worker.engines.torch.parallel import engine_transform

NO_VISION_TOWER = (
    "it has no vision tower: a model without vision, or a split that carries no images"
)
"""Why an engine without a tower refuses images, unless its tower's weights are missing."""


@dataclass(frozen=True, slots=True)
class ShardImages:
    """What one rank of a shard does with images (`load_shard_images`): its tower (None:
    it refuses images, saying `refusal`) and its image tokens (None for a text model)."""

    vision: VisionInput | None
    refusal: str
    tokens: ImageTokens | None


def load_shard_images(
    model_dir: Path, shard: ShardMetadata, tokenizer: Any, device: torch.device
) -> ShardImages:
    """Load this rank's vision tower where it runs one, and the checkpoint's image tokens.

    Without the tower's tensors (weight files holding only the tower are not downloaded for
    a text shard) the model still serves text, and refuses images saying why; an odd vision
    config leaves the image tokens unknown (both logged as warnings).
    """
    vision: VisionInput | None = None
    refusal = NO_VISION_TOWER
    # A split instance's tower: on rank 0 only, where its parallelism carries the
    # images' blocks and rows to the other ranks (`runs_vision_tower`).
    towered = engine_transform(shard.sharding).runs_vision_tower(shard)
    if "vision" in shard.model_card.capabilities and towered:
        # The checkpoint's tower, by its config (None for text-only ones).
        try:
            vision = VisionInput.of_model(model_dir, model_config(model_dir), tokenizer, device)
        except ValueError as error:
            refusal = "the weights of its vision tower are not on this node"
            logger.warning("{}: images refused: {}", shard.model_card.model_id, error)
    tokens = vision.tokens if vision is not None else None
    if tokens is None:
        try:
            tokens = ImageTokens.of_model(model_dir, tokenizer)
        except (KeyError, TypeError, ValueError) as error:  # an odd vision config
            logger.warning("{}: image tokens unknown: {}", shard.model_card.model_id, error)
    return ShardImages(vision, refusal, tokens)


def request_images(params: TextGenerationTaskParams) -> list[ImageInput]:
    """The request's images in prompt order (each message's, message by message)."""
    return [image for message in params.messages for image in message.images]


def prompt_images(
    vision: VisionInput | None, model_id: str, prompt_ids: list[int], images: list[ImageInput]
) -> tuple[tuple[PromptImage, ...], MultimodalPositions | None]:
    """The request's images through the vision tower, once per image, before the prompt's
    prefill: each run of image tokens' features (`VisionInput.prompt_images`) and the
    prompt's multimodal rotary positions where the model has them; none without images.

    Raises:
        ValueError: images for an engine without a vision tower (`vision` None).
    """
    if not images:
        return (), None
    if vision is None:
        raise ValueError(f"{model_id} takes no images on this instance")
    return (
        vision.prompt_images(prompt_ids, images),
        vision.multimodal_positions(prompt_ids, images),
    )
