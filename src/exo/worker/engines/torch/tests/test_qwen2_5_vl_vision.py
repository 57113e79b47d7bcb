"""Qwen2.5-VL images through the engine's real path (`model/qwen2_5_vl_vision.py`,
`chat_protocol/image_tokens/`, multimodal rotary positions in the batch and the direct
forward): a tiny random `Qwen2_5_VLForConditionalGeneration` saved in the published layout
(flat config.json; text model as Qwen2's `model.`, tower under `visual.`, the head tied),
loaded by `TorchEngine.load` (Qwen2 text model on the direct forward, tower beside it),
against transformers' own model fed by transformers' own image processor (its patches and
grids; its `<|image_pad|>` expansion rebuilt from the grids), float32."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import ImageTokens, QwenVLImageTokens
from exo.shared.types.text_generation import IMAGE_MARKER, TextGenerationTaskParams
from exo.testing.qwen_vl_checkpoints import (
    QWEN_VL_IMAGE,
    QWEN_VL_IMAGE_TEXT,
    QWEN_VL_MERGE,
    assert_layout_and_patches_follow,
    assert_positions_equal_rope_index,
    qwen_vl_expected_ids,
    qwen_vl_processed,
    qwen_vl_reference_logits,
    save_tiny_qwen2_5_vl,
)
from exo.testing.vision_checkpoints import (
    TOLERANCE,
    assert_greedy_equals_reference,
    assert_same_tokens_and_logprobs,
    assert_typed_image_text_stays_text,
    image_params,
    png,
    vision_engine,
)
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.qwen2_5_vl_vision import QwenVLPreprocessing

STEPS = 6
MERGE = QWEN_VL_MERGE  # merged patches of 16 pixels
IMAGE_TEXT = QWEN_VL_IMAGE_TEXT


@pytest.fixture(scope="module")
def checkout(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any, Any]:
    """(the saved checkout, transformers' model, transformers' image processor)."""
    directory = tmp_path_factory.mktemp("qwen2_5_vl")
    reference, processor = save_tiny_qwen2_5_vl(directory)
    return directory, reference, processor


def _expected_ids(text_ids: list[int], grids: torch.Tensor) -> list[int]:
    return qwen_vl_expected_ids(text_ids, grids, MERGE)


def _params(engine: TorchEngine, content: str, pictures: list[bytes]) -> TextGenerationTaskParams:
    return image_params(engine, content, pictures, STEPS)


def _check_against_transformers(
    engine: TorchEngine, checkout: tuple[Path, Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A wide 60 x 40 and a tall 40 x 100 image (2 x 4 and 6 x 2 merged patches): the
    engine's prompt is the processor's, every step's logits within `TOLERANCE` of
    transformers' (teacher-forced on exo's tokens), its greedy tokens transformers'."""
    _, reference, processor = checkout
    pictures = [png(60, 40, seed=1), png(40, 100, seed=2)]
    params = _params(engine, f"w1 w2 {IMAGE_MARKER} w3 w4 {IMAGE_MARKER} w5", pictures)
    prompt_ids = engine.render_prompt(params).token_ids
    inputs = qwen_vl_processed(processor, pictures)
    assert inputs["image_grid_thw"].tolist() == [[1, 4, 8], [1, 12, 4]]
    text = f"w1 w2 {IMAGE_TEXT} w3 w4 {IMAGE_TEXT} w5 "
    assert prompt_ids == _expected_ids(engine.tokenizer.encode(text), inputs["image_grid_thw"])
    assert engine.count_prompt_tokens(params) == len(prompt_ids)
    assert_greedy_equals_reference(
        engine, params, lambda ids: qwen_vl_reference_logits(reference, ids, inputs), monkeypatch
    )


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_two_images_equal_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One prefill, then decode steps after the images (their positions: the prompt's
    largest + 1 on); the images and their positions matter."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    assert engine.images is not None and engine.images.multimodal_rotary
    # The API node reads the layout from the files (`token_counting`): the runner's own.
    assert engine.images.tokens == ImageTokens.of_model(directory, engine.tokenizer)
    _check_against_transformers(engine, checkout, monkeypatch)
    # Without the images' features, or with 1-D positions, the last prompt row differs.
    pictures = [png(60, 40, seed=1), png(40, 100, seed=2)]
    inputs = qwen_vl_processed(processor, pictures)
    ids = _expected_ids(
        engine.tokenizer.encode(f"w1 {IMAGE_TEXT} w2 {IMAGE_TEXT} w3"), inputs["image_grid_thw"]
    )
    real = qwen_vl_reference_logits(reference, ids, inputs)[-1]
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    assert (
        qwen_vl_reference_logits(reference, ids, blank)[-1] - real
    ).abs().max() > 100 * TOLERANCE
    with torch.inference_mode():
        flat = reference(
            input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"],
            image_grid_thw=inputs["image_grid_thw"], use_cache=False,
            position_ids=torch.arange(len(ids))[None].expand(3, 1, -1),
        ).logits[0, -1]  # fmt: skip
    assert (flat - real).abs().max() > 100 * TOLERANCE


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_chunked_prefill_equals_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prefill chunks of 5 tokens, cut inside both images' runs: each chunk's rows take
    their own slice of the prompt's positions."""
    import exo.worker.engines.torch.batching.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS_PER_IDLE_STEP", 5)
    _check_against_transformers(vision_engine(checkout[0]), checkout, monkeypatch)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_text_and_image_requests_share_steps(
    checkout: tuple[Path, Any, Any], float32_kv: None
) -> None:
    """A text-only request and an image request decoding in the same steps (one with
    multimodal positions, one without): each gives the tokens and logprobs it gives alone."""
    engine = vision_engine(checkout[0])
    text = _params(engine, "w1 w2 w3 w4", []).model_copy(
        update={"logprobs": True, "top_logprobs": 1}
    )
    image = _params(engine, f"w5 {IMAGE_MARKER} w6", [png(40, 100, seed=3)]).model_copy(
        update={"logprobs": True, "top_logprobs": 1}
    )
    alone = [list(engine.generate(params)) for params in (text, image)]
    handles = [engine.submit(params) for params in (text, image)]
    outputs: dict[str, list[Any]] = {handle.request_id: [] for handle in handles}
    for _ in range(200):
        if not engine.has_work:
            break
        for request_id, piece in engine.step():
            outputs[request_id].append(piece)
    assert not engine.has_work
    for handle, solo in zip(handles, alone, strict=True):
        assert_same_tokens_and_logprobs(outputs[handle.request_id], solo)


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_positions_equal_transformers_rope_index(checkout: tuple[Path, Any, Any]) -> None:
    """The request's multimodal positions and decode offset are transformers'
    `get_rope_index` (images of several shapes, text between and after)."""
    directory, reference, processor = checkout
    engine = vision_engine(directory)
    ids, positions = assert_positions_equal_rope_index(engine, reference, processor, STEPS)
    assert torch.equal(positions.rows(len(ids) - 1, 3)[:, 1:], positions.rows(len(ids), 2))


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_layout_and_patches_follow_the_processor(checkout: tuple[Path, Any, Any]) -> None:
    """The `<|image_pad|>` count from the width and height alone (what the API node counts)
    is the processor's, and exo's patch rows are its `pixel_values`, for small (scaled
    up), large (scaled down), wide and tall images; a side over 200 times the other is
    refused."""
    directory, _, processor = checkout
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    tokens = ImageTokens.of_model(directory, tokenizer)
    assert isinstance(tokens, QwenVLImageTokens)
    assert_layout_and_patches_follow(tokens, QwenVLPreprocessing(tokens), processor, MERGE)
    with pytest.raises(ValueError, match="200 times"):
        tokens.sequence((2, 500))


