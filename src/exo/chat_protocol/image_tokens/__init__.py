"""A vision model's image tokens in a rendered prompt: each `IMAGE_MARKER` of a message
becomes the chat template's image part and then the model's whole image sequence, so the
API node's token counts and the runner's prompt agree (both render through `render_prompt`
with the model's `ImageTokens`, and an image's sequence depends only on its width and
height, which `ImageInput` carries).

`base.py` holds what every family shares (the placeholder's expansion, finding each image's
soft-token runs again, the choice of family by `config.json`'s `model_type`); one module
per family holds its layout, with the facts it follows:
`gemma3.py` (Gemma 3), `idefics3.py` (Idefics3 / SmolVLM, tiled), `pixtral.py` (Mistral 3,
Pixtral's rows of merged patches), `qwen_vl.py` (Qwen2.5-VL and Qwen3-VL, merged patches
after a smart resize). Importing this package registers every family.

The markers around the image tokens are tokenized as transformers tokenizes the processor's
text: each piece on its own (special tokens split the text there anyway).
"""

from exo.chat_protocol.image_tokens.base import ImageSize, ImageTokens, OneTokenImages, TokenSpan
from exo.chat_protocol.image_tokens.gemma3 import Gemma3ImageTokens
from exo.chat_protocol.image_tokens.idefics3 import (
    MAX_IMAGE_SIDE,
    MAX_TILE_GRID,
    Idefics3ImageTokens,
    Idefics3Tiling,
)
from exo.chat_protocol.image_tokens.pixtral import PixtralImageTokens
from exo.chat_protocol.image_tokens.qwen_vl import (
    QWEN_VL_MAX_ASPECT,
    Qwen3VLImageTokens,
    QwenVLImageTokens,
)

__all__ = [
    "MAX_IMAGE_SIDE",
    "MAX_TILE_GRID",
    "QWEN_VL_MAX_ASPECT",
    "Gemma3ImageTokens",
    "Idefics3ImageTokens",
    "Idefics3Tiling",
    "ImageSize",
    "ImageTokens",
    "OneTokenImages",
    "PixtralImageTokens",
    "Qwen3VLImageTokens",
    "QwenVLImageTokens",
    "TokenSpan",
]
