"""Qwen3-VL through the engine's real path (`model/qwen3_vl_vision.py`,
`chat_protocol/image_tokens/`, interleaved multimodal rotary positions and deepstack
features in the direct forward): a tiny random `Qwen3VLForConditionalGeneration` saved in
the published layout (config.json with `text_config` / `vision_config` as
Qwen3-VL-4B-Instruct's; text model under `model.language_model.`, tower under
`model.visual.`, the head tied), loaded by `TorchEngine.load` (Qwen3 text model on the
direct forward, tower beside it), against transformers' own model fed by transformers' own
image processor (its patches and grids; its `<|image_pad|>` expansion rebuilt from the
grids), float32, 16 greedy steps."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoConfig, PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import ImageTokens, Qwen3VLImageTokens
from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.qwen_vl_checkpoints import (
    QWEN_VL_IMAGE_TEXT,
    QWEN_VL_MERGE,
    assert_layout_and_patches_follow,
    assert_positions_equal_rope_index,
    qwen_vl_expected_ids,
    qwen_vl_processed,
    qwen_vl_reference_logits,
    save_tiny_qwen3_vl,
)
from exo.testing.vision_checkpoints import (
    TOLERANCE,
    assert_greedy_equals_reference,
    assert_typed_image_text_stays_text,
    image_params,
    png,
    vision_engine,
)
from exo.worker.engines.torch.model.qwen2_5_vl_vision import QwenVLPreprocessing

STEPS = 16
MERGE = QWEN_VL_MERGE  # merged patches of 16 pixels
IMAGE_TEXT = QWEN_VL_IMAGE_TEXT


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the saved checkout, transformers' model, transformers' image processor)."""
    directory = tmp_path_factory.mktemp("qwen3_vl")
    reference, processor = save_tiny_qwen3_vl(directory)
    return directory, reference, processor


