"""Tiny random-weight Qwen-VL checkouts (Qwen2.5-VL, Qwen3-VL) and the checks their tests
share: a word tokenizer with the Qwen-VL image tokens, the published-layout checkout from a
config.json (`save_tiny_qwen2_5_vl`, `save_tiny_qwen3_vl`), transformers' image processor
and logits, and the positions and layout checks (`exo.testing.vision_checkpoints` holds
what every vision family shares)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.vision_checkpoints import (
    image_input,
    image_params,
    perturb_weights,
    png,
    rgb_images,
    save_renamed_tensors,
    save_word_tokenizer,
)
from exo.worker.engines.torch.engine import TorchEngine

# Qwen-VL tiny checkouts (Qwen2.5-VL, Qwen3-VL): their word tokenizer's special tokens, in
# id order after `<unk>`, `</s>` and 41 words, and the template's image part.
QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_START, QWEN_VL_END, QWEN_VL_IMAGE, QWEN_VL_VIDEO = 43, 44, 45, 46
QWEN_VL_IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VL_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"
# The tiny checkouts' image geometry: patches of 8 pixels merged 2 x 2 (16-pixel merged
# patches), resized areas within 32 x 32 .. 64 x 96 pixels.
QWEN_VL_PATCH, QWEN_VL_MERGE = 8, 2
QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS = 32 * 32, 64 * 96
# The tiny Qwen3-VL's tower blocks whose features go to text layers 0 and 1 (deepstack).
QWEN3_VL_DEEPSTACK_LAYERS = (0, 1)


def save_qwen_vl_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A Qwen-VL checkout's word tokenizer (`QWEN_VL_SPECIALS` at `QWEN_VL_START` ..) and a
    template writing each message's content."""
    tokenizer = save_word_tokenizer(
        directory, words=41, specials=QWEN_VL_SPECIALS, template=QWEN_VL_TEMPLATE,
        begin_token=False,
    )  # fmt: skip
    assert tokenizer.encode("<|image_pad|>", add_special_tokens=False) == [QWEN_VL_IMAGE]
    tokenizer.image_token, tokenizer.video_token = "<|image_pad|>", "<|video_pad|>"
    return tokenizer


