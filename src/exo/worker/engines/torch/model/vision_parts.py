"""What every vision family's image input shares: decoding an image file to RGB pixels,
resizing and normalizing them by the checkpoint's `preprocessor_config.json`
(`PixelSettings`), a tower read from a multimodal checkpoint beside its text model
(`VisionTower`; float32: towers run once per image and are small next to the text model, so
they are not quantized), and the engine-facing encoder that holds a tower and its
preprocessing (`TowerImageEncoder`)."""

from __future__ import annotations

import io
import json
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Generic, Self, TypeVar, cast

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
    Each tensor is copied into the module's own as it is read (widened from the file's
    dtype in the copy) and dropped, so loading holds one checkpoint tensor beside the
    module, not a float32 copy of the whole tower (`memory.VISION_TOWER_LOADING_EXTRA_COPIES`).

    Raises:
        ValueError: a tensor of `module` missing from the checkpoint, or one whose shape
            differs from the module's (the message names one).
    """
    targets = module.state_dict()
    located: dict[str, tuple[Path, str]] = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open has no __iter__)
                local = name.removeprefix("model.")
                if local.startswith(prefixes) and local in targets:
                    located[local] = (path, name)
    missing = sorted(set(targets) - set(located))
    if missing:
        raise ValueError(f"{model_dir}: vision tensors missing, e.g. {missing[0]}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for local, (path, name) in located.items():
        by_file.setdefault(path, []).append((local, name))
    with torch.no_grad():
        for path, names in by_file.items():
            with safe_open(str(path), framework="pt") as handle:
                for local, name in names:
                    target = targets[local]
                    shape = tuple(handle.get_slice(name).get_shape())
                    if shape != tuple(target.shape):
                        raise ValueError(
                            f"{model_dir}: vision tensor {name} has shape {list(shape)}, "
                            f"the model expects {list(target.shape)}"
                        )
                    target.copy_(handle.get_tensor(name))


def preprocessor_settings(model_dir: Path) -> dict[str, Any]:
    """The checkpoint's parsed `preprocessor_config.json`; empty where there is none."""
    path = model_dir / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.exists() else {}


@dataclass(frozen=True, slots=True)
class PixelSettings:
    """How an image processor resamples and normalizes pixels (`preprocessor_config.json`).

    Attributes:
        mean / std: per RGB channel, applied after rescaling.
        rescale: factor from 0..255 to the normalized range's input (1/255).
        resample: Pillow's resampling filter number (1: Lanczos, 2: bilinear, 3: bicubic).
    """

    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    rescale: float = 1 / 255
    resample: int = 3

    def of_settings(self, settings: Mapping[str, Any]) -> PixelSettings:
        """These settings (a family's defaults) overridden by the ones `settings` (a parsed
        `preprocessor_config.json`) names."""
        return PixelSettings(
            mean=tuple(settings.get("image_mean", self.mean)),
            std=tuple(settings.get("image_std", self.std)),
            rescale=float(settings.get("rescale_factor", self.rescale)),
            resample=int(settings.get("resample", self.resample)),
        )

    def resized(self, image: Image.Image, size: tuple[int, int]) -> Image.Image:
        """`image` resized to `size` `(width, height)` with this resampling filter."""
        return image.resize(size, Image.Resampling(self.resample))

    def normalized(self, image: Image.Image) -> torch.Tensor:
        """An RGB image's pixels `[3, height, width]` float32, rescaled and normalized."""
        return normalized_pixels(image, self.rescale, self.mean, self.std)


CLIP_PIXELS = PixelSettings(
    mean=(0.48145466, 0.4578275, 0.40821073), std=(0.26862954, 0.26130258, 0.27577711)
)
"""CLIP's mean and std, bicubic: the Pixtral and Qwen-VL image processors' defaults."""


class VisionTower(nn.Module):
    """A family's vision tower (with its projector or merger) whose weights are the
    checkpoint's tensors under `checkpoint_prefixes` (a leading `model.` removed, as
    `load_vision_tensors` matches them)."""

    checkpoint_prefixes: ClassVar[tuple[str, ...]]

    @classmethod
    def from_config(cls, config: Any) -> Self:
        """Random-weight modules of `config`'s shapes (float32, eval mode)."""
        raise NotImplementedError

    @classmethod
    def load(cls, model_dir: Path, config: Any) -> Self:
        """The tower of the checkpoint in `model_dir`, float32 (published bfloat16 weights
        widened).

        Raises:
            ValueError: a tensor of the tower missing from the checkpoint.
        """
        from transformers.initialization import no_init_weights

        # Every tensor of the state dict comes from the checkpoint: the modules' random
        # initialization would only add time and the allocator's leftovers to the peak.
        with no_init_weights():
            tower = cls.from_config(config)
        load_vision_tensors(tower, model_dir, cls.checkpoint_prefixes)
        return tower


TowerT = TypeVar("TowerT", bound=VisionTower)
PreprocessingT = TypeVar("PreprocessingT")


class TowerImageEncoder(ABC, Generic[TowerT, PreprocessingT]):
    """A loaded model's images to their soft tokens' rows (`vision_input.ImageEncoder`):
    a tower and the preprocessing that feeds it. A family names its `tower_class` and
    builds its preprocessing in `preprocessing_of`.

    Args:
        encoder: the vision tower (weights loaded).
        preprocessing: the family's pixel preparation.
    """

    tower_class: ClassVar[type[VisionTower]]

    def __init__(self, encoder: TowerT, preprocessing: PreprocessingT) -> None:
        self.encoder = encoder
        self.preprocessing = preprocessing

    @classmethod
    def preprocessing_of(cls, model_dir: Path, config: Any, tokens: Any) -> PreprocessingT:
        """The family's preprocessing for the checkpoint in `model_dir` (`config`: its
        transformers config; `tokens`: its `ImageTokens`)."""
        raise NotImplementedError

    @classmethod
    def load(cls, model_dir: Path, config: Any, tokens: Any, device: torch.device) -> Self:
        """The tower of the checkpoint in `model_dir`, on `device`, with its preprocessing.

        Raises:
            ValueError: vision tensors missing from the checkpoint.
        """
        tower = cast(TowerT, cls.tower_class.load(model_dir, config).to(device))
        return cls(tower, cls.preprocessing_of(model_dir, config, tokens))

    @property
    def device(self) -> torch.device:
        """Where the tower's weights are (its input goes there)."""
        return next(self.encoder.parameters()).device

    @abstractmethod
    def encode(self, images: Sequence[bytes]) -> list[torch.Tensor]:
        """Each image file's rows `[soft tokens of the image, text hidden]` float32, in the
        order its soft tokens come in the prompt.

        Raises:
            ValueError: an undecodable image.
        """
