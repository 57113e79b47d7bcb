"""Mistral 3 images (Pixtral's tower) through the engine's real path
(`model/mistral3_vision.py`, `chat_protocol/image_tokens/`): a tiny random
`Mistral3ForConditionalGeneration` saved in the published layout (text under
`language_model.`, tower and projector at the top), loaded by `TorchEngine.load` (Mistral
text model on the direct forward, tower beside it), against transformers' own model fed by
transformers' own processor (its pixel values and its `[IMG]` / `[IMG_BREAK]` / `[IMG_END]`
expansion), float32."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import Mistral3Config, Mistral3ForConditionalGeneration

from exo.chat_protocol.image_tokens import ImageTokens, PixtralImageTokens
from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.vision_checkpoints import (
    TOLERANCE,
    assert_greedy_equals_reference,
    assert_typed_image_text_stays_text,
    image_params,
    perturb_weights,
    png,
    rgb_images,
    save_renamed_tensors,
    save_word_tokenizer,
    vision_engine,
)

STEPS = 8
PATCH, MERGE, LONGEST_EDGE = 8, 2, 64  # merged patches of 16 pixels, at most 4 x 4
SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
IMAGE_ID = 44  # "[IMG]": after 43 words and before the break and end tokens
TEMPLATE = "<s>{% for message in messages %}{{ message.content }} {% endfor %}"


def _published_name(name: str) -> str:
    """transformers' saved name → the published Mistral Small 3.1 checkpoint's."""
    if name.startswith("model.language_model."):
        return "language_model.model." + name.removeprefix("model.language_model.")
    if name.startswith("lm_head."):
        return "language_model." + name
    return name.removeprefix("model.")


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the saved checkout, transformers' model, transformers' processor)."""
    return save_checkout(tmp_path_factory.mktemp("mistral3"))


def save_checkout(directory: Path) -> tuple[Path, Any, Any]:
    """A tiny random Mistral 3 checkout in `directory` (2 text layers of 64, a 2-layer
    Pixtral tower): (the directory, transformers' model, transformers' processor)."""
    from transformers.models.pixtral import image_processing_pil_pixtral
    from transformers.models.pixtral.image_processing_pil_pixtral import (
        PixtralImageProcessorPil,
    )

    with pytest.MonkeyPatch.context() as patch:
        # The processor module imports a size helper from the torchvision image processor
        # (torchvision is not installed here); the PIL processor's module has the same one.
        patch.setitem(
            sys.modules, "transformers.models.pixtral.image_processing_pixtral",
            image_processing_pil_pixtral,
        )  # fmt: skip
        from transformers.models.pixtral.processing_pixtral import PixtralProcessor

    tokenizer = save_word_tokenizer(directory, words=41, specials=SPECIALS, template=TEMPLATE)
    assert tokenizer.encode("[IMG]", add_special_tokens=False) == [IMAGE_ID]
    torch.manual_seed(0)
    config = Mistral3Config(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "max_position_embeddings": 512, "sliding_window": None,
            "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 16, "image_size": LONGEST_EDGE,
            "patch_size": PATCH,
        },
        spatial_merge_size=MERGE, image_token_index=IMAGE_ID, tie_word_embeddings=False,
    )  # fmt: skip
    reference = Mistral3ForConditionalGeneration(config).float().eval()
    perturb_weights(reference)
    save_renamed_tensors(reference, directory / "model.safetensors", _published_name)
    saved = config.to_dict()
    saved["architectures"] = ["Mistral3ForConditionalGeneration"]
    (directory / "config.json").write_text(json.dumps(saved))
    image_processor = PixtralImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, patch_size={"height": PATCH, "width": PATCH}
    )
    image_processor.save_pretrained(directory)
    processor = PixtralProcessor(
        image_processor, tokenizer, patch_size=PATCH, spatial_merge_size=MERGE
    )
    return directory, reference, processor


def _reference_logits(reference: Any, ids: list[int], inputs: Any) -> torch.Tensor:
    with torch.inference_mode():
        output = reference(
            input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"],
            image_sizes=inputs["image_sizes"], use_cache=False,
        )  # fmt: skip
    return output.logits[0].float()


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_two_images_equal_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3 x 4 image and one scaled down to fit (2 x 4 merged patches): the engine's prompt
    is the processor's, every step's logits within `TOLERANCE` of transformers'
    (teacher-forced on exo's tokens), its greedy tokens transformers', usage and the token
    count the expanded prompt."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    assert engine.images is not None
    # The API node reads the layout from the files (`token_counting`): the runner's own.
    assert engine.images.tokens == ImageTokens.of_model(directory, engine.tokenizer)
    pictures = [png(60, 40, seed=1), png(100, 30, seed=2)]
    params = image_params(engine, f"w1 w2 {IMAGE_MARKER} w3 w4 {IMAGE_MARKER} w5", pictures, STEPS)
    prompt_ids = engine.render_prompt(params).token_ids
    text = "<s>w1 w2 [IMG] w3 w4 [IMG] w5 "
    inputs = processor(text=text, images=rgb_images(pictures), return_tensors="pt")
    assert prompt_ids == inputs["input_ids"][0].tolist()
    assert prompt_ids.count(IMAGE_ID) == 3 * 4 + 2 * 4
    assert engine.count_prompt_tokens(params) == len(prompt_ids)

    expected = assert_greedy_equals_reference(
        engine, params, lambda ids: _reference_logits(reference, ids, inputs), monkeypatch
    )
    # The images matter: without their features the first token's logits differ.
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    plain = _reference_logits(reference, prompt_ids, blank)[-1]
    assert (plain - expected[0]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_layout_follows_the_processor_for_many_sizes(checkout: tuple[Path, Any, Any]) -> None:
    """The `[IMG]` rows from the width and height alone (what the API node counts) are the
    processor's, for small, large (scaled down), wide and tall images."""
    directory, _, processor = checkout
    tokens = ImageTokens.of_model(directory, processor.tokenizer)
    assert isinstance(tokens, PixtralImageTokens)
    for width, height in ((1, 1), (16, 16), (17, 33), (64, 64), (65, 64), (200, 41), (30, 500)):
        inputs = processor(text="[IMG]", images=rgb_images([png(width, height, seed=3)]))
        expected = torch.as_tensor(inputs["input_ids"][0]).tolist()
        assert tokens.sequence((width, height)) == expected, (width, height)


@pytest.mark.parametrize("typed", ["[IMG]", "[IMG][IMG_BREAK][IMG_END]"])
def test_typed_image_tokens_are_text(
    checkout: tuple[Path, Any, Any],
    float32_kv: None,
    monkeypatch: pytest.MonkeyPatch,
    typed: str,
) -> None:
    """A user's typed `[IMG]` (or a whole row's markup) is ordinary text: without an image
    the prompt holds no image token and is answered as transformers answers those tokens;
    with one image part exactly one image is placed."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)

    def reference_logits(ids: list[int], pictures: list[bytes]) -> torch.Tensor:
        if not pictures:
            with torch.inference_mode():
                return reference(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        inputs = processor(text="<s>[IMG]", images=rgb_images(pictures), return_tensors="pt")
        return _reference_logits(reference, ids, inputs)

    assert_typed_image_text_stays_text(
        engine, typed, png(60, 40, seed=5), reference_logits, monkeypatch
    )
