"""Tiny random-weight vision checkpoints and the pieces every vision family's test shares:
random PNG images, their `ImageInput`, a word-level tokenizer with a family's image tokens, a
single-rank engine over a saved checkout, a greedy chooser that keeps its logits, and the
check of an engine's greedy run against transformers' logits (teacher-forced on exo's
tokens).

Gemma 3's tiny checkout (`tiny_gemma3_vision`, `save_gemma3_checkout`) lives here too: the
single-rank test and the split-instance test build the same one; the Qwen-VL families' are
in `exo.testing.qwen_vl_checkpoints`.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from PIL import Image
from transformers import PreTrainedTokenizerFast

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
)
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.engine import TorchEngine

TOLERANCE = 1e-4
"""float32 logits against transformers', as the text families' checks."""

# Gemma 3's tiny checkout: its vocabulary and image token ids.
GEMMA3_VOCAB = 300
GEMMA3_BEGIN, GEMMA3_END, GEMMA3_SOFT, GEMMA3_NEWLINES = 290, 291, 292, (108,)


def png(width: int, height: int, seed: int) -> bytes:
    """A PNG of `width x height` random RGB pixels (the same for the same seed)."""
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def image_input(data: bytes) -> ImageInput:
    """A PNG file as the API node hands it to the engine (size and digest read from it)."""
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImageInput(
        data=data, media_type="image/png", width=width, height=height,
        sha256=hashlib.sha256(data).hexdigest(),
    )  # fmt: skip


def rgb_images(pictures: Sequence[bytes]) -> list[Image.Image]:
    """PNG files as RGB Pillow images, as a transformers processor takes them."""
    return [Image.open(io.BytesIO(picture)).convert("RGB") for picture in pictures]


def save_word_tokenizer(
    directory: Path,
    *,
    words: int,
    specials: Sequence[str] | Mapping[str, int],
    template: str,
    begin_token: bool = True,
    newline: bool = False,
) -> PreTrainedTokenizerFast:
    """A word-level tokenizer saved in `directory` with its chat template.

    Its ids: `<unk>` 0, `<s>` 1 (with `begin_token`), `</s>`, then the words `w0` ..
    `w{words-1}`, then "\\n" as a token of its own (with `newline`), then `specials`
    (special tokens: in order, or at the ids a mapping gives).

    Returns:
        The tokenizer as transformers loads it from the saved file.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    leading = ["<unk>", "<s>", "</s>"] if begin_token else ["<unk>", "</s>"]
    vocabulary = {token: index for index, token in enumerate(leading)}
    vocabulary |= {f"w{i}": i + len(leading) for i in range(words)}
    added = {"\n": len(vocabulary)} if newline else {}
    if isinstance(specials, Mapping):
        added |= dict(specials)
    else:
        added |= {token: len(vocabulary) + len(added) + i for i, token in enumerate(specials)}
    tokenizer = Tokenizer(WordLevel({**vocabulary, **added}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    if newline:
        tokenizer.add_tokens([AddedToken("\n", normalized=False)])
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in specials])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "chat_template.jinja").write_text(template)
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))


def perturb_weights(model: torch.nn.Module, scale: float = 0.05) -> None:
    """Add `scale` x normal noise to every parameter: fresh norms are exactly 1 and biases
    0, so without it some weights would not matter to the comparison."""
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * scale)


def save_renamed_tensors(
    model: torch.nn.Module, path: Path, rename: Callable[[str], str | None]
) -> None:
    """`model`'s state dict saved as safetensors under the names `rename` gives
    (transformers' names → a published checkpoint's); a name it maps to None is left out."""
    from safetensors.torch import save_file

    tensors = {}
    for name, tensor in model.state_dict().items():
        renamed = rename(name)
        if renamed is not None:
            tensors[renamed] = tensor.detach().clone().contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})


def vision_engine(
    directory: Path, capabilities: tuple[str, ...] = ("text", "vision")
) -> TorchEngine:
    """A single-rank float32 engine over the checkout in `directory`, its card given
    `capabilities` (with "vision" it loads the tower)."""
    card = card_from_local_directory(directory).model_copy(update={"capabilities": capabilities})
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(directory, shard, weight_dtype="float32")


