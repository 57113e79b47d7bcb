"""What every vision family's image tokens share: the placeholder a chat template writes
for an image, its expansion into the image's whole sequence, and finding each image's runs
of soft tokens again in an expanded prompt. The family is chosen by the checkpoint's
`config.json` (`model_type`) among the subclasses that name it in `model_types`."""

from __future__ import annotations

import json
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
    tokens attend to each other in both directions (Gemma 3) or causally (Idefics3);
    `model_types` are the `config.json` model types it serves, and `from_config` builds it
    from that file.
    """

    bidirectional: ClassVar[bool]
    model_types: ClassVar[tuple[str, ...]] = ()
    _by_model_type: ClassVar[dict[str, type[ImageTokens]]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # `cls.__dict__`: an intermediate base inherits no family; a slots dataclass
        # (a new class of the same name) replaces the one it was made from.
        for model_type in cls.__dict__.get("model_types", ()):
            ImageTokens._by_model_type[model_type] = cls

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

    @property
    @abstractmethod
    def image_token_ids(self) -> frozenset[int]:
        """Every id of the family's image markup (the template's image part and any image's
        sequence) that is no ordinary text; a client's text holding one of these tokens'
        text keeps it as text (`exo.chat_protocol.typed_image_text`)."""

    @abstractmethod
    def sequence(self, size: ImageSize) -> list[int]:
        """The token ids that replace the placeholder for an image of `size`."""

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], tokenizer: Any, preprocessor: Mapping[str, Any]
    ) -> ImageTokens:
        """A family's tokens from its parsed `config.json` and `preprocessor_config.json`
        (empty: the family's defaults); overridden by every family."""
        raise NotImplementedError(f"{cls.__name__} serves no model type")

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

    @staticmethod
    def serves(config: Mapping[str, Any]) -> bool:
        """Whether a parsed `config.json` is a vision checkpoint some family renders
        images for: a `vision_config` and a model type a subclass names (what `of_config`
        needs before it builds one)."""
        return bool(config.get("vision_config")) and (
            str(config.get("model_type")) in ImageTokens._by_model_type
        )

    @classmethod
    def of_config(
        cls, config: Any, tokenizer: Any, preprocessor: Mapping[str, Any] | None = None
    ) -> ImageTokens | None:
        """As `of_model`, from the parsed `config.json` (a dict) or a transformers config,
        and the parsed `preprocessor_config.json` (None or empty: the family's defaults);
        None for a config without `vision_config` or of a model type no family serves."""
        if not isinstance(config, dict):
            config = config.to_dict()
        if not ImageTokens.serves(config):
            return None
        family = ImageTokens._by_model_type[str(config.get("model_type"))]
        return family.from_config(config, tokenizer, preprocessor or {})

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
class OneTokenImages(ImageTokens):
    """A family whose chat template writes the soft token itself for an image (Idefics3,
    Pixtral, Qwen-VL): the placeholder is expanded into runs of that same token.

    Attributes:
        image: the image token's id (placeholder and soft token alike).
        image_text: the template's image part, written where a marker was (the image
            token's text, with the markers around it where the template writes them).
    """

    image: int
    image_text: str

    @property
    def placeholder(self) -> int:
        return self.image

    @property
    def placeholder_text(self) -> str:
        return self.image_text

    @property
    def soft(self) -> int:
        return self.image

    @property
    def image_token_ids(self) -> frozenset[int]:
        return frozenset((self.image,))
