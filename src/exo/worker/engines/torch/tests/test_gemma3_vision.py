"""Gemma 3 images through the engine's batch step (`model/gemma3_vision.py`,
`batching/prompt_images.py`): a tiny random `Gemma3ForConditionalGeneration` in float32,
its text model on the direct forward and its vision tower beside it, against transformers'
forward over the same pixel values (exo's own preprocessing feeds both)."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.chat_protocol.image_tokens import Gemma3ImageTokens
from exo.shared.models.kv_cache_memory import kv_geometry_of_config
from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.vision_checkpoints import (
    GEMMA3_BEGIN,
    GEMMA3_END,
    GEMMA3_NEWLINES,
    GEMMA3_SOFT,
    TOLERANCE,
    RecordingChooser,
    assert_typed_image_text_stays_text,
    image_params,
    png,
    save_gemma3_checkout,
    tiny_gemma3_vision,
    vision_engine,
)
from exo.worker.engines.torch.batching.batch_attention import (
    attention_layers,
    use_batched_attention,
)
from exo.worker.engines.torch.batching.prefix_cache import PrefixCache
from exo.worker.engines.torch.batching.prompt_images import PromptImage
from exo.worker.engines.torch.batching.request_state import RequestState
from exo.worker.engines.torch.batching.scheduler import BatchScheduler
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.model.direct_forward import enable_lean_forward
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder, ImagePreprocessing

BEGIN, END, SOFT, NEWLINES = GEMMA3_BEGIN, GEMMA3_END, GEMMA3_SOFT, GEMMA3_NEWLINES
STEPS = 16


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any, Gemma3VisionEncoder]:
    """(transformers' multimodal model, exo's text model with the direct forward, encoder)."""
    reference, text, encoder = tiny_gemma3_vision()
    assert enable_lean_forward(text, family_by_name("gemma3")) is not None
    return reference, text, encoder


def _scheduler(text: Any) -> BatchScheduler:
    family = family_by_name("gemma3")
    windows = family.attention_windows(text.config)
    geometry = kv_geometry_of_config(text.config, len(windows))
    use_batched_attention(text)
    cache = SlotKVCache(
        geometry.layers, geometry.kv_heads, geometry.head_dim, torch.float32,
        torch.device("cpu"), 2, geometry.latent_values, windows,
    )  # fmt: skip
    scheduler = BatchScheduler(
        text, cache, windows, attention_layers(text), 4096, PrefixCache(4096),
        torch.device("cpu"),
    )  # fmt: skip
    return scheduler


def _request(prompt: list[int], images: tuple[PromptImage, ...], name: str) -> RequestState:
    return RequestState(
        request_id=name,
        prompt_ids=prompt,
        max_new_tokens=STEPS,
        chooser=RecordingChooser(),
        top_logprobs=None,
        detokenizer=StreamingDetokenizer(lambda ids: "", prompt),
        stop_matcher=StopSequenceMatcher(()),
        eos_token_ids=frozenset(),
        logprob_of=lambda *_: None,  # type: ignore[arg-type]
        images=images,
    )


def _prompt(
    encoder: Gemma3VisionEncoder, pictures: list[bytes]
) -> tuple[list[int], tuple[PromptImage, ...], torch.Tensor]:
    """Text, image, text, image, text: (expanded ids, images, pixel values [n, 3, 32, 32])."""
    text = [2, 10, 11, 12, BEGIN, 13, 14, 15, 16, 17, BEGIN, 18, 19, 20]
    tokens = Gemma3ImageTokens(BEGIN, SOFT, END, NEWLINES, 4, "<start_of_image>")
    ids, spans = tokens.expand(text, [(32, 32)] * len(pictures))  # one sequence for any size
    starts = [start for [(start, _)] in spans]
    preprocessing = ImagePreprocessing(32, 32)
    pixels = torch.stack([preprocessing.pixel_values(picture) for picture in pictures])
    embeddings = encoder(pixels)
    images = tuple(
        PromptImage(start, rows, hashlib.sha256(picture).hexdigest())
        for start, rows, picture in zip(starts, embeddings, pictures, strict=True)
    )
    return ids, images, pixels


def _run(scheduler: BatchScheduler, requests: list[RequestState]) -> list[list[torch.Tensor]]:
    """Step until every request finished; each request's logits rows, in order."""
    for request in requests:
        scheduler.add(request)
    for _ in range(500):
        if not scheduler.has_work:
            break
        scheduler.step()
    assert all(request.finished for request in requests)
    return [request.chooser.rows for request in requests]  # type: ignore[attr-defined]


