"""Mistral 3 images (Pixtral's tower) through the engine's real path
(`model/mistral3_vision.py`, `chat_protocol/image_tokens.py`): a tiny random
`Mistral3ForConditionalGeneration` saved in the published layout (text under
`language_model.`, tower and projector at the top), loaded by `TorchEngine.load` (Mistral
text model on the direct forward, tower beside it), against transformers' own model fed by
transformers' own processor (its pixel values and its `[IMG]` / `[IMG_BREAK]` / `[IMG_END]`
expansion), float32."""

from __future__ import annotations

import hashlib
import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PreTrainedTokenizerFast

from exo.chat_protocol.image_tokens import ImageTokens, PixtralImageTokens
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

TOLERANCE = 1e-4  # float32 logits, as the other families' tests
STEPS = 8
PATCH, MERGE, LONGEST_EDGE = 8, 2, 64  # merged patches of 16 pixels, at most 4 x 4
SPECIALS = ["[IMG]", "[IMG_BREAK]", "[IMG_END]"]
IMAGE_ID = 44  # "[IMG]": after 43 words and before the break and end tokens
TEMPLATE = "<s>{% for message in messages %}{{ message.content }} {% endfor %}"


def _png(width: int, height: int, seed: int) -> bytes:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), dtype=torch.uint8, generator=generator)
    buffer = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _image_input(data: bytes) -> ImageInput:
    with Image.open(io.BytesIO(data)) as image:
        width, height = image.size
    return ImageInput(
        data=data, media_type="image/png", width=width, height=height,
        sha256=hashlib.sha256(data).hexdigest(),
    )  # fmt: skip


def _save_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    from tokenizers import AddedToken, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(41)}}
    added = {token: len(vocabulary) + i for i, token in enumerate(SPECIALS)}
    tokenizer = Tokenizer(WordLevel({**vocabulary, **added}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.add_special_tokens([AddedToken(token, special=True) for token in SPECIALS])
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (directory / "chat_template.jinja").write_text(TEMPLATE)
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))


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
    from safetensors.torch import save_file
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

    directory = tmp_path_factory.mktemp("mistral3")
    tokenizer = _save_tokenizer(directory)
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
    with torch.no_grad():  # fresh norms are exactly 1 and biases 0: let every weight matter
        for parameter in reference.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)
    tensors = {
        _published_name(name): tensor.detach().clone().contiguous()
        for name, tensor in reference.state_dict().items()
    }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
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


def _engine(directory: Path) -> TorchEngine:
    card = card_from_local_directory(directory).model_copy(
        update={"capabilities": ("text", "vision")}
    )
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(directory, shard, weight_dtype="float32")


class _RecordingChooser(TokenChooser):
    """Greedy, keeping every row of logits it chose from."""

    def __init__(self) -> None:
        super().__init__(Sampler(SamplingParams()))
        self.rows: list[torch.Tensor] = []

    def choose(self, logits: Any) -> int:
        self.rows.append(logits.detach().clone().reshape(-1))
        return super().choose(logits)


def _reference_logits(reference: Any, ids: list[int], inputs: Any) -> torch.Tensor:
    with torch.inference_mode():
        output = reference(
            input_ids=torch.tensor([ids]), pixel_values=inputs["pixel_values"],
            image_sizes=inputs["image_sizes"], use_cache=False,
        )  # fmt: skip
    return output.logits[0].float()


def test_two_images_equal_transformers(
    checkout: tuple[Path, Any, Any], float32_kv: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 3 x 4 image and one scaled down to fit (2 x 4 merged patches): the engine's prompt
    is the processor's, every step's logits within `TOLERANCE` of transformers'
    (teacher-forced on exo's tokens), its greedy tokens transformers', usage and the token
    count the expanded prompt."""
    directory, reference, processor = checkout
    engine = _engine(directory)
    assert engine.images is not None
    # The API node reads the layout from the files (`token_counting`): the runner's own.
    assert engine.images.tokens == ImageTokens.of_model(directory, engine.tokenizer)
    pictures = [_png(60, 40, seed=1), _png(100, 30, seed=2)]
    message = ChatMessage(
        role="user",
        content=f"w1 w2 {IMAGE_MARKER} w3 w4 {IMAGE_MARKER} w5",
        images=tuple(_image_input(picture) for picture in pictures),
    )
    params = TextGenerationTaskParams(
        model=ModelId(engine.card.model_id), messages=(message,), max_tokens=STEPS,
        temperature=0.0,
    )  # fmt: skip
    prompt_ids = engine.render_prompt(params).token_ids
    images = [Image.open(io.BytesIO(picture)).convert("RGB") for picture in pictures]
    inputs = processor(text="<s>w1 w2 [IMG] w3 w4 [IMG] w5 ", images=images, return_tensors="pt")
    assert prompt_ids == inputs["input_ids"][0].tolist()
    assert prompt_ids.count(IMAGE_ID) == 3 * 4 + 2 * 4
    assert engine.count_prompt_tokens(params) == len(prompt_ids)

    chooser = _RecordingChooser()
    monkeypatch.setattr(engine, "token_chooser", lambda *_: chooser)
    pieces = list(engine.generate(params))
    usage = pieces[-1].usage
    assert usage is not None and usage.prompt_tokens == len(prompt_ids)
    generated = [token for piece in pieces for token in piece.token_ids]
    assert len(generated) == STEPS == len(chooser.rows)
    expected = _reference_logits(reference, prompt_ids + generated[:-1], inputs)
    expected = expected[len(prompt_ids) - 1 :]
    assert (torch.stack(chooser.rows) - expected).abs().max().item() < TOLERANCE
    assert generated == expected.argmax(-1).tolist()
    # The images matter: without their features the first token's logits differ.
    blank = {**inputs, "pixel_values": torch.zeros_like(inputs["pixel_values"])}
    plain = _reference_logits(reference, prompt_ids, blank)[-1]
    assert (plain - expected[0]).abs().max().item() > 100 * TOLERANCE


def test_layout_follows_the_processor_for_many_sizes(checkout: tuple[Path, Any, Any]) -> None:
    """The `[IMG]` rows from the width and height alone (what the API node counts) are the
    processor's, for small, large (scaled down), wide and tall images."""
    directory, _, processor = checkout
    tokens = ImageTokens.of_model(directory, processor.tokenizer)
    assert isinstance(tokens, PixtralImageTokens)
    for width, height in ((1, 1), (16, 16), (17, 33), (64, 64), (65, 64), (200, 41), (30, 500)):
        image = Image.open(io.BytesIO(_png(width, height, seed=3))).convert("RGB")
        inputs = processor(text="[IMG]", images=[image])
        expected = torch.as_tensor(inputs["input_ids"][0]).tolist()
        assert tokens.sequence((width, height)) == expected, (width, height)
