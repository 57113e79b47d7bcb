"""Image markers in rendered prompts (`chat_protocol.image_tokens`): a Gemma 3 vision
config expands each marker into the image's token sequence; any other model keeps it text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import Gemma3ImageTokens, ImageTokens
from exo.chat_protocol.prompt import reads_content_parts, render_prompt
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
)

BEGIN, END, SOFT = 40, 41, 42
CONFIG = {
    "model_type": "gemma3",
    "vision_config": {"image_size": 32},
    "boi_token_index": BEGIN,
    "eoi_token_index": END,
    "image_token_index": SOFT,
    "mm_tokens_per_image": 3,
}


def _tokenizer() -> Any:
    specials = {"<start_of_image>": BEGIN, "<end_of_image>": END, "<image_soft_token>": SOFT}
    words = {"<unk>": 0, **{f"w{i}": i + 1 for i in range(30)}, **specials}
    model = Tokenizer(WordLevel(words, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    model.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>")
    tokenizer.chat_template = "{% for message in messages %}{{ message.content }} {% endfor %}"
    return tokenizer


def _params(images: int) -> TextGenerationTaskParams:
    image = ImageInput(data=b"x", media_type="image/png", width=1, height=1, sha256="0" * 64)
    content = " ".join(["w1", *[f"w2 {IMAGE_MARKER}"] * images, "w3"])
    message = ChatMessage(role="user", content=content, images=(image,) * images)
    return TextGenerationTaskParams(model=ModelId("m"), messages=(message,))


def test_markers_become_image_sequences() -> None:
    tokenizer = _tokenizer()
    tokens = ImageTokens.of_config(CONFIG, tokenizer)
    assert tokens is not None
    rendered = render_prompt(tokenizer, _params(2), tokens)
    # w1 w2 [image] w2 [image] w3; "\n\n" is no word of this tokenizer (no ids)
    image = [BEGIN, SOFT, SOFT, SOFT, END]
    assert rendered.token_ids == [2, 3, *image, 3, *image, 4]
    # Without image tokens the marker stays text (`<`, `__exo_image__`, `>`: unknown words).
    plain = render_prompt(tokenizer, _params(2))
    assert SOFT not in plain.token_ids and len(plain.token_ids) != len(rendered.token_ids)


def test_typed_image_token_text_places_no_image() -> None:
    """A message that holds the begin token's own text and one image part: the text stays
    ordinary tokens (unknown words here), only the image part places an image."""
    tokenizer = _tokenizer()
    tokens = ImageTokens.of_config(CONFIG, tokenizer)
    assert tokens is not None
    params = _params(1)
    message = params.messages[0].model_copy(update={"content": "<start_of_image> " + IMAGE_MARKER})
    rendered = render_prompt(tokenizer, params.model_copy(update={"messages": (message,)}), tokens)
    # "<", "start_of_image", ">": three unknown words; then the one image.
    assert rendered.token_ids == [0, 0, 0, BEGIN, SOFT, SOFT, SOFT, END]
    assert rendered.text == "<start_of_image> <start_of_image> "


def test_more_image_places_than_images_is_refused() -> None:
    tokenizer = _tokenizer()
    tokens = ImageTokens.of_config(CONFIG, tokenizer)
    assert tokens is not None
    with pytest.raises(ValueError, match="places 2 images, the request has 1"):
        tokens.expand([2, BEGIN, 3, BEGIN], [(1, 1)])


def test_of_model_reads_config_json(tmp_path: Path) -> None:
    tokenizer = _tokenizer()
    assert ImageTokens.of_model(tmp_path, tokenizer) is None  # no config.json
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    tokens = ImageTokens.of_model(tmp_path, tokenizer)
    assert isinstance(tokens, Gemma3ImageTokens) and (tokens.begin, tokens.per_image) == (BEGIN, 3)
    assert tokens.begin_text == "<start_of_image>"
    (tmp_path / "config.json").write_text(json.dumps({**CONFIG, "vision_config": None}))
    assert ImageTokens.of_model(tmp_path, tokenizer) is None  # a text-only Gemma 3


def test_a_template_of_content_parts_gets_parts() -> None:
    """A template that reads content only as parts (SmolVLM's, Idefics2/3's) gets each
    message as text parts with an image part at each marker, and writes its own image
    part there; a template of strings keeps getting strings."""
    tokenizer = _tokenizer()
    assert not reads_content_parts(tokenizer, tokenizer.chat_template)
    strings = render_prompt(tokenizer, _params(2), ImageTokens.of_config(CONFIG, tokenizer))
    tokenizer.chat_template = (
        "{% for message in messages %}{% for part in message['content'] %}"
        "{% if part['type'] == 'image' %}<start_of_image>{% else %}{{ part['text'] }}"
        "{% endif %}{% endfor %} {% endfor %}"
    )
    assert reads_content_parts(tokenizer, tokenizer.chat_template)
    parts = render_prompt(tokenizer, _params(2), ImageTokens.of_config(CONFIG, tokenizer))
    assert parts.token_ids == strings.token_ids
    # Text-only chat too: the words are rendered, not dropped.
    assert render_prompt(tokenizer, _params(0)).token_ids == [2, 4]
