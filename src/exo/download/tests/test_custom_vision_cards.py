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

from exo.download.custom_cards import card_for_local_directory
from exo.shared.models.architectures import ENGINE_ARCHITECTURES
from exo.testing.vision_checkpoints import save_gemma3_checkout, tiny_gemma3_vision


def test_a_local_gemma3_vision_checkout_has_the_vision_capability(tmp_path: Path) -> None:
    _, text, encoder = tiny_gemma3_vision()
    directory = save_gemma3_checkout(tmp_path / "gemma3-vision", text, encoder)

    card = card_for_local_directory(str(directory), ENGINE_ARCHITECTURES, trust_remote_code=False)

    assert card.architecture == "Gemma3ForConditionalGeneration"
    assert "vision" in card.capabilities
    assert card.vision_parameter_count > 0
