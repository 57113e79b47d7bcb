"""Converting a dialect's request that may hold images: the model's reader, the conversion
moved off the event loop when it meets an image, and the check that a converted
conversation's image markers match its images.

An adapter is a pure function `(body, ImageReader) -> TextGenerationTaskParams`. The first
try runs on the event loop with a reader that defers (`ImagesDeferred`) at the first image,
so a text-only request costs no thread hop; a request with images is converted again in a
worker thread, where the reader fetches and decodes (`exo.api.wire.images`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.model_lookup import card_of
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import ImageReader, ImagesDeferred
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import IMAGE_MARKER, TextGenerationTaskParams

Body = TypeVar("Body")


def image_reader_for(cluster: ClusterClient, model_id: str, *, defer: bool) -> ImageReader:
    """The reader for a request to `model_id`: reads images only when its card has the
    "vision" capability, under the node's `ImagePolicy` (`ClusterClient.image_policy`)."""
    card = card_of(cluster, ModelId(model_id))
    vision = card is not None and "vision" in card.capabilities
    return ImageReader(cluster.image_policy, vision=vision, defer=defer)


async def convert_with_images(
    cluster: ClusterClient,
    body: Body,
    model_id: str,
    to_task_params: Callable[[Body, ImageReader], TextGenerationTaskParams],
) -> TextGenerationTaskParams:
    """`to_task_params(body, reader)` for the model's reader: on the event loop while the
    body holds no image, in a worker thread once it does (see the module docstring).

    Raises:
        InvalidRequestError: the adapter refused the body (an image among them), or a
            turn's text holds `IMAGE_MARKER` itself (`check_image_markers`).
    """
    reader = image_reader_for(cluster, model_id, defer=True)
    try:
        params = to_task_params(body, reader)
    except ImagesDeferred:
        reading = reader.reading()
        params = await anyio.to_thread.run_sync(lambda: to_task_params(body, reading))
    check_image_markers(params)
    return params


def check_image_markers(params: TextGenerationTaskParams) -> None:
    """Refuse a turn whose text holds `IMAGE_MARKER` where no image is: the runner would
    take the client's text for an image's place.

    Raises:
        InvalidRequestError: naming the marker, blaming `messages` (or `prompt`).
    """
    if params.prompt is not None and IMAGE_MARKER in params.prompt:
        raise InvalidRequestError(
            f"the prompt holds {IMAGE_MARKER!r}, which exo reserves for an image's place",
            "prompt",
        )
    for message in params.messages:
        if message.content.count(IMAGE_MARKER) != len(message.images):
            raise InvalidRequestError(
                f"the text of a {message.role} turn holds {IMAGE_MARKER!r}, which exo "
                "reserves for an image's place",
                "messages",
            )