def image_params(
    engine: TorchEngine, content: str, pictures: Sequence[bytes], max_tokens: int
) -> TextGenerationTaskParams:
    """A greedy request of one user message `content` (its `IMAGE_MARKER`s) with
    `pictures`."""
    message = ChatMessage(
        role="user", content=content, images=tuple(image_input(p) for p in pictures)
    )
    return TextGenerationTaskParams(
        model=ModelId(engine.card.model_id), messages=(message,), max_tokens=max_tokens,
        temperature=0.0,
    )  # fmt: skip


class RecordingChooser(TokenChooser):
    """Greedy, keeping every row of logits it chose from."""

    def __init__(self) -> None:
        super().__init__(Sampler(SamplingParams()))
        self.rows: list[torch.Tensor] = []

    def choose(self, logits: Any) -> int:
        self.rows.append(logits.detach().clone().reshape(-1))
        return super().choose(logits)


def assert_greedy_equals_reference(
    engine: TorchEngine,
    params: TextGenerationTaskParams,
    reference_logits: Callable[[list[int]], torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    *,
    until_eos: bool = False,
) -> torch.Tensor:
    """Generate `params.max_tokens` greedy tokens and check them against the reference.

    `reference_logits(ids)` is transformers' forward over `ids` (prompt and reply, with the
    request's images) → `[len(ids), vocab]` float32. Checked: usage counts the rendered
    prompt, every step's logits are within `TOLERANCE` of the reference teacher-forced on
    exo's tokens, and exo's tokens are the reference's greedy ones. `until_eos`: the
    reply may also end earlier, at an end-of-sequence token the reference chose too (a
    tiny random model's prompt of unknown words may end it at once).

    Returns:
        The reference's rows for the steps, `[steps, vocab]` (the first: the prompt's last
        token's).
    """
    prompt_ids = engine.render_prompt(params).token_ids
    chooser = RecordingChooser()
    monkeypatch.setattr(engine, "token_chooser", lambda *_: chooser)
    pieces = list(engine.generate(params))
    usage = pieces[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt_ids)
    generated = [token for piece in pieces for token in piece.token_ids]
    # Each step's choice, an ending end-of-sequence token included (it is not streamed).
    chosen = torch.stack(chooser.rows).argmax(-1).tolist() if chooser.rows else []
    stopped = len(chosen) == len(generated) + 1 and chosen[-1] in engine.eos_token_ids
    if not (until_eos and stopped):
        assert len(generated) == params.max_tokens == len(chooser.rows)
    assert chosen[: len(generated)] == generated
    expected = reference_logits(prompt_ids + chosen[:-1])[len(prompt_ids) - 1 :]
    assert (torch.stack(chooser.rows) - expected).abs().max().item() < TOLERANCE
    assert chosen == expected.argmax(-1).tolist()
    return expected


TEXT_STAND_IN = "w9"
"""An ordinary word of every tiny vision tokenizer, one token: where a typed string goes."""


def assert_typed_image_text_stays_text(
    engine: TorchEngine,
    typed: str,
    picture: bytes,
    reference_logits: Callable[..., torch.Tensor],
    monkeypatch: pytest.MonkeyPatch,
    max_tokens: int = 4,
) -> None:
    """A user turn holding `typed` (a family's image token text) sent to a vision model, once
    with no image and once with one image part (`picture`).

    Checked each time (for a raw prompt too, its ids only): the prompt is the one with an
    ordinary word at the typed string's place, that word's token replaced by the typed
    string's ordinary tokens (the tokenizer's own `split_special_tokens` reading; none an
    image token); the prompt's image tokens are exactly those of the request's images
    (none, then one); the request is answered with transformers' greedy tokens and
    logits over that prompt (`reference_logits(ids, pictures=...)`, which also checks the
    image count itself), up to `max_tokens` or an end-of-sequence token.
    """
    tokenizer = engine.tokenizer
    assert engine.image_tokens is not None and engine.images is not None
    image_ids = engine.image_tokens.image_token_ids
    # As the template's text (special tokens parsed) the string is image tokens.
    assert set(tokenizer.encode(typed, add_special_tokens=False)) & image_ids
    typed_ids = tokenizer(typed, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    assert typed_ids and not set(typed_ids) & image_ids
    (stand_in,) = tokenizer.encode(TEXT_STAND_IN, add_special_tokens=False)
    for pictures, words in (
        ([], ["w1", "w2", "{}", "w3"]),
        ([picture], ["w1", "{}", "w2", IMAGE_MARKER, "w3"]),
    ):
        content = " ".join(words)
        params = image_params(engine, content.replace("{}", typed), pictures, max_tokens)
        prompt_ids = engine.render_prompt(params).token_ids
        plain = image_params(engine, content.replace("{}", TEXT_STAND_IN), pictures, max_tokens)
        plain_ids = engine.render_prompt(plain).token_ids
        at = plain_ids.index(stand_in)
        assert prompt_ids == plain_ids[:at] + typed_ids + plain_ids[at + 1 :]
        sizes = [(image.width, image.height) for image in params.messages[0].images]
        assert len(engine.images.tokens.spans(prompt_ids, sizes)) == len(pictures)
        reference = functools.partial(reference_logits, pictures=pictures)
        assert_greedy_equals_reference(engine, params, reference, monkeypatch, until_eos=True)
    # A raw prompt (Ollama's `raw`, legacy completions) takes no images: text too.
    raw, plain_raw = (
        TextGenerationTaskParams(model=ModelId(engine.card.model_id), prompt=f"w1 {text} w2")
        for text in (typed, TEXT_STAND_IN)
    )
    raw_ids, plain_ids = (
        engine.render_prompt(raw).token_ids,
        engine.render_prompt(plain_raw).token_ids,
    )
    at = plain_ids.index(stand_in)
    assert raw_ids == plain_ids[:at] + typed_ids + plain_ids[at + 1 :]


def tiny_gemma3_vision() -> tuple[Any, Any, Any]:
    """A tiny random float32 Gemma 3 vision model: 4 text layers (sliding and full), a
    2-layer SigLIP tower at 32 x 32 pixels, 4 tokens per image, a random projection so
    images move the logits.

    Returns:
        `(reference, text, encoder)`: transformers' `Gemma3ForConditionalGeneration`, a
        `Gemma3ForCausalLM` holding its text weights (head tied), and exo's
        `Gemma3VisionEncoder` over its tower and projector.
    """
    from transformers import Gemma3Config, Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder

    torch.manual_seed(0)
    config = Gemma3Config(
        text_config={
            "vocab_size": GEMMA3_VOCAB, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 16, "sliding_window": 24, "max_position_embeddings": 512,
            "layer_types": ["sliding_attention", "full_attention"] * 2,
        },
        vision_config={
            "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 2, "image_size": 32, "patch_size": 8,
        },
        mm_tokens_per_image=4, boi_token_index=GEMMA3_BEGIN, eoi_token_index=GEMMA3_END,
        image_token_index=GEMMA3_SOFT,
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
    return reference, text, encoder


def save_gemma3_checkout(directory: Path, text: Any, encoder: Any) -> Path:
    """A Gemma 3 4B-style checkout of the tiny model (`tiny_gemma3_vision`): text tensors
    under `language_model.`, the tower's and projector's at the top, a word-level tokenizer
    whose image tokens have the config's ids, and a template writing each message's
    content."""
    from safetensors.torch import save_file

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
    specials = {
        "<start_of_image>": GEMMA3_BEGIN, "<end_of_image>": GEMMA3_END,
        "<image_soft_token>": GEMMA3_SOFT,
    }  # fmt: skip
    template = "<s>{% for message in messages %}{{ message.content }} {% endfor %}"
    save_word_tokenizer(directory, words=61, specials=specials, template=template)
    return directory


def assert_same_tokens_and_logprobs(outputs: Sequence[Any], expected: Sequence[Any]) -> None:
    """Two runs' generation pieces (`engine.generate` / `engine.step` outputs) give the same
    tokens, and their logprobs agree within `TOLERANCE`."""
    assert [piece.token_ids for piece in outputs] == [piece.token_ids for piece in expected]
    pairs = zip(
        [entry.logprob for piece in outputs for entry in piece.logprobs or ()],
        [entry.logprob for piece in expected for entry in piece.logprobs or ()],
        strict=True,
    )
    assert max(abs(a - b) for a, b in pairs) < TOLERANCE
