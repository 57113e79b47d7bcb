"""Idefics3 / SmolVLM images through the engine's real path (`model/idefics3_vision.py`,
`chat_protocol/image_tokens/`): a tiny random `Idefics3ForConditionalGeneration` saved by
transformers, loaded by `TorchEngine.load` (Llama text model on the direct forward, tower
beside it), against transformers' own model fed by transformers' own processor (its image
processor's pixel values and its prompt expansion), float32."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import Idefics3Config, Idefics3ForConditionalGeneration, PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import Idefics3ImageTokens, Idefics3Tiling, ImageTokens
from exo.shared.types.text_generation import IMAGE_MARKER, TextGenerationTaskParams
from exo.testing.vision_checkpoints import (
    TOLERANCE,
    RecordingChooser,
    assert_greedy_equals_reference,
    assert_same_tokens_and_logprobs,
    assert_typed_image_text_stays_text,
    image_params,
    perturb_weights,
    png,
    rgb_images,
    save_word_tokenizer,
    vision_engine,
)
from exo.worker.engines.torch.model.idefics3_vision import Idefics3Preprocessing

STEPS = 8
TILE, LONGEST_EDGE, PATCH = 32, 64, 8  # 16 patches per view, 4 rows after the 2 x 2 shuffle
SPECIALS = [
    "<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>",
    *[f"<row_{row}_col_{col}>" for row in range(1, 7) for col in range(1, 7)],
]  # fmt: skip
IMAGE_ID = 45  # "<image>": after 43 words, "\n" and `<fake_token_around_image>`
# Content parts only, as SmolVLM's template reads them (a string content renders as nothing).
TEMPLATE = (
    "<s>{% for message in messages %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% else %}{{ part['text'] }}{% endif %}"
    "{% endfor %} <end_of_utterance> {% endfor %}"
)


def _save_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A word-level tokenizer with SmolVLM's image tokens (special) and "\\n" (a token of
    its own, as in SmolVLM's vocabulary)."""
    return save_word_tokenizer(
        directory, words=40, specials=SPECIALS, template=TEMPLATE, newline=True
    )


def _image_processor() -> Any:
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )

    return Idefics3ImageProcessorPil(
        size={"longest_edge": LONGEST_EDGE}, max_image_size={"longest_edge": TILE}
    )


