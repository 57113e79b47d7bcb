"""A vision checkpoint added as a custom model (`POST /models/add` of a local directory)
gets the `vision` capability, as the catalog's cards of the same architectures have.

Found by trial 40: the card of a local Gemma 3 vision checkout (config with a
`vision_config`, tower and projector tensors) came back with capabilities `["text"]`, so
every image sent to it was refused with 400 "the model has no vision capability", while
docs/api.md#images says the architecture renders images. `with_traits` replaces the
card's capabilities with what the chat template shows (text, tools, thinking) and nothing
adds `vision`.
"""

from __future__ import annotations

from pathlib import Path

from safetensors.torch import load_file, save_file

from exo.chat_protocol.image_tokens import ImageTokens
from exo.download.custom_cards import card_for_local_directory
from exo.shared.models.architectures import ENGINE_ARCHITECTURES
from exo.shared.models.cards import VISION_TENSOR_PREFIXES
from exo.testing.vision_checkpoints import save_gemma3_checkout, tiny_gemma3_vision
from exo.worker.engines.torch.model.vision_input import ENCODERS


def test_a_local_gemma3_vision_checkout_has_the_vision_capability(tmp_path: Path) -> None:
    _, text, encoder = tiny_gemma3_vision()
    directory = save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder)

    card = card_for_local_directory(str(directory), ENGINE_ARCHITECTURES, trust_remote_code=False)

    assert card.architecture == "Gemma3ForConditionalGeneration"
    assert "vision" in card.capabilities
    assert card.vision_parameter_count > 0


def test_the_vision_count_is_the_towers_and_a_copy_without_it_stays_text_only(
    tmp_path: Path,
) -> None:
    _, text, encoder = tiny_gemma3_vision()
    directory = save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder)
    card = card_for_local_directory(str(directory), ENGINE_ARCHITECTURES, trust_remote_code=False)
    assert card.vision_parameter_count == sum(p.numel() for p in encoder.parameters())

    # The same config with the tower's tensors left out: nothing to render images with.
    weights = directory / "model.safetensors"
    tensors = {
        name: tensor
        for name, tensor in load_file(str(weights)).items()
        if not name.startswith(("vision_tower.", "multi_modal_projector."))
    }
    save_file(tensors, str(weights), metadata={"format": "pt"})
    text_only = card_for_local_directory(
        str(directory), ENGINE_ARCHITECTURES, trust_remote_code=False
    )
    assert "vision" not in text_only.capabilities and text_only.vision_parameter_count == 0


def test_every_engine_tower_reads_tensors_the_cards_count_as_vision() -> None:
    for image_tokens, encoder_class in ENCODERS.items():
        prefixes = set(encoder_class.tower_class.checkpoint_prefixes)
        assert prefixes <= set(VISION_TENSOR_PREFIXES), image_tokens.__name__
        # The engine renders images for exactly the model types a card gets vision for.
        for model_type in image_tokens.model_types:
            assert ImageTokens.serves({"vision_config": {"x": 1}, "model_type": model_type})
