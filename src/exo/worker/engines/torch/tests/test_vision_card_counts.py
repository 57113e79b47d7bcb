"""The vision cards' parameter counts equal transformers' own modules built from the real
config.json (the fixtures of `shared/models/tests/real_configs.json`), on the meta device:
the whole model (a tied head counted once) and its vision part (tower, mergers, deepstack
mergers). The Qwen3-VL-4B card once said 61,440 fewer text parameters than transformers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId

FIXTURES: dict[str, Any] = json.loads(
    (Path(__file__).parents[4] / "shared/models/tests/real_configs.json").read_text()
)["models"]
CARDS = load_builtin_cards()
VISION = sorted(name for name, fixture in FIXTURES.items() if "vision_config" in fixture["config"])


@pytest.mark.parametrize("model", VISION)
def test_vision_card_counts_are_transformers_counts(model: str) -> None:
    config_dict = dict(FIXTURES[model]["config"])
    config = transformers.AutoConfig.for_model(**config_dict)
    architecture = getattr(transformers, config_dict["architectures"][0])
    with torch.device("meta"):
        built = architecture(config)
    total = sum(parameter.numel() for parameter in built.parameters())
    vision = sum(parameter.numel() for parameter in built.model.visual.parameters())
    card = CARDS[ModelId(model)]
    assert (card.parameter_count, card.vision_parameter_count) == (total, vision)