def _expected_ids(text_ids: list[int], grids: torch.Tensor) -> list[int]:
    return qwen_vl_expected_ids(text_ids, grids, MERGE)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_text_only_equals_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A text prompt: 16 greedy steps, every step's logits within `TOLERANCE` of
    transformers' (its 1-D positions as the three rows of the multimodal rotary)."""
    directory, reference, _ = checkout
    engine = vision_engine(directory)
    params = image_params(engine, "w1 w2 w3 w4 w5 w6", [], STEPS)
    assert_greedy_equals_reference(
        engine, params, lambda ids: qwen_vl_reference_logits(reference, ids, None), monkeypatch
    )


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_two_images_equal_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wide 60 x 40 and a tall 40 x 100 image (2 x 4 and 6 x 2 merged patches): the
    engine's prompt is the processor's, 16 greedy steps with every step's logits within
    `TOLERANCE` of transformers' (teacher-forced on exo's tokens). The comparison covers
    what Qwen3-VL adds: without the deepstack features, or with 1-D positions, the
    reference's logits move far more than the tolerance."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    assert engine.images is not None and engine.images.multimodal_rotary
    assert isinstance(engine.images.tokens, Qwen3VLImageTokens)
    # The API node reads the layout from the files (`token_counting`): the runner's own.
    assert engine.images.tokens == ImageTokens.of_model(directory, engine.tokenizer)
    pictures = [png(60, 40, seed=1), png(40, 100, seed=2)]
    params = image_params(engine, f"w1 w2 {IMAGE_MARKER} w3 w4 {IMAGE_MARKER} w5", pictures, STEPS)
    prompt_ids = engine.render_prompt(params).token_ids
    inputs = qwen_vl_processed(processor, pictures)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8], [1, 12, 4]]
    text = f"w1 w2 {IMAGE_TEXT} w3 w4 {IMAGE_TEXT} w5 "
    assert prompt_ids == _expected_ids(engine.tokenizer.encode(text), inputs["image_grid_thw"])
    assert engine.count_prompt_tokens(params) == len(prompt_ids)
    expected = assert_greedy_equals_reference(
        engine, params, lambda ids: qwen_vl_reference_logits(reference, ids, inputs), monkeypatch
    )

    shallow = copy.deepcopy(reference)
    with torch.no_grad():  # every deepstack merger's output zero: no deepstack features
        for merger in shallow.model.visual.deepstack_merger_list:
            merger.linear_fc2.weight.zero_()
            merger.linear_fc2.bias.zero_()
    without = qwen_vl_reference_logits(shallow, prompt_ids, inputs)[-1]
    assert (without - expected[0]).abs().max().item() > 100 * TOLERANCE
    with torch.inference_mode():
        flat = reference(
            input_ids=torch.tensor([prompt_ids]), pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"], use_cache=False,
            position_ids=torch.arange(len(prompt_ids))[None].expand(3, 1, -1),
        ).logits[0, -1]  # fmt: skip
    assert (flat - expected[0]).abs().max().item() > 100 * TOLERANCE


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_chunked_prefill_equals_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks of 5 tokens, cut inside the image's run: each chunk's image rows keep
    their deepstack features and their slice of the prompt's positions."""
    import exo.worker.engines.torch.batching.scheduler as scheduler_module

    directory, reference, processor = checkout
    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS_PER_IDLE_STEP", 5)
    engine = vision_engine(directory)
    pictures = [png(60, 40, seed=3)]
    params = image_params(engine, f"w1 {IMAGE_MARKER} w2 w3", pictures, 4)
    inputs = qwen_vl_processed(processor, pictures)
    assert_greedy_equals_reference(
        engine, params, lambda ids: qwen_vl_reference_logits(reference, ids, inputs), monkeypatch
    )


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_positions_equal_transformers_rope_index(checkout: tuple[Path, Any, Any]) -> None:
    """The request's multimodal positions and decode offset are transformers'
    `get_rope_index` for Qwen3-VL (images of several shapes, text between and after)."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    assert_positions_equal_rope_index(engine, reference, processor, STEPS)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_layout_and_patches_follow_the_processor(checkout: tuple[Path, Any, Any]) -> None:
    """The `<|image_pad|>` count from the width and height alone (what the API node counts)
    is the processor's, and exo's patch rows are its `pixel_values` (mean and std 0.5, as
    Qwen3-VL's preprocessor_config.json), for small, large, wide and tall images."""
    directory, _, processor = checkout
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tokens = ImageTokens.of_model(directory, tokenizer)
    assert isinstance(tokens, Qwen3VLImageTokens)
    config = AutoConfig.from_pretrained(directory)
    preprocessing = QwenVLPreprocessing.of_model(directory, config, tokens)
    assert preprocessing.pixels.mean == (0.5, 0.5, 0.5)
    assert_layout_and_patches_follow(tokens, preprocessing, processor, MERGE)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_text_model_interleaves_whatever_the_config_says(checkout: tuple[Path, Any, Any]) -> None:
    """transformers' Qwen3-VL always interleaves its rotary sections: the engine's text
    model (Qwen3's decoder, aliased) says so even for a config without `mrope_interleaved`."""
    from exo.shared.models.skeleton import empty_model

    config = AutoConfig.from_pretrained(checkout[0])
    del config.text_config.rope_parameters["mrope_interleaved"]
    model = empty_model(config)
    assert type(model).__name__ == "Qwen3ForCausalLM"
    assert model.config.rope_parameters["mrope_interleaved"] is True
    assert model.config.rope_parameters["mrope_section"] == [3, 3, 2]


@pytest.mark.parametrize("typed", [IMAGE_TEXT, "<|image_pad|>"])
def test_typed_image_tokens_are_text(
    checkout: tuple[Path, Any, Any],
    float32_kv: None,
    monkeypatch: pytest.MonkeyPatch,
    typed: str,
) -> None:
    """A user's typed `<|vision_start|><|image_pad|><|vision_end|>` (or `<|image_pad|>`)
    is ordinary text: without an image the prompt holds no image token and is answered as
    transformers answers those tokens; with one image part exactly one image is placed."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)

    def reference_logits(ids: list[int], pictures: list[bytes]) -> torch.Tensor:
        inputs = qwen_vl_processed(processor, pictures) if pictures else None
        return qwen_vl_reference_logits(reference, ids, inputs)

    assert_typed_image_text_stays_text(
        engine, typed, png(60, 40, seed=5), reference_logits, monkeypatch
    )
