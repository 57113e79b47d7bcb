"""The mixture-of-experts cards' parameter counts equal transformers' own modules built from
the real config.json (the fixtures of `shared/models/tests/real_configs.json`), on the meta
device: every parameter plus the routers' `e_score_correction_bias`, which transformers
keeps as a buffer but the checkpoint stores (DeepSeek-V3, Kimi-K2, GLM-4.5, MiniMax-M2). The
cards' counts come from `test_cards_against_configs.config_parameter_count`, written from
the modeling files; this checks that arithmetic against the modules themselves. Kimi-K2's
`model_type: kimi_k2` is read as `deepseek_v3`, as the engine's loader reads it."""

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
MOE = sorted(name for name in FIXTURES if CARDS[ModelId(name)].moe is not None)
# Model types transformers has no config class for, and the one the engine reads them as.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
CORRECTION_BIAS = "e_score_correction_bias"


def test_the_moe_fixtures_span_the_moe_families() -> None:
    architectures = {FIXTURES[name]["config"]["architectures"][0] for name in MOE}
    assert {
        "Qwen3MoeForCausalLM",
        "GptOssForCausalLM",
        "DeepseekV3ForCausalLM",
        "Glm4MoeForCausalLM",
        "MiniMaxM2ForCausalLM",
    } <= architectures


@pytest.mark.parametrize("model", MOE)
def test_moe_card_counts_are_transformers_counts(model: str) -> None:
    config_dict = dict(FIXTURES[model]["config"])
    # Quantization is applied by from_pretrained only; built here, the modules hold the
    # unquantized shapes the count is of.
    config_dict.pop("quantization_config", None)
    kind = config_dict["model_type"]
    config_dict["model_type"] = MODEL_TYPE_ALIASES.get(kind, kind)
    config = transformers.AutoConfig.for_model(**config_dict)
    architecture = getattr(transformers, config_dict["architectures"][0])
    with torch.device("meta"):
        built = architecture(config)
    weights = sum(parameter.numel() for parameter in built.parameters())
    weights += sum(
        buffer.numel() for name, buffer in built.named_buffers() if name.endswith(CORRECTION_BIAS)
    )
    assert CARDS[ModelId(model)].parameter_count == weights
