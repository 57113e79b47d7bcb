"""Tiny random-weight Qwen-VL checkouts (Qwen2.5-VL, Qwen3-VL) and the checks their tests
share: a word tokenizer with the Qwen-VL image tokens, the published-layout checkout from a
config.json, transformers' image processor and logits, and the positions, layout and split
instance checks (`exo.testing.vision_checkpoints` holds what every vision family shares)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerFast

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.vision_checkpoints import (
    image_input,
    image_params,
    perturb_weights,
    png,
    rgb_images,
    save_renamed_tensors,
    save_word_tokenizer,
    vision_engine,
)
from exo.worker.engines.torch.engine import TorchEngine

# Qwen-VL tiny checkouts (Qwen2.5-VL, Qwen3-VL): their word tokenizer's special tokens, in
# id order after `<unk>`, `</s>` and 41 words, and the template's image part.
QWEN_VL_SPECIALS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
QWEN_VL_START, QWEN_VL_END, QWEN_VL_IMAGE, QWEN_VL_VIDEO = 43, 44, 45, 46
QWEN_VL_IMAGE_TEXT = "<|vision_start|><|image_pad|><|vision_end|>"
QWEN_VL_TEMPLATE = "{% for message in messages %}{{ message.content }} {% endfor %}"


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


def split_vision_rank_main(
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    model_dir: str,
    layers: Sequence[tuple[int, int]],
    max_tokens: int,
) -> None:
    """A spawned rank of a pipeline over a vision checkout (`run_rank_processes`), rank
    `rank` holding decoder layers `layers[rank]` `(start, end)`: rank 0 reports
    `("rank 0", whether it keeps no tower, why it refuses an image (empty: it does not),
    its `max_tokens` greedy tokens for "w1 w2 w3")`; every rank reports `("done", ...)` or
    `("error", ..., traceback)`."""
    import traceback

    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        directory = Path(model_dir)
        card = card_from_local_directory(directory).model_copy(
            update={"capabilities": ("text", "vision")}
        )
        start, end = layers[rank]
        shard = ShardMetadata(
            sharding="pipeline", model_card=card, device_rank=rank, world_size=world_size,
            start_layer=start, end_layer=end,
        )  # fmt: skip
        engine = load_engine(directory, shard, weight_dtype="float32")
        if rank != 0:
            engine.serve_forever()
        else:
            refusal = ""
            try:
                picture = png(60, 40, 1)
                engine.render_prompt(
                    image_params(engine, f"w1 {IMAGE_MARKER}", [picture], max_tokens)
                )
            except ValueError as error:
                refusal = str(error)
            text = image_params(engine, "w1 w2 w3", [], max_tokens)
            tokens = [t for p in engine.generate(text) for t in p.token_ids]
            results.put(("rank 0", engine.images is None, refusal, tokens))
            engine.shutdown()
        results.put(("done", "", rank, None))
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))
    finally:
        destroy_group()


def assert_split_pipeline_refuses_images(
    directory: Path, layers: Sequence[tuple[int, int]], max_tokens: int, deadline_s: float
) -> None:
    """A pipeline of `len(layers)` spawned ranks over the checkout in `directory` whose
    family places image tokens by multimodal rotary positions (which the ranks' steps do
    not carry): rank 0 keeps no tower and refuses images (a ValueError: 400) saying why,
    and text gives the single process's greedy tokens."""
    from exo.testing.rank_processes import run_rank_processes

    single = vision_engine(directory)
    text = image_params(single, "w1 w2 w3", [], max_tokens)
    expected = [t for p in single.generate(text) for t in p.token_ids]
    reports = run_rank_processes(
        split_vision_rank_main, (str(directory), layers, max_tokens), len(layers), deadline_s
    )
    [(_, no_tower, refusal, tokens)] = [report for report in reports if report[0] == "rank 0"]
    assert no_tower
    assert "multimodal rotary positions" in refusal
    assert tokens == expected
