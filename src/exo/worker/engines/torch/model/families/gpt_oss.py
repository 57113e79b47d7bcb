"""OpenAI's gpt-oss (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b): every layer a MoE
block; layers alternate sliding-window and full attention (`layer_types`,
`sliding_window`); attention has biases and a learned sink logit per head
(`self_attn.sinks`); YaRN rope (`rope_parameters`, whose module gives cos / sin once per
frequency); a biased router (top `num_experts_per_tok` of the logits, softmax over the
chosen); experts with biases and a clamped SwiGLU; checkpoints stack the experts
(`mlp.experts.gate_up_proj` with gate / up interleaved, `down_proj`, their biases), as
transformers' `modeling_gpt_oss.py` (5.25) defines them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import GptOssConfig, GptOssForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    ExpertActivation,
    FusedExpertTensors,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    attention_windows_from_layer_types,
    standard_attention_and_mlp,
)

# The tiny model's router weights are drawn this wide (its rows are RMS-normalized) so its
# choices have clear margins, as in `qwen3_moe.TINY_ROUTER_STD`; its sinks this wide so
# they take a visible share of each softmax (trained gpt-oss sinks are of order 1).
TINY_ROUTER_STD = 0.5
TINY_SINK_STD = 1.0
TINY_FINAL_NORM = 3.0


def routing(config: PretrainedConfig) -> Routing:
    """Top-k of the router logits, softmax over the chosen: the same weights as a softmax
    over every expert renormalized over the chosen (`normalize`)."""
    return Routing(
        experts=int(config.num_local_experts),
        experts_field="num_local_experts",
        experts_per_token=int(config.num_experts_per_tok),
        normalize=True,
    )


@dataclass(frozen=True, slots=True)
class ClampedSwiglu:
    """gpt-oss's expert activation: the gate clamped above at `limit`, the up projection to
    ±`limit`, `(up + 1) * gate * sigmoid(alpha * gate)` (transformers'
    `GptOssExperts._apply_gate`). A value, not a closure, so the native MXFP4 experts call
    (`direct_forward_moe.NativeMxfp4Experts`) can read `alpha` and `limit`; it repeats
    these operators in this order, so change both together."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def clamped_swiglu(config: PretrainedConfig) -> ExpertActivation:
    """The config's `ClampedSwiglu` (`swiglu_alpha`, default 1.702; `swiglu_limit`, 7.0
    in gpt-oss's configs)."""
    return ClampedSwiglu(
        alpha=float(getattr(config, "swiglu_alpha", 1.702)), limit=float(config.swiglu_limit)
    )


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Top 2 of 4 experts; sliding and full attention layers alternating (gpt-oss's own
    pattern, sliding first) with the tiny `sliding_window`; gpt-oss's YaRN scaled to the
    tiny context; a SwiGLU clamp that binds (`swiglu_limit` 0.5)."""
    layers = int(settings["num_hidden_layers"])
    positions = int(settings.get("max_position_embeddings", 512))
    defaults: dict[str, Any] = {
        "head_dim": 16,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
        # A clamp the tiny experts' values reach (theirs stay below 1), so it binds.
        "swiglu_limit": 0.5,
        "layer_types": ["sliding_attention", "full_attention"] * (layers // 2)
        + ["sliding_attention"] * (layers % 2),
        # gpt-oss's YaRN (factor 32 over the pre-YaRN context), scaled to the tiny context.
        "rope_parameters": {
            "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": max(1, positions // 32),
            "rope_theta": 150000.0,
        },
    }  # fmt: skip
    model = GptOssForCausalLM(GptOssConfig(**{**defaults, **settings}))
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("mlp.router.weight"):
                parameter.normal_(0.0, TINY_ROUTER_STD)
            elif name.endswith("self_attn.sinks"):
                parameter.normal_(0.0, TINY_SINK_STD)
        # Logits TINY_FINAL_NORM times as wide as the random head gives: not nearly flat
        # over the vocabulary, where seeded sampling would hang on last-bit differences.
        model.model.norm.weight.fill_(TINY_FINAL_NORM)
    return model


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="gpt_oss",
    architectures=("GptOssForCausalLM",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(GptOssRMSNorm,),
    attention_windows=attention_windows_from_layer_types,
    tiny_model=tiny_model,
    layout=DecoderLayout(rotary_per_frequency=True, attention_sinks="self_attn.sinks"),
    moe=MixtureOfExperts(
        routing=routing,
        router="mlp.router",
        expert_bias=True,
        expert_activation=clamped_swiglu,
        fused_checkpoint=FusedExpertTensors(),
        expert_width="intermediate_size",
    ),
    per_head_parameters=("self_attn.sinks",),
)
