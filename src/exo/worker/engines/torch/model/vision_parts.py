"""What every vision family's image input shares: decoding an image file to RGB pixels,
normalizing them, and reading the tower's weights from a multimodal checkpoint beside its
text model (float32: towers run once per image and are small next to the text model, so
they are not quantized)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from safetensors import safe_open
from torch import nn


def decode_rgb(data: bytes) -> Image.Image:
    """One image file (PNG, JPEG, WebP, GIF: its first frame, BMP) as an RGB Pillow image;
    a transparent one is laid over white first, as transformers' image processors do
    (`convert_to_rgb`), so its transparent pixels are white rather than their hidden color.

    Raises:
        ValueError: bytes Pillow cannot decode.
    """
    try:
        with Image.open(io.BytesIO(data)) as opened:
            if "A" not in opened.getbands() and opened.info.get("transparency") is None:
                return opened.convert("RGB")
            image = opened.convert("RGBA")
    except (OSError, Image.DecompressionBombError) as error:
        raise ValueError(f"undecodable image: {error}") from error
    white = Image.new("RGBA", image.size, (255, 255, 255, 255))
    return Image.alpha_composite(white, image).convert("RGB")


def normalized_pixels(
    image: Image.Image, rescale: float, mean: Sequence[float], std: Sequence[float]
) -> torch.Tensor:
    """An RGB image's pixels `[3, height, width]` float32: `(value * rescale - mean) / std`
    per channel."""
    width, height = image.size
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    values = pixels.view(height, width, 3).permute(2, 0, 1).float()
    return (values * rescale - torch.tensor(mean).view(3, 1, 1)) / torch.tensor(std).view(3, 1, 1)


def load_vision_tensors(module: nn.Module, model_dir: Path, prefixes: tuple[str, ...]) -> None:
    """Fill every tensor of `module`'s state dict from the checkpoint's `*.safetensors`.

    Checkpoint names are matched with a leading `model.` removed (Gemma 3's published
    `vision_tower.…` and recent transformers' `model.vision_tower.…`; Idefics3's
    `model.vision_model.…`), and only those starting with one of `prefixes` are read.

    Raises:
        ValueError: a tensor of `module` missing from the checkpoint (the message names
            one).
    """
    expected = set(module.state_dict())
    found: dict[str, torch.Tensor] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                local = name.removeprefix("model.")
                if local.startswith(prefixes) and local in expected:
                    found[local] = handle.get_tensor(name).float()
    missing = sorted(expected - set(found))
    if missing:
        raise ValueError(f"{model_dir}: vision tensors missing, e.g. {missing[0]}")
    module.load_state_dict(found)
