"""Idefics3's / SmolVLM's image tokens (`Idefics3ForConditionalGeneration`, and SmolVLM2's
`SmolVLMForConditionalGeneration`, whose processor lays images out the same way; facts from
transformers' `Idefics3Processor` and `Idefics3ImageProcessor`).

The template writes `<image>`; the image is resized so its longest edge is
`size.longest_edge`, then up to multiples of the tile size (`max_image_size.longest_edge`)
and cut into `rows x cols` tiles plus a global view of the whole image at tile size (one
view and no tiles when it is a single tile). Each tile is written
`<fake_token_around_image><row_R_col_C>` + `<image>` x `image_seq_len`, a "\\n" after each
row of tiles, then "\\n<fake_token_around_image><global-img>" + `<image>` x
`image_seq_len` + `<fake_token_around_image>`; a single view is that last part without the
leading "\\n". `image_seq_len` is `(image_size / patch_size)^2 / scale_factor^2`.
Attention stays causal over the image tokens (the text model is a plain Llama).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from exo.chat_protocol.image_tokens.base import ImageSize, OneTokenImages

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
class Idefics3ImageTokens(OneTokenImages):
    """Idefics3's (SmolVLM's) image tokens: tiles with row/column markers and a global view.

    Attributes:
        image / image_text: the `<image>` id (placeholder and soft token alike) and text.
        fake: the ids of `<fake_token_around_image>`.
        global_image: the ids of `<global-img>`.
        newline: the ids of "\\n".
        row_col: `row_col[r][c]`: the ids of `<row_{r+1}_col_{c+1}>`.
        per_tile: `<image>` tokens per tile or view (`image_seq_len`).
        tiling: how an image is resized and cut.
    """

    bidirectional: ClassVar[bool] = False
    model_types: ClassVar[tuple[str, ...]] = ("idefics3", "smolvlm")

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
    def image_token_ids(self) -> frozenset[int]:
        markers = [token for row in self.row_col for marker in row for token in marker]
        return frozenset((self.image, *self.fake, *self.global_image, *markers))

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
