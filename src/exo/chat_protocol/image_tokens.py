"""A vision model's image tokens in a rendered prompt: each `IMAGE_MARKER` of a message
becomes the chat template's image part and then the model's whole image sequence, so the
API node's token counts and the runner's prompt agree (both render through `render_prompt`
with the model's `ImageTokens`, and an image's sequence depends only on its width and
height, which `ImageInput` carries).

One subclass per vision family, chosen by the checkpoint's `config.json` (`model_type`):

- Gemma 3 (`Gemma3ForConditionalGeneration`; facts from transformers' `Gemma3Processor` and
  the published chat template): the template writes `<start_of_image>` for an image part,
  and the processor writes "\\n\\n" + `<start_of_image>` + the image soft token x
  `mm_tokens_per_image` + `<end_of_image>` + "\\n\\n" in its place, whatever the image's size.
  The image's soft tokens attend to each other in both directions.
- Idefics3 / SmolVLM (`Idefics3ForConditionalGeneration`, and SmolVLM2's
  `SmolVLMForConditionalGeneration`, whose processor lays images out the same way; facts
  from transformers' `Idefics3Processor` and `Idefics3ImageProcessor`): the template writes
  `<image>`; the image
  is resized so its longest edge is `size.longest_edge`, then up to multiples of the tile
  size (`max_image_size.longest_edge`) and cut into `rows x cols` tiles plus a global view of
  the whole image at tile size (one view and no tiles when it is a single tile). Each tile
  is written `<fake_token_around_image><row_R_col_C>` + `<image>` x `image_seq_len`, a "\\n"
  after each row of tiles, then "\\n<fake_token_around_image><global-img>" + `<image>` x
  `image_seq_len` + `<fake_token_around_image>`; a single view is that last part without the
  leading "\\n". `image_seq_len` is `(image_size / patch_size)^2 / scale_factor^2`. Attention
  stays causal over the image tokens (the text model is a plain Llama).
- Mistral 3 (`Mistral3ForConditionalGeneration`, Pixtral's tower; facts from transformers'
  `PixtralProcessor` and `PixtralImageProcessor`): the template writes `[IMG]`; an image
  bigger than `size.longest_edge` on either side is scaled down to fit (sides rounded
  down), then each side is rounded up to whole merged patches (`patch_size x
  spatial_merge_size` pixels); each row of merged patches is written as `[IMG]` per merged
  patch + `[IMG_BREAK]`, the last row's `[IMG_BREAK]` being `[IMG_END]`. Causal attention.
- Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`; facts from transformers'
  `Qwen2VLImageProcessor` `smart_resize` and `Qwen2VLProcessor`): the template writes
  `<|vision_start|><|image_pad|><|vision_end|>`; the image is resized so each side is a
  multiple of `patch_size x merge_size` pixels (each side rounded to the nearest multiple,
  then the whole scaled down when the area passes `max_pixels`, or up when it is under
  `min_pixels`), and `<|image_pad|>` becomes one `<|image_pad|>` per merged patch.
  Causal attention; the text model places the image's tokens by row and column
  (multimodal rotary positions: `exo.worker.engines.torch.model.qwen2_5_vl_vision`).

The markers around the image tokens are tokenized as transformers tokenizes the processor's
text: each piece on its own (special tokens split the text there anyway).
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from exo.shared.types.text_generation import IMAGE_MARKER, ChatMessage

ImageSize = tuple[int, int]
"""An image's `(width, height)` in pixels, as decoded (`ImageInput.width` / `.height`)."""

TokenSpan = tuple[int, int]
"""`(start, length)`: a run of consecutive image soft tokens in a prompt."""


