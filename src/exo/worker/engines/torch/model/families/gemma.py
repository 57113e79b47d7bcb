"""Gemma (1) (`GemmaForCausalLM`). Its RMSNorm scales by `1 + weight`, so it is not fused.
(Gemma 2 is absent: transformers has no SDPA attention for it.)"""

from __future__ import annotations

from typing import Any

from transformers import GemmaConfig, GemmaForCausalLM, PreTrainedModel

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    ModelFamily,
    standard_attention_and_mlp,
)


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    return GemmaForCausalLM(GemmaConfig(**{"head_dim": 16, **settings}))


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="gemma",
    architectures=("GemmaForCausalLM",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(),
    tiny_model=tiny_model,
    layout=DecoderLayout(norm_offset=1.0),
)
