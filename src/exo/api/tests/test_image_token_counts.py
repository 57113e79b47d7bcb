"""The API node's prompt-token count of a request with images (`count_prompt_tokens`): a
vision model's images count as their image tokens, as the runner renders them
(`chat_protocol.image_tokens`: Gemma 3's fixed sequence, Idefics3's by the image's size);
without the model's config.json the markers count as text."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import anyio
import pytest

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.token_counting import TokenizerCache, count_prompt_tokens
from exo.api.tests.claude_messages_builders import PYPI_SOURCE, FakeCluster, card
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
)

PER_IMAGE = 5


def _tokenizer() -> Any:
    """Whitespace words, each one token; the image tokens are words too."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "<user>", "<assistant>", "hi", "there"]
    words += ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    backend = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m.role }}> {{ m.content }} {% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    return tokenizer


@pytest.mark.anyio
async def test_images_count_as_their_tokens(tmp_path: Path) -> None:
    directory = tmp_path / "org--name"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))
    image = ImageInput(data=b"x", media_type="image/png", width=1, height=1, sha256="0" * 64)
    message = ChatMessage(
        role="user", content=f"hi {IMAGE_MARKER} there {IMAGE_MARKER}", images=(image, image)
    )
    params = TextGenerationTaskParams(model=ModelId("org/name"), messages=(message,))

    async def count() -> int:
        cache = TokenizerCache(lambda _: _tokenizer())
        with anyio.fail_after(60):
            return await count_prompt_tokens(
                cluster, params, tokenizers=cache, models_directory=tmp_path
            )

    # No config.json on this node: "<user> hi <marker> there <marker> <assistant>".
    assert await count() == 6
    config = {
        "model_type": "gemma3", "vision_config": {"image_size": 32}, "boi_token_index": 5,
        "eoi_token_index": 6, "image_token_index": 7, "mm_tokens_per_image": PER_IMAGE,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    # Each marker: begin, PER_IMAGE soft tokens, end ("\n\n" is no word here).
    assert await count() == 4 + 2 * (PER_IMAGE + 2)


@pytest.mark.anyio
async def test_idefics3_images_count_by_their_size(tmp_path: Path) -> None:
    """An Idefics3 (SmolVLM) model's image counts as its tiles' and global view's tokens,
    which its width and height decide (`Idefics3ImageTokens`, checked against transformers'
    processor in `test_idefics3_vision.py`)."""
    directory = tmp_path / "org--name"
    directory.mkdir()
    (directory / "tokenizer.json").write_text("{}")
    cluster = cast(ClusterClient, FakeCluster({ModelId("org/name"): card("org/name", PYPI_SOURCE)}))

    def tokenizer() -> Any:
        base = _tokenizer()
        base.add_special_tokens(
            {
                "additional_special_tokens": [
                    "<image>", "<fake_token_around_image>", "<global-img>",
                    *[f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)],
                ]
            }
        )  # fmt: skip
        return base

    image_id = tokenizer().convert_tokens_to_ids("<image>")
    config = {
        "model_type": "idefics3", "image_token_id": image_id, "scale_factor": 2,
        "vision_config": {"image_size": 32, "patch_size": 8},
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config))
    preprocessor = {"size": {"longest_edge": 64}, "max_image_size": {"longest_edge": 32}}
    (directory / "preprocessor_config.json").write_text(json.dumps(preprocessor))

    async def count(width: int, height: int) -> int:
        image = ImageInput(
            data=b"x", media_type="image/png", width=width, height=height, sha256="0" * 64
        )
        message = ChatMessage(role="user", content=f"hi {IMAGE_MARKER}", images=(image,))
        params = TextGenerationTaskParams(model=ModelId("org/name"), messages=(message,))
        with anyio.fail_after(60):
            return await count_prompt_tokens(
                cluster, params, tokenizers=TokenizerCache(lambda _: tokenizer()),
                models_directory=tmp_path,
            )  # fmt: skip

    # "<user> hi", then per tile <fake> <row_r_col_c> + 4 <image>, per row "\n" (no word
    # here), the global view <fake> <global-img> + 4 <image> <fake>; then "<assistant>".
    text = 3
    assert await count(60, 40) == text + 2 * 2 * (2 + 4) + (3 + 4)  # 2 x 2 tiles
    assert await count(70, 20) == text + 1 * 2 * (2 + 4) + (3 + 4)  # 1 x 2 tiles