@pytest.mark.slow  # the default run checks one vision family, Gemma 3 (docs/testing.md)
def test_prefix_cache_reuses_positions_after_an_image(
    checkout: tuple[Path, Any, Any], float32_kv: None
) -> None:
    """A second request with the same image and a longer text reuses the KV past the image
    (whose keys were rotated at multimodal positions) and continues at the right positions;
    one with another image of the same size shares KV only before it. Each gives a fresh
    engine's tokens and logprobs."""
    directory = checkout[0]
    engine = vision_engine(directory)
    first, other = png(40, 100, seed=3), png(40, 100, seed=6)

    def params(picture: bytes, tail: str) -> TextGenerationTaskParams:
        return _params(engine, f"w1 w2 {IMAGE_MARKER} w3 {tail}", [picture]).model_copy(
            update={"logprobs": True, "top_logprobs": 1}
        )

    list(engine.generate(params(first, "w4")))
    for request, shared in ((params(first, "w4 w5 w6"), True), (params(other, "w4"), False)):
        handle = engine.submit(request)
        pieces: list[Any] = []
        while engine.has_work:
            pieces += [output for _, output in engine.step()]
        prompt_ids = engine.render_prompt(request).token_ids
        first_image = prompt_ids.index(QWEN_VL_IMAGE)
        last_image = len(prompt_ids) - 1 - prompt_ids[::-1].index(QWEN_VL_IMAGE)
        assert handle.cached_tokens is not None
        if shared:
            assert handle.cached_tokens > last_image
        else:
            assert 0 < handle.cached_tokens <= first_image
        assert_same_tokens_and_logprobs(pieces, list(vision_engine(directory).generate(request)))


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