def qwen_vl_image_processor(
    patch: int, merge: int, min_pixels: int, max_pixels: int, **settings: Any
) -> Any:
    """transformers' Qwen-VL image processor (PIL: `Qwen2VLImageProcessorPil`, which
    Qwen2.5-VL and Qwen3-VL both use) with `patch`-pixel patches, `merge` x `merge` merged
    patches and a resized area within `min_pixels .. max_pixels`; `settings`: others
    (`image_mean`, ...)."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=patch, merge_size=merge, temporal_patch_size=2,
        size={"shortest_edge": min_pixels, "longest_edge": max_pixels}, **settings,
    )  # fmt: skip


def save_qwen_vl_checkout(
    directory: Path,
    published: Mapping[str, Any],
    model_class: Any,
    rename: Callable[[str], str | None],
    processor: Any,
) -> Any:
    """A tiny Qwen-VL checkout in `directory` (its tokenizer already there): `published` as
    its config.json, transformers' `model_class` built from it (seed 0, float32) and
    perturbed, "</s>" (id 1) kept from ever winning so every greedy run takes its full
    length, its tensors saved under the published names (`rename`: transformers' names →
    the checkpoint's, the tied head left out) and the image processor's
    `preprocessor_config.json`.

    Returns:
        transformers' model (the reference).
    """
    from transformers import AutoConfig

    (directory / "config.json").write_text(json.dumps(published))
    torch.manual_seed(0)
    reference = model_class(AutoConfig.from_pretrained(directory)).float().eval()
    perturb_weights(reference)
    with torch.no_grad():
        reference.lm_head.weight[1] = 0.0
    assert reference.lm_head.weight is reference.model.get_input_embeddings().weight
    save_renamed_tensors(reference, directory / "model.safetensors", rename)
    processor.save_pretrained(directory)
    return reference


def qwen_vl_processed(processor: Any, pictures: Sequence[bytes]) -> Any:
    """transformers' Qwen-VL image processor over PNG files (`pixel_values`,
    `image_grid_thw`)."""
    return processor(images=rgb_images(pictures), return_tensors="pt")


def qwen_vl_expected_ids(text_ids: list[int], grids: torch.Tensor, merge: int) -> list[int]:
    """The Qwen-VL processors' expansion of a tokenized text: each `<|image_pad|>` → one per
    merged patch of its image's grid (`image_grid_thw` rows, `merge` patches a side)."""
    counts = iter((grids.prod(-1) // merge**2).tolist())
    ids: list[int] = []
    for token in text_ids:
        ids += [QWEN_VL_IMAGE] * next(counts) if token == QWEN_VL_IMAGE else [token]
    return ids


def qwen_vl_reference_logits(reference: Any, ids: list[int], inputs: Any | None) -> torch.Tensor:
    """transformers' Qwen-VL logits `[len(ids), vocab]` float32 over `ids`, with the
    processed images of `inputs` (None: a text-only prompt)."""
    input_ids = torch.tensor([ids])
    images: dict[str, Any] = {}
    if inputs is not None:
        images = {
            "pixel_values": inputs["pixel_values"], "image_grid_thw": inputs["image_grid_thw"],
            "mm_token_type_ids": (input_ids == QWEN_VL_IMAGE).int(),
        }  # fmt: skip
    with torch.inference_mode():
        output = reference(input_ids=input_ids, use_cache=False, **images)
    return output.logits[0].float()


def assert_positions_equal_rope_index(
    engine: TorchEngine, reference: Any, processor: Any, max_tokens: int
) -> tuple[list[int], Any]:
    """A request with three images of several shapes, text between and after: its
    multimodal positions and decode offset are transformers' `get_rope_index`.

    Returns:
        The request's expanded prompt ids and its `MultimodalPositions`.
    """
    assert engine.images is not None
    pictures = [png(60, 40, seed=1), png(40, 100, seed=2), png(200, 150, seed=4)]
    inputs = qwen_vl_processed(processor, pictures)
    content = f"w1 {IMAGE_MARKER}{IMAGE_MARKER} w2 w3 {IMAGE_MARKER} w4 w5 w6"
    ids = engine.render_prompt(image_params(engine, content, pictures, max_tokens)).token_ids
    positions = engine.images.multimodal_positions(ids, [image_input(p) for p in pictures])
    assert positions is not None
    input_ids = torch.tensor([ids])
    expected, deltas = reference.model.get_rope_index(
        input_ids, (input_ids == QWEN_VL_IMAGE).int(), image_grid_thw=inputs["image_grid_thw"]
    )
    assert torch.equal(positions.prompt, expected[:, 0])
    assert positions.delta == int(deltas[0, 0])
    return ids, positions


def assert_layout_and_patches_follow(
    tokens: Any, preprocessing: Any, processor: Any, merge: int
) -> None:
    """For small (scaled up), large (scaled down), wide and tall images: the `<|image_pad|>`
    count from the width and height alone (`tokens.sequence`, what the API node counts) is
    the processor's, and exo's patch rows and grid (`preprocessing.patches`) are its
    `pixel_values` (within 1e-5) and `image_grid_thw`."""
    for width, height in ((1, 1), (16, 16), (17, 33), (60, 40), (65, 64), (200, 41), (30, 500)):
        picture = png(width, height, seed=3)
        inputs = qwen_vl_processed(processor, [picture])
        grid = inputs["image_grid_thw"][0]
        assert len(tokens.sequence((width, height))) == int(grid.prod()) // merge**2
        patches, exo_grid = preprocessing.patches(picture)
        assert list(exo_grid) == grid.tolist(), (width, height)
        assert (patches - inputs["pixel_values"]).abs().max().item() < 1e-5, (width, height)


def _qwen2_5_vl_published_name(name: str) -> str | None:
    """transformers' saved name → the published Qwen2.5-VL checkpoint's (None for the tied
    head, which the files leave out)."""
    if name.startswith("lm_head."):
        return None
    if name.startswith("model.language_model."):
        return "model." + name.removeprefix("model.language_model.")
    return name.removeprefix("model.")  # model.visual.… → visual.…


def save_tiny_qwen2_5_vl(directory: Path) -> tuple[Any, Any]:
    """A tiny Qwen2.5-VL checkout in `directory` in the published layout (Qwen2.5-VL-3B-
    Instruct's config.json: text fields at the top, `rope_scaling` with its mrope sections,
    the head tied to the embedding, no `lm_head` tensor in the files; 2 text layers of 64, a
    2-block tower).

    Returns:
        (transformers' model, transformers' image processor).
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer = save_qwen_vl_tokenizer(directory)
    published = {
        "architectures": ["Qwen2_5_VLForConditionalGeneration"], "model_type": "qwen2_5_vl",
        "vocab_size": len(tokenizer), "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "sliding_window": 32768, "use_sliding_window": False,
        "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 1,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        "image_token_id": QWEN_VL_IMAGE, "video_token_id": QWEN_VL_VIDEO,
        "vision_start_token_id": QWEN_VL_START, "vision_end_token_id": QWEN_VL_END,
        "vision_config": {
            "depth": 2, "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "in_chans": 3, "out_hidden_size": 64, "patch_size": QWEN_VL_PATCH,
            "spatial_merge_size": QWEN_VL_MERGE, "temporal_patch_size": 2, "window_size": 32,
            "fullatt_block_indexes": [1], "tokens_per_second": 2,
        },
    }  # fmt: skip
    processor = qwen_vl_image_processor(
        QWEN_VL_PATCH, QWEN_VL_MERGE, QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS
    )
    reference = save_qwen_vl_checkout(
        directory, published, Qwen2_5_VLForConditionalGeneration, _qwen2_5_vl_published_name,
        processor,
    )  # fmt: skip
    return reference, processor


def _qwen3_vl_published_name(name: str) -> str | None:
    """transformers' saved name is the published Qwen3-VL checkpoint's; the tied head is
    left out of the files, as published."""
    return None if name.startswith("lm_head.") else name


def save_tiny_qwen3_vl(directory: Path) -> tuple[Any, Any]:
    """A tiny Qwen3-VL checkout in `directory` in the published layout (Qwen3-VL-4B-
    Instruct's config.json: nested text and vision configs, `rope_scaling` with interleaved
    mrope sections, the head tied to the embedding, no `lm_head` tensor in the files; 3
    text layers of 64, a 3-block tower whose blocks `QWEN3_VL_DEEPSTACK_LAYERS` feed text
    layers 0 and 1).

    Returns:
        (transformers' model, transformers' image processor).
    """
    from transformers import Qwen3VLForConditionalGeneration

    tokenizer = save_qwen_vl_tokenizer(directory)
    published = {
        "architectures": ["Qwen3VLForConditionalGeneration"], "model_type": "qwen3_vl",
        "image_token_id": QWEN_VL_IMAGE, "video_token_id": QWEN_VL_VIDEO,
        "vision_start_token_id": QWEN_VL_START, "vision_end_token_id": QWEN_VL_END,
        "tie_word_embeddings": True,
        "text_config": {
            "model_type": "qwen3_vl_text", "vocab_size": len(tokenizer), "hidden_size": 64,
            "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
            "rope_theta": 5000000, "tie_word_embeddings": True, "bos_token_id": None,
            "eos_token_id": 1,
            "rope_scaling": {
                "mrope_interleaved": True, "mrope_section": [3, 3, 2], "rope_type": "default",
            },
        },
        "vision_config": {
            "model_type": "qwen3_vl", "depth": 3, "hidden_size": 32, "intermediate_size": 64,
            "num_heads": 2, "in_channels": 3, "out_hidden_size": 64, "patch_size": QWEN_VL_PATCH,
            "spatial_merge_size": QWEN_VL_MERGE, "temporal_patch_size": 2,
            "num_position_embeddings": 16, "hidden_act": "gelu_pytorch_tanh",
            "deepstack_visual_indexes": list(QWEN3_VL_DEEPSTACK_LAYERS),
        },
    }  # fmt: skip
    processor = qwen_vl_image_processor(
        QWEN_VL_PATCH, QWEN_VL_MERGE, QWEN_VL_MIN_PIXELS, QWEN_VL_MAX_PIXELS,
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )  # fmt: skip
    reference = save_qwen_vl_checkout(
        directory, published, Qwen3VLForConditionalGeneration, _qwen3_vl_published_name,
        processor,
    )  # fmt: skip
    return reference, processor