def _reference_logits(reference: Any, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([ids])
    with torch.inference_mode():
        output = reference(
            input_ids=input_ids, pixel_values=pixels,
            token_type_ids=(input_ids == SOFT).long(), use_cache=False,
        )  # fmt: skip
    return output.logits[0].float()


def test_two_images_equal_transformers(models: tuple[Any, Any, Gemma3VisionEncoder]) -> None:
    """Two images of different sizes (both resized to the tower's 32 x 32), 16 greedy
    steps: every step's logits within `TOLERANCE` of transformers' (teacher-forced on exo's
    tokens, one forward over prompt and reply) and usage counting the image tokens."""
    reference, text, encoder = models
    pictures = [png(40, 24, seed=1), png(17, 50, seed=2)]
    ids, images, pixels = _prompt(encoder, pictures)
    request = _request(ids, images, "two-images")
    [rows] = _run(_scheduler(text), [request])
    assert len(rows) == STEPS
    sequence = ids + request.generated_ids[:-1]
    expected = _reference_logits(reference, sequence, pixels)[len(ids) - 1 :]
    got = torch.stack(rows)
    assert (got - expected).abs().max().item() < TOLERANCE
    assert request.generated_ids == expected.argmax(-1).tolist()
    # Without the images' features the logits differ (the override is what is compared).
    plain = _reference_logits(reference, ids, torch.zeros_like(pixels))[-1]
    assert (plain - got[0]).abs().max().item() > TOLERANCE
    assert request._final("", None).usage.prompt_tokens == len(ids)  # type: ignore[union-attr]


@pytest.mark.parametrize("chunk", [3, 7])
def test_chunked_prefill_equals_unchunked(
    models: tuple[Any, Any, Gemma3VisionEncoder], monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    """Prefill in chunks smaller than an image (never ending inside one) = one chunk."""
    _, text, encoder = models
    pictures = [png(40, 24, seed=1), png(17, 50, seed=2)]
    ids, images, _ = _prompt(encoder, pictures)
    [whole] = _run(_scheduler(text), [_request(ids, images, "whole")])
    import exo.worker.engines.torch.batching.scheduler as scheduler_module

    monkeypatch.setattr(scheduler_module, "PREFILL_TOKENS_PER_IDLE_STEP", chunk)
    [chunked] = _run(_scheduler(text), [_request(ids, images, "chunked")])
    assert (torch.stack(whole) - torch.stack(chunked)).abs().max().item() < TOLERANCE


def test_prefix_cache_keys_on_image_bytes(models: tuple[Any, Any, Gemma3VisionEncoder]) -> None:
    """Two prompts with the same tokens and different images share KV only before the first
    image token; the same image again shares the whole prompt but its last token."""
    _, text, encoder = models
    scheduler = _scheduler(text)
    ids, images, _ = _prompt(encoder, [png(40, 24, seed=1), png(17, 50, seed=2)])
    _run(scheduler, [_request(ids, images, "first")])
    other_ids, other_images, _ = _prompt(encoder, [png(40, 24, seed=3), png(17, 50, seed=2)])
    assert other_ids == ids
    other = _request(other_ids, other_images, "other")
    [other_rows] = _run(scheduler, [other])
    assert 0 < other.cached_tokens <= images[0].start
    [fresh] = _run(_scheduler(text), [_request(other_ids, other_images, "fresh")])
    assert (torch.stack(other_rows) - torch.stack(fresh)).abs().max().item() < TOLERANCE
    again = _request(ids, images, "again")
    _run(scheduler, [again])
    assert again.cached_tokens > images[-1].end


def test_engine_loads_the_tower_and_renders_image_markers(
    models: tuple[Any, Any, Gemma3VisionEncoder], tmp_path: Path, float32_kv: None
) -> None:
    """A Gemma3ForConditionalGeneration checkout with a "vision" card: the engine loads
    the tower from the checkpoint, turns each `IMAGE_MARKER` into the image's tokens,
    counts them in usage and the token count, and generates transformers' greedy tokens."""
    reference, text, encoder = models
    directory = save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder)
    engine = vision_engine(directory)
    assert engine.images is not None
    pictures = [png(40, 24, seed=1), png(17, 50, seed=2)]
    content = f"w1 w2 {IMAGE_MARKER} w3 w4 w5 {IMAGE_MARKER} w6"
    params = image_params(engine, content, pictures, STEPS)
    prompt_ids = engine.render_prompt(params).token_ids
    assert prompt_ids.count(SOFT) == 2 * 4 and prompt_ids.count(BEGIN) == 2
    assert engine.count_prompt_tokens(params) == len(prompt_ids)
    pieces = list(engine.generate(params))
    usage = pieces[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt_ids)
    generated = [token for piece in pieces for token in piece.token_ids]
    preprocessing = ImagePreprocessing(32, 32)
    pixels = torch.stack([preprocessing.pixel_values(picture) for picture in pictures])
    expected = _reference_logits(reference, prompt_ids + generated[:-1], pixels)
    assert generated == expected[len(prompt_ids) - 1 :].argmax(-1).tolist()
    # A model whose card lacks "vision" gets no tower and refuses images (a ValueError: 400).
    text_only = vision_engine(directory, ("text",))
    assert text_only.images is None
    with pytest.raises(ValueError, match="takes no images"):
        text_only.render_prompt(params)


@pytest.mark.parametrize("typed", ["<start_of_image>", "<image_soft_token>"])
def test_typed_image_tokens_are_text(
    models: tuple[Any, Any, Gemma3VisionEncoder],
    tmp_path: Path,
    float32_kv: None,
    monkeypatch: pytest.MonkeyPatch,
    typed: str,
) -> None:
    """A user's typed `<start_of_image>` (or `<image_soft_token>`) is ordinary text:
    without an image the prompt holds no image token and is answered as transformers
    answers those tokens; with one image part exactly one image is placed."""
    reference, text, encoder = models
    engine = vision_engine(save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder))
    preprocessing = ImagePreprocessing(32, 32)

    def reference_logits(ids: list[int], pictures: list[bytes]) -> torch.Tensor:
        if not pictures:
            with torch.inference_mode():
                return reference(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
        pixels = torch.stack([preprocessing.pixel_values(picture) for picture in pictures])
        return _reference_logits(reference, ids, pixels)

    assert_typed_image_text_stays_text(
        engine, typed, png(40, 24, seed=5), reference_logits, monkeypatch
    )
