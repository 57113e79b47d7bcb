"""Gemma 3 images through the engine's batch step (`model/gemma3_vision.py`,
`batching/prompt_images.py`): a tiny random `Gemma3ForConditionalGeneration` in float32,
its text model on the direct forward and its vision tower beside it, against transformers'
forward over the same pixel values (exo's own preprocessing feeds both)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from PIL import Image
from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

from exo.chat_protocol.image_tokens import Gemma3ImageTokens
from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.memory import kv_geometry_of_config
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
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
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.direct_forward import enable_lean_forward
from exo.worker.engines.torch.model.families import family_by_name
from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder, ImagePreprocessing

TOLERANCE = 1e-4  # float32 logits, as the other families' lean-forward tests
VOCAB = 300
BEGIN, END, SOFT, NEWLINES = 290, 291, 292, (108,)
STEPS = 16


def _png(width: int, height: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def models() -> tuple[Any, Any, Gemma3VisionEncoder]:
    """(transformers' multimodal model, exo's text model with the direct forward, encoder)."""
    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "sliding_window": 24, "max_position_embeddings": 512,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
        },
        mm_tokens_per_image=4, boi_token_index=BEGIN, eoi_token_index=END,
        image_token_index=SOFT,
    )  # fmt: skip
    reference = Gemma3ForConditionalGeneration(config).float().eval()
    # transformers starts the projection at zero: random, so images move the logits.
    with torch.no_grad():
        reference.model.multi_modal_projector.mm_input_projection_weight.normal_(0.0, 0.5)
    text = Gemma3ForCausalLM(cast(Any, config.text_config)).float().eval()
    text.model.load_state_dict(reference.model.language_model.state_dict())
    text.lm_head.weight = text.model.embed_tokens.weight
    encoder = Gemma3VisionEncoder(
        config, reference.model.vision_tower, reference.model.multi_modal_projector
    )
    family = family_by_name("gemma3")
    assert enable_lean_forward(text, family) is not None
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
        chooser=_RecordingChooser(),
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


class _RecordingChooser(TokenChooser):
    """Greedy, keeping every row of logits it chose from."""

    def __init__(self) -> None:
        super().__init__(Sampler(SamplingParams()))
        self.rows: list[torch.Tensor] = []

    def choose(self, logits: Any) -> int:
        self.rows.append(logits.detach().clone().reshape(-1))
        return super().choose(logits)


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
    pictures = [_png(40, 24, seed=1), _png(17, 50, seed=2)]
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
    pictures = [_png(40, 24, seed=1), _png(17, 50, seed=2)]
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
    ids, images, _ = _prompt(encoder, [_png(40, 24, seed=1), _png(17, 50, seed=2)])
    _run(scheduler, [_request(ids, images, "first")])
    other_ids, other_images, _ = _prompt(encoder, [_png(40, 24, seed=3), _png(17, 50, seed=2)])
    assert other_ids == ids
    other = _request(other_ids, other_images, "other")
    [other_rows] = _run(scheduler, [other])
    assert 0 < other.cached_tokens <= images[0].start
    [fresh] = _run(_scheduler(text), [_request(other_ids, other_images, "fresh")])
    assert (torch.stack(other_rows) - torch.stack(fresh)).abs().max().item() < TOLERANCE
    again = _request(ids, images, "again")
    _run(scheduler, [again])
    assert again.cached_tokens > images[-1].end


def _save_checkout(directory: Path, text: Any, encoder: Gemma3VisionEncoder) -> Path:
    """A Gemma 3 4B-style checkout of the tiny model: text tensors under `language_model.`,
    the tower's and projector's at the top, a word-level tokenizer whose image tokens have
    the config's ids, and a template writing each message's content."""
    from safetensors.torch import save_file
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"language_model.{name}": tensor.detach().clone().contiguous()
        for name, tensor in text.state_dict().items()
        if name != "lm_head.weight"  # tied
    }
    tensors.update(
        {
            name: tensor.detach().clone().contiguous()
            for name, tensor in encoder.state_dict().items()
        }
    )
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = encoder.config.to_dict()
    config["architectures"] = ["Gemma3ForConditionalGeneration"]
    config["text_config"].update({"bos_token_id": 1, "eos_token_id": 2})
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    specials = {"<start_of_image>": BEGIN, "<end_of_image>": END, "<image_soft_token>": SOFT}
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    tokenizer = Tokenizer(WordLevel({**vocabulary, **specials}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    template = "<s>{% for message in messages %}{{ message.content }} {% endfor %}"
    (directory / "chat_template.jinja").write_text(template)
    return directory


def _image_input(data: bytes) -> ImageInput:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImageInput(
        data=data, media_type="image/png", width=width, height=height,
        sha256=hashlib.sha256(data).hexdigest(),
    )  # fmt: skip


def test_engine_loads_the_tower_and_renders_image_markers(
    models: tuple[Any, Any, Gemma3VisionEncoder], tmp_path: Path, float32_kv: None
) -> None:
    """A Gemma3ForConditionalGeneration checkout with a "vision" card: the engine loads
    the tower from the checkpoint, turns each `IMAGE_MARKER` into the image's tokens,
    counts them in usage and the token count, and generates transformers' greedy tokens."""
    reference, text, encoder = models
    directory = _save_checkout(tmp_path / "gemma3-vision", text, encoder)
    card = card_from_local_directory(directory).model_copy(
        update={"capabilities": ("text", "vision")}
    )
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, weight_dtype="float32")
    assert engine.images is not None
    pictures = [_png(40, 24, seed=1), _png(17, 50, seed=2)]
    message = ChatMessage(
        role="user",
        content=f"w1 w2 {IMAGE_MARKER} w3 w4 w5 {IMAGE_MARKER} w6",
        images=tuple(_image_input(picture) for picture in pictures),
    )
    params = TextGenerationTaskParams(
        model=ModelId(card.model_id), messages=(message,), max_tokens=STEPS, temperature=0.0
    )
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
    text_only = TorchEngine.load(
        directory, shard.model_copy(update={"model_card": card.model_copy(
            update={"capabilities": ("text",)})}), weight_dtype="float32",
    )  # fmt: skip
    assert text_only.images is None
    with pytest.raises(ValueError, match="takes no images"):
        text_only.render_prompt(params)
