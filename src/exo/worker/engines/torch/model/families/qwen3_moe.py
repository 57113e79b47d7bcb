"""Qwen3 mixture-of-experts models (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B): Qwen3's attention (per-head q/k norms), and in each layer either a
sparse block of `num_experts` gated MLPs of `moe_intermediate_size` (softmax top
`num_experts_per_tok` routing, renormalized over the chosen when `norm_topk_prob`), or
a dense MLP of `intermediate_size` where `mlp_only_layers` lists the layer or
`decoder_sparse_step` skips it (transformers builds the layers; see `MixtureOfExperts`).
"""

from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig, PreTrainedModel, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    attention_windows_from_layer_types,
    standard_attention_and_mlp,
    widen_tiny_routers,
)

# The tiny model's router weights are drawn this wide (the hidden rows it scores are
# RMS-normalized, ~1 per value), so its choices are decided by clear margins, as a trained
# router's are, rather than near ties that float rounding could flip.
TINY_ROUTER_STD = 0.5


def routing(config: PretrainedConfig) -> Routing:
    return Routing(
        experts=int(config.num_experts),
        experts_per_token=int(config.num_experts_per_tok),
        normalize=bool(config.norm_topk_prob),
    )


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Few experts (top 2 of 4, renormalized as Qwen3-30B-A3B's), one dense layer
    (`mlp_only_layers`) among sparse ones."""
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    hidden = int(settings["hidden_size"])
    defaults: dict[str, Any] = {
        "head_dim": 16,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden // 2,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [1] if int(settings["num_hidden_layers"]) > 1 else [],
    }
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**defaults, **settings}))
    widen_tiny_routers(model, "mlp.gate.weight", TINY_ROUTER_STD)
    return model


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="qwen3_moe",
    architectures=("Qwen3MoeForCausalLM",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(Qwen3MoeRMSNorm,),
    attention_windows=attention_windows_from_layer_types,
    tiny_model=tiny_model,
    layout=DecoderLayout(qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    moe=MixtureOfExperts(routing=routing),
)