def _save_checkout(directory: Path, family: str) -> tuple[Path, Any, Any]:
    """A tiny random checkout of `family` ("idefics3" or "smolvlm", SmolVLM2's classes)
    saved by transformers: (its directory, transformers' model, the Idefics3 processor)."""
    from transformers import SmolVLMConfig, SmolVLMForConditionalGeneration
    from transformers.models.idefics3.processing_idefics3 import Idefics3Processor

    tokenizer = _save_tokenizer(directory)
    assert tokenizer.encode("<image>", add_special_tokens=False) == [IMAGE_ID]
    torch.manual_seed(0)
    config_class: Any = SmolVLMConfig if family == "smolvlm" else Idefics3Config
    model_class: Any = (
        SmolVLMForConditionalGeneration if family == "smolvlm" else Idefics3ForConditionalGeneration
    )
    config = config_class(
        text_config={
            "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1,
            "eos_token_id": 2, "rms_norm_eps": 1e-5,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": TILE, "patch_size": PATCH,
        },
        scale_factor=2, image_token_id=IMAGE_ID,
    )  # fmt: skip
    reference = model_class(config).float().eval()
    perturb_weights(reference)
    reference.save_pretrained(directory)
    image_processor = _image_processor()
    image_processor.save_pretrained(directory)
    processor = Idefics3Processor(image_processor, tokenizer, image_seq_len=4)
    return directory, reference, processor


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the saved Idefics3 checkout, transformers' model, transformers' processor)."""
    return _save_checkout(tmp_path_factory.mktemp("idefics3"), "idefics3")


def _reference_logits(reference: Any, ids: list[int], inputs: Any) -> torch.Tensor:
    with torch.inference_mode():
        output = reference(
            input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"],
            pixel_attention_mask=inputs["pixel_attention_mask"], use_cache=False,
        )  # fmt: skip
    return output.logits[0].float()


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_two_images_equal_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 2 x 2-tile image and a 1 x 2-tile one: the engine's prompt is the processor's,
    its greedy tokens transformers', every step's logits within `TOLERANCE` (transformers
    teacher-forced on exo's tokens), usage and the token count the expanded prompt."""
    _check_two_images(checkout, monkeypatch)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_smolvlm2_two_images_equal_transformers(
    tmp_path: Path, float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SmolVLM2's classes (`SmolVLMForConditionalGeneration`): the same check. Its own
    processor needs torchvision and num2words (not installed here); its prompt expansion
    and image processor are written as Idefics3's, whose processor builds the reference
    prompt."""
    (tmp_path / "smolvlm").mkdir()
    _check_two_images(_save_checkout(tmp_path / "smolvlm", "smolvlm"), monkeypatch)


def _check_two_images(checkout: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    assert engine.images is not None
    # The API node reads the layout from the files (`token_counting`): the runner's own.
    assert engine.images.tokens == ImageTokens.of_model(directory, engine.tokenizer)
    pictures = [png(60, 40, seed=1), png(70, 20, seed=2)]
    params = image_params(engine, f"w1 w2 {IMAGE_MARKER} w3 w4 {IMAGE_MARKER} w5", pictures, STEPS)
    rendered = engine.render_prompt(params)
    assert rendered.text == "<s>w1 w2 <image> w3 w4 <image> w5 <end_of_utterance> "
    prompt_ids = rendered.token_ids
    text = "<s>w1 w2 <image> w3 w4 <image> w5 <end_of_utterance> "
    inputs = processor(text=text, images=rgb_images(pictures), return_tensors="pt")
    assert prompt_ids == inputs["input_ids"][0].tolist()
    image = processor.image_token_id
    assert prompt_ids.count(image) == (2 * 2 + 1) * 4 + (1 * 2 + 1) * 4  # 4 per view
    assert engine.count_prompt_tokens(params) == len(prompt_ids)

    expected = assert_greedy_equals_reference(
        engine, params, lambda ids: _reference_logits(reference, ids, inputs), monkeypatch
    )
    # The images matter: without their features the first token's logits differ.
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"]) + 0.5}
    plain = _reference_logits(reference, prompt_ids, blank)[-1]
    assert (plain - expected[0]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_views_equal_transformers_image_processor(checkout: tuple[Path, Any, Any]) -> None:
    """exo's tiles and global view are the PIL image processor's pixel values (within
    1e-5) for wide, tall and small images (small ones are scaled up to the longest edge)."""
    directory, _, processor = checkout
    config = json.loads((directory / "config.json").read_text())
    preprocessing = Idefics3Preprocessing.of_model(directory, config["vision_config"]["image_size"])
    for width, height, views in ((60, 40, 5), (20, 14, 5), (24, 60, 3), (70, 20, 3)):
        picture = png(width, height, seed=width)
        image = Image.open(io.BytesIO(picture)).convert("RGB")
        expected = processor.image_processor(images=[image], return_tensors="pt")
        got = preprocessing.views(picture)
        assert got.shape == (views, 3, TILE, TILE)
        assert (got - expected["pixel_values"][0]).abs().max().item() < 1e-5


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_transparent_image_views_equal_transformers(checkout: tuple[Path, Any, Any]) -> None:
    """A half-transparent RGBA PNG: laid over white as transformers' processor does."""
    directory, _, processor = checkout
    config = json.loads((directory / "config.json").read_text())
    preprocessing = Idefics3Preprocessing.of_model(directory, config["vision_config"]["image_size"])
    generator = torch.Generator().manual_seed(7)
    pixels = torch.randint(0, 256, (40, 60, 4), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy(), mode="RGBA").save(buffer, format="PNG")
    image = Image.open(io.BytesIO(buffer.getvalue()))
    expected = processor.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
    got = preprocessing.views(buffer.getvalue())
    assert (got - expected).abs().max().item() < 1e-5


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_layout_follows_the_processor_for_many_sizes(checkout: tuple[Path, Any, Any]) -> None:
    """The image token sequence from the width and height alone (what the API node counts)
    is the processor's, for wide, tall, tiny and square images, split into tiles or (with
    `do_image_splitting` off) one view each."""
    directory, _, processor = checkout
    tokenizer = processor.tokenizer
    tokens = ImageTokens.of_model(directory, tokenizer)
    assert isinstance(tokens, Idefics3ImageTokens)
    config = json.loads((directory / "config.json").read_text())
    settings = json.loads((directory / "preprocessor_config.json").read_text())
    single = Idefics3ImageTokens.from_config(
        config, tokenizer, {**settings, "do_image_splitting": False}
    )
    for width, height in ((1, 1), (33, 32), (64, 64), (100, 7), (7, 100), (61, 33), (31, 90)):
        image = Image.open(io.BytesIO(png(width, height, seed=3))).convert("RGB")
        inputs = processor(text="<image>", images=[image])
        assert tokens.sequence((width, height)) == inputs["input_ids"][0], (width, height)
        inputs = processor(text="<image>", images=[image], do_image_splitting=False)
        assert single.sequence((width, height)) == inputs["input_ids"][0], (width, height)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_grid_matches_smolvlm_settings() -> None:
    """SmolVLM-256M's tiling (longest edge 2048, tiles of 512): the image processor's rows
    and columns, from the width and height alone."""
    tiling = Idefics3Tiling(longest_edge=2048, tile=512)
    processor = _image_processor()
    for width, height in ((640, 480), (480, 640), (300, 300), (1000, 200), (700, 2100)):
        image = Image.new("RGB", (width, height), (10, 20, 30))
        info = processor(
            images=[image], size={"longest_edge": 2048}, max_image_size={"longest_edge": 512},
            return_row_col_info=True,
        )  # fmt: skip
        assert tiling.grid((width, height)) == (info["rows"][0][0], info["cols"][0][0])


def test_text_only_card_refuses_images_and_prefix_cache_keys_on_bytes(
    checkout: tuple[Path, Any, Any], float32_kv: None
) -> None:
    """A card without "vision" loads no tower and refuses images (a ValueError: 400); with
    it, a second request with the same text and another image shares KV only before the
    image's first tile, and its logits equal a fresh engine's."""
    directory, _, _ = checkout
    text_only = vision_engine(directory, ("text",))
    assert text_only.images is None

    def params(picture: bytes) -> TextGenerationTaskParams:
        request = image_params(text_only, f"w1 w2 w3 {IMAGE_MARKER} w4", [picture], 3)
        return request.model_copy(update={"logprobs": True, "top_logprobs": 1})

    with pytest.raises(ValueError, match="takes no images"):
        text_only.render_prompt(params(png(60, 40, seed=1)))
    engine = vision_engine(directory)
    list(engine.generate(params(png(60, 40, seed=1))))
    other = params(png(60, 40, seed=5))
    handle = engine.submit(other)
    pieces: list[Any] = []
    while engine.has_work:
        pieces += [output for _, output in engine.step()]
    prompt_ids = engine.render_prompt(other).token_ids
    first_image = prompt_ids.index(engine.images.tokens.soft) if engine.images else -1
    assert handle.cached_tokens is not None and 0 < handle.cached_tokens <= first_image
    assert_same_tokens_and_logprobs(pieces, list(vision_engine(directory).generate(other)))


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_chunks_cut_inside_tiles_equal_one_prefill(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Causal images need no chunk alignment: prefill chunks of 7 tokens, cut inside the
    tiles' runs, give transformers' logits as one prefill does."""
    import exo.worker.engines.torch.batching.scheduler as scheduler_module

    directory, reference, processor = checkout
    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS_PER_IDLE_STEP", 7)
    engine = vision_engine(directory)
    picture = png(60, 40, seed=1)
    params = image_params(engine, f"w1 {IMAGE_MARKER} w2", [picture], 2)
    chooser = RecordingChooser()
    monkeypatch.setattr(engine, "token_chooser", lambda *_: chooser)
    prompt_ids = engine.render_prompt(params).token_ids
    generated = [token for piece in engine.generate(params) for token in piece.token_ids]
    text = "<s>w1 <image> w2 <end_of_utterance> "
    inputs = processor(text=text, images=rgb_images([picture]), return_tensors="pt")
    expected = _reference_logits(reference, prompt_ids + generated[:-1], inputs)
    assert (torch.stack(chooser.rows) - expected[len(prompt_ids) - 1 :]).abs().max() < TOLERANCE


def test_a_checkout_without_the_tower_serves_text_and_refuses_images(
    checkout: tuple[Path, Any, Any], tmp_path: Path
) -> None:
    """Weight files without the tower's tensors (a download that skipped them): the model
    loads and chats; an image is a ValueError (400) saying the tower's weights are missing."""
    import shutil

    from safetensors.torch import load_file, save_file

    source, _, _ = checkout
    directory = tmp_path / "no-tower"
    shutil.copytree(source, directory)
    tensors = load_file(str(directory / "model.safetensors"))
    text = {name: tensor for name, tensor in tensors.items() if "vision_model" not in name}
    save_file(text, str(directory / "model.safetensors"), metadata={"format": "pt"})
    engine = vision_engine(directory)
    assert engine.images is None
    params = image_params(engine, "w1 w2", [], 2)
    assert [piece for piece in engine.generate(params)][-1].finish_reason is not None
    image = image_params(engine, f"w1 {IMAGE_MARKER}", [png(60, 40, seed=1)], 2)
    with pytest.raises(ValueError, match="weights of its vision tower are not on this node"):
        engine.render_prompt(image)


@pytest.mark.parametrize(
    "typed", ["<image>", "<fake_token_around_image><global-img><image><fake_token_around_image>"]
)
def test_typed_image_tokens_are_text(
    checkout: tuple[Path, Any, Any],
    float32_kv: None,
    monkeypatch: pytest.MonkeyPatch,
    typed: str,
) -> None:
    """A user's typed `<image>` (or a global view's whole markup) is ordinary text, in a
    template of content parts that writes `<image>` itself for an image part: without an
    image the prompt holds no image token and is answered as transformers answers those
    tokens; with one image part exactly one image is placed."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)

    def reference_logits(ids: list[int], pictures: list[bytes]) -> torch.Tensor:
        if not pictures:
            with torch.inference_mode():
                return reference(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        inputs = processor(text="<image>", images=rgb_images(pictures), return_tensors="pt")
        return _reference_logits(reference, ids, inputs)

    assert_typed_image_text_stays_text(
        engine, typed, png(60, 40, seed=5), reference_logits, monkeypatch
    )