class ImageTokens(ABC):
    """How one vision family writes an image into the prompt's token ids.

    A subclass names the token the chat template's image part becomes (`placeholder`), the
    soft token whose embeddings the vision tower's rows replace (`soft`), and an image's
    whole sequence for its size (`sequence`); `bidirectional` says whether one image's soft
    tokens attend to each other in both directions (Gemma 3) or causally (Idefics3).
    """

    bidirectional: ClassVar[bool]

    @property
    @abstractmethod
    def placeholder(self) -> int:
        """The id the chat template's image part tokenizes to."""

    @property
    @abstractmethod
    def placeholder_text(self) -> str:
        """The image part's text, written where a message's `IMAGE_MARKER` was."""

    @property
    @abstractmethod
    def soft(self) -> int:
        """The id whose positions take the vision tower's rows."""

    @abstractmethod
    def sequence(self, size: ImageSize) -> list[int]:
        """The token ids that replace the placeholder for an image of `size`."""

    @classmethod
    def of_model(cls, directory: Path, tokenizer: Any) -> ImageTokens | None:
        """The image tokens of the vision checkpoint whose `config.json` (and, for families
        that tile images, `preprocessor_config.json`) are in `directory`; None for a model
        without image input or where `config.json` is absent or unreadable."""
        try:
            config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        try:
            path = directory / "preprocessor_config.json"
            preprocessor = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
        except (OSError, ValueError):
            preprocessor = {}
        return cls.of_config(config, tokenizer, preprocessor)

    @classmethod
    def of_config(
        cls, config: Any, tokenizer: Any, preprocessor: Mapping[str, Any] | None = None
    ) -> ImageTokens | None:
        """As `of_model`, from the parsed `config.json` (a dict) or a transformers config,
        and the parsed `preprocessor_config.json` (None or empty: the family's defaults)."""
        if not isinstance(config, dict):
            config = config.to_dict()
        if not config.get("vision_config"):
            return None
        model_type = config.get("model_type")
        if model_type == "gemma3":
            return Gemma3ImageTokens.from_config(config, tokenizer)
        if model_type in ("idefics3", "smolvlm"):
            return Idefics3ImageTokens.from_config(config, tokenizer, preprocessor or {})
        if model_type == "mistral3":
            return PixtralImageTokens.from_config(config, tokenizer, preprocessor or {})
        if model_type == "qwen2_5_vl":
            return QwenVLImageTokens.from_config(config, tokenizer, preprocessor or {})
        return None

    def template_messages(self, messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
        """`messages` with each `IMAGE_MARKER` as the template's image part."""
        return tuple(
            message.model_copy(
                update={"content": message.content.replace(IMAGE_MARKER, self.placeholder_text)}
            )
            if IMAGE_MARKER in message.content
            else message
            for message in messages
        )

    def expand(
        self, token_ids: Sequence[int], sizes: Sequence[ImageSize]
    ) -> tuple[list[int], list[list[TokenSpan]]]:
        """Each placeholder of `token_ids` expanded to its image's full sequence.

        Args:
            token_ids: the rendered prompt, one placeholder per image.
            sizes: each image's `(width, height)`, in prompt order.

        Returns:
            `(ids, spans)`: the expanded ids and, per image, its runs of soft tokens.

        Raises:
            ValueError: the prompt's placeholders are not `len(sizes)` in number (a
                message's text holding the placeholder's own text, say).
        """
        places = sum(1 for token in token_ids if token == self.placeholder)
        if places != len(sizes):
            raise ValueError(f"the prompt places {places} images, the request has {len(sizes)}")
        ids: list[int] = []
        spans: list[list[TokenSpan]] = []
        remaining = iter(sizes)
        for token in token_ids:
            if token != self.placeholder:
                ids.append(token)
                continue
            sequence = self.sequence(next(remaining))
            spans.append([(len(ids) + start, length) for start, length in self.runs(sequence)])
            ids += sequence
        return ids, spans

    def spans(self, token_ids: Sequence[int], sizes: Sequence[ImageSize]) -> list[list[TokenSpan]]:
        """Each image's runs of soft tokens in an expanded prompt (`expand`'s ids).

        Raises:
            ValueError: the prompt's runs are not those of images of `sizes`, in order.
        """
        found = self.runs(token_ids)
        spans: list[list[TokenSpan]] = []
        position = 0
        for size in sizes:
            lengths = [length for _, length in self.runs(self.sequence(size))]
            taken = found[position : position + len(lengths)]
            if [length for _, length in taken] != lengths:
                break
            spans.append(taken)
            position += len(lengths)
        if len(spans) != len(sizes) or position != len(found):
            raise ValueError(
                f"the prompt's image tokens do not match the request's {len(sizes)} images"
            )
        return spans

    def runs(self, token_ids: Sequence[int]) -> list[TokenSpan]:
        """The runs of consecutive soft tokens in `token_ids`, in order."""
        runs: list[TokenSpan] = []
        start: int | None = None
        for index, token in enumerate((*token_ids, None)):
            if token == self.soft:
                start = index if start is None else start
            elif start is not None:
                runs.append((start, index - start))
                start = None
        return runs


@dataclass(frozen=True, slots=True)
class Gemma3ImageTokens(ImageTokens):
    """Gemma 3's image tokens: the same sequence for every image.

    Attributes:
        begin / soft_id / end: begin-of-image, image soft token and end-of-image ids.
        newlines: the ids of "\\n\\n" (written before the begin and after the end token).
        per_image: soft tokens per image (`mm_tokens_per_image`).
        begin_text: the begin-of-image token's text, written where a marker was.
    """

    bidirectional: ClassVar[bool] = True

    begin: int
    soft_id: int
    end: int
    newlines: tuple[int, ...]
    per_image: int
    begin_text: str

    @classmethod
    def from_config(cls, config: Mapping[str, Any], tokenizer: Any) -> Gemma3ImageTokens:
        """From a Gemma 3 vision `config.json` (transformers' defaults for absent ids)."""
        begin = int(config.get("boi_token_index", 255999))
        return cls(
            begin=begin,
            soft_id=int(config.get("image_token_index", 262144)),
            end=int(config.get("eoi_token_index", 256000)),
            newlines=tuple(tokenizer.encode("\n\n", add_special_tokens=False)),
            per_image=int(config.get("mm_tokens_per_image", 256)),
            begin_text=str(tokenizer.convert_ids_to_tokens(begin)),
        )

    @property
    def placeholder(self) -> int:
        return self.begin

    @property
    def placeholder_text(self) -> str:
        return self.begin_text

    @property
    def soft(self) -> int:
        return self.soft_id

    def sequence(self, size: ImageSize) -> list[int]:
        soft = [self.soft_id] * self.per_image
        return [*self.newlines, self.begin, *soft, self.end, *self.newlines]


MAX_IMAGE_SIDE = 4096
"""transformers' Idefics3 image processor caps a resized image's longest side here."""
MAX_TILE_GRID = 6
"""The Idefics3 processor's row/column marker tokens go up to `<row_6_col_6>`."""


@dataclass(frozen=True, slots=True)
class Idefics3Tiling:
    """How the Idefics3 image processor resizes and cuts an image
    (`preprocessor_config.json`).

    Attributes:
        longest_edge: the longest side after the first resize (`size.longest_edge`), in
            pixels; None: no first resize (`do_resize` false).
        tile: a tile's side, in pixels (`max_image_size.longest_edge`, the tower's input).
        split: whether big images are cut into tiles (`do_image_splitting`).
    """

    longest_edge: int | None
    tile: int
    split: bool = True

    @classmethod
    def of_preprocessor(cls, settings: Mapping[str, Any], image_size: int) -> Idefics3Tiling:
        """From `preprocessor_config.json`'s settings; where absent, a tile is the tower's
        `image_size` and the longest edge 4 tiles (transformers' default ratio, 4 x 364)."""
        tile = int((settings.get("max_image_size") or {}).get("longest_edge", image_size))
        resize = bool(settings.get("do_resize", True))
        longest = int((settings.get("size") or {}).get("longest_edge", 4 * tile))
        return cls(
            longest_edge=longest if resize else None,
            tile=tile,
            split=bool(settings.get("do_image_splitting", True)),
        )

    def resized(self, size: ImageSize) -> ImageSize:
        """`(width, height)` after the first resize: the longest side to `longest_edge`,
        the other in proportion (rounded down, then up to even), both within
        `MAX_IMAGE_SIDE`."""
        width, height = size
        if self.longest_edge is not None:
            if width >= height:
                width, height = self.longest_edge, int(self.longest_edge / (width / height))
                height += height % 2
            else:
                width, height = int(self.longest_edge * (width / height)), self.longest_edge
                width += width % 2
            width, height = max(width, 1), max(height, 1)
        aspect = width / height
        if width >= height and width > MAX_IMAGE_SIDE:
            width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
        elif height > width and height > MAX_IMAGE_SIDE:
            width, height = int(MAX_IMAGE_SIDE * aspect), MAX_IMAGE_SIDE
        return max(width, 1), max(height, 1)

    def tiled(self, size: ImageSize) -> ImageSize:
        """`(width, height)` of the resized image brought up to whole tiles (the longest
        side first, the other from the aspect ratio), before it is cut."""
        width, height = size
        aspect = width / height
        if width >= height:
            width = math.ceil(width / self.tile) * self.tile
            height = math.ceil(int(width / aspect) / self.tile) * self.tile
        else:
            height = math.ceil(height / self.tile) * self.tile
            width = math.ceil(int(height * aspect) / self.tile) * self.tile
        return width, height

    def grid(self, size: ImageSize) -> tuple[int, int]:
        """`(rows, cols)` of tiles an image of `size` (as sent) is cut into; `(0, 0)` for a
        single view of the whole image."""
        if not self.split:
            return 0, 0
        width, height = self.tiled(self.resized(size))
        if width <= self.tile and height <= self.tile:
            return 0, 0
        return height // self.tile, width // self.tile


@dataclass(frozen=True, slots=True)
class Idefics3ImageTokens(ImageTokens):
    """Idefics3's (SmolVLM's) image tokens: tiles with row/column markers and a global view.

    Attributes:
        image: the `<image>` id (placeholder and soft token alike).
        image_text: its text.
        fake: the ids of `<fake_token_around_image>`.
        global_image: the ids of `<global-img>`.
        newline: the ids of "\\n".
        row_col: `row_col[r][c]`: the ids of `<row_{r+1}_col_{c+1}>`.
        per_tile: `<image>` tokens per tile or view (`image_seq_len`).
        tiling: how an image is resized and cut.
    """

    bidirectional: ClassVar[bool] = False

    image: int
    image_text: str
    fake: tuple[int, ...]
    global_image: tuple[int, ...]
    newline: tuple[int, ...]
    row_col: tuple[tuple[tuple[int, ...], ...], ...]
    per_tile: int
    tiling: Idefics3Tiling

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> Idefics3ImageTokens:
        """From an Idefics3 `config.json` and `preprocessor_config.json`."""
        vision = config["vision_config"]
        image_size = int(vision.get("image_size", 224))
        patch_size = int(vision.get("patch_size", 32))
        scale_factor = int(config.get("scale_factor", 2))
        image = int(config.get("image_token_id", 128257))

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(
            image=image,
            image_text=str(tokenizer.convert_ids_to_tokens(image)),
            fake=ids("<fake_token_around_image>"),
            global_image=ids("<global-img>"),
            newline=ids("\n"),
            row_col=tuple(
                tuple(ids(f"<row_{row + 1}_col_{col + 1}>") for col in range(MAX_TILE_GRID))
                for row in range(MAX_TILE_GRID)
            ),
            per_tile=(image_size // patch_size) ** 2 // scale_factor**2,
            tiling=Idefics3Tiling.of_preprocessor(preprocessor, image_size),
        )

    @property
    def placeholder(self) -> int:
        return self.image

    @property
    def placeholder_text(self) -> str:
        return self.image_text

    @property
    def soft(self) -> int:
        return self.image

    def sequence(self, size: ImageSize) -> list[int]:
        rows, cols = self.tiling.grid(size)
        if rows > MAX_TILE_GRID or cols > MAX_TILE_GRID:
            raise ValueError(
                f"an image of {size[0]}x{size[1]} pixels makes a {rows}x{cols} grid of tiles; "
                f"this model marks at most {MAX_TILE_GRID}x{MAX_TILE_GRID}"
            )
        views = [self.image] * self.per_tile
        ids: list[int] = []
        for row in range(rows):
            for col in range(cols):
                ids += [*self.fake, *self.row_col[row][col], *views]
            ids += self.newline
        if rows:
            ids += self.newline
        return [*ids, *self.fake, *self.global_image, *views, *self.fake]


@dataclass(frozen=True, slots=True)
class PixtralImageTokens(ImageTokens):
    """Mistral 3's (Pixtral's) image tokens: one `[IMG]` per merged patch, row by row.

    Attributes:
        image: the `[IMG]` id (placeholder and soft token alike).
        image_text: its text.
        image_break / image_end: the ids of `[IMG_BREAK]` and `[IMG_END]`.
        patch: a merged patch's side in pixels (`patch_size x spatial_merge_size`).
        longest_edge: the largest side an image keeps, in pixels (`size.longest_edge`).
    """

    bidirectional: ClassVar[bool] = False

    image: int
    image_text: str
    image_break: tuple[int, ...]
    image_end: tuple[int, ...]
    patch: int
    longest_edge: int

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> PixtralImageTokens:
        """From a Mistral 3 `config.json` and `preprocessor_config.json` (the tower's
        `image_size` as the longest edge where the latter names none)."""
        vision = config["vision_config"]
        image = int(config.get("image_token_index", config.get("image_token_id", 10)))
        longest = (preprocessor.get("size") or {}).get("longest_edge", vision.get("image_size"))
        return cls(
            image=image,
            image_text=str(tokenizer.convert_ids_to_tokens(image)),
            image_break=tuple(tokenizer.encode("[IMG_BREAK]", add_special_tokens=False)),
            image_end=tuple(tokenizer.encode("[IMG_END]", add_special_tokens=False)),
            patch=int(vision.get("patch_size", 14)) * int(config.get("spatial_merge_size", 2)),
            longest_edge=int(longest or 1540),
        )

    @property
    def placeholder(self) -> int:
        return self.image

    @property
    def placeholder_text(self) -> str:
        return self.image_text

    @property
    def soft(self) -> int:
        return self.image

    def grid(self, size: ImageSize) -> tuple[int, int]:
        """`(rows, cols)` of merged patches of an image of `size` (as sent): scaled down to
        fit `longest_edge` (sides rounded down), each side rounded up to whole patches."""
        width, height = size
        ratio = max(width / self.longest_edge, height / self.longest_edge)
        if ratio > 1:
            width, height = math.floor(width / ratio), math.floor(height / ratio)
        return (height - 1) // self.patch + 1, (width - 1) // self.patch + 1

    def sequence(self, size: ImageSize) -> list[int]:
        rows, cols = self.grid(size)
        ids: list[int] = []
        for row in range(rows):
            ids += [self.image] * cols
            ids += self.image_end if row == rows - 1 else self.image_break
        return ids


QWEN_VL_MAX_ASPECT = 200
"""transformers' Qwen2-VL image processor refuses images longer than this many times their
width (or wider than their height)."""


@dataclass(frozen=True, slots=True)
class QwenVLImageTokens(ImageTokens):
    """Qwen2.5-VL's image tokens: `<|image_pad|>` once per merged patch of the resized
    image, between the template's `<|vision_start|>` and `<|vision_end|>`.

    Attributes:
        image: the `<|image_pad|>` id (placeholder and soft token alike).
        vision_start / vision_end: the ids of `<|vision_start|>` and `<|vision_end|>`.
        patch: a patch's side in pixels (`patch_size`).
        merge: patches per merged patch along each side (`spatial_merge_size`).
        min_pixels / max_pixels: the resized image's area bounds (`size.shortest_edge` /
            `size.longest_edge`, or the older `min_pixels` / `max_pixels`).
        text: the template's image part.
    """

    bidirectional: ClassVar[bool] = False

    image: int
    vision_start: int
    vision_end: int
    patch: int
    merge: int
    min_pixels: int
    max_pixels: int
    text: str

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> QwenVLImageTokens:
        """From a Qwen2.5-VL `config.json` and `preprocessor_config.json` (the published
        ids and transformers' processor defaults where absent)."""
        vision = config["vision_config"]
        size = preprocessor.get("size") or {}
        image = int(config.get("image_token_id", 151655))
        start = int(config.get("vision_start_token_id", 151652))
        end = int(config.get("vision_end_token_id", 151653))
        parts = tokenizer.convert_ids_to_tokens([start, image, end])
        return cls(
            image=image,
            vision_start=start,
            vision_end=end,
            patch=int(preprocessor.get("patch_size", vision.get("patch_size", 14))),
            merge=int(preprocessor.get("merge_size", vision.get("spatial_merge_size", 2))),
            min_pixels=int(size.get("shortest_edge", preprocessor.get("min_pixels", 56 * 56))),
            max_pixels=int(
                size.get("longest_edge", preprocessor.get("max_pixels", 28 * 28 * 1280))
            ),
            text="".join(str(part) for part in parts),
        )

    @property
    def placeholder(self) -> int:
        return self.image

    @property
    def placeholder_text(self) -> str:
        return self.text

    @property
    def soft(self) -> int:
        return self.image

    def resized(self, size: ImageSize) -> ImageSize:
        """`(width, height)` in pixels the image is resized to (transformers'
        `smart_resize`): whole merged patches, the area within `min_pixels .. max_pixels`.

        Raises:
            ValueError: a side longer than `QWEN_VL_MAX_ASPECT` times the other.
        """
        width, height = size
        if max(width, height) > QWEN_VL_MAX_ASPECT * min(width, height):
            raise ValueError(
                f"an image of {width}x{height} pixels is more than {QWEN_VL_MAX_ASPECT} "
                "times longer than wide"
            )
        factor = self.patch * self.merge
        rows, cols = round(height / factor) * factor, round(width / factor) * factor
        if rows * cols > self.max_pixels:
            scale = math.sqrt(height * width / self.max_pixels)
            rows = max(factor, math.floor(height / scale / factor) * factor)
            cols = max(factor, math.floor(width / scale / factor) * factor)
        elif rows * cols < self.min_pixels:
            scale = math.sqrt(self.min_pixels / (height * width))
            rows = math.ceil(height * scale / factor) * factor
            cols = math.ceil(width * scale / factor) * factor
        return cols, rows

    def grid(self, size: ImageSize) -> tuple[int, int]:
        """`(rows, cols)` of merged patches of an image of `size` (as sent)."""
        width, height = self.resized(size)
        factor = self.patch * self.merge
        return height // factor, width // factor

    def sequence(self, size: ImageSize) -> list[int]:
        rows, cols = self.grid(size)
        return [self.image] * (rows * cols)
