"""GLM-4.5 mixture-of-experts models (`Glm4MoeForCausalLM`: GLM-4.5, GLM-4.5-Air, GLM-4.6,
GLM-4.7): Llama-style attention with q/k/v biases (`attention_bias`), per-head q/k norms
where `use_qk_norm` and rotary over the first `partial_rotary_factor` of each head; the first
`first_k_dense_replace` layers with a dense MLP, every later one a sparse block of
`n_routed_experts` gated MLPs of `moe_intermediate_size` plus one shared gated MLP of
`n_shared_experts * moe_intermediate_size` every token goes through. Routing: sigmoid
scores, the choice made on scores plus `e_score_correction_bias` among the best
`topk_group` of `n_group` groups, weights renormalized when `norm_topk_prob` and times
`routed_scaling_factor` (DeepSeek-V3's router; `Routing`). The multi-token-prediction layer
checkpoints keep after the last decoder layer (`model.layers.<num_hidden_layers>`) is not
loaded: its index is past every shard's layers.
"""

from __future__ import annotations

from typing import Any

from transformers import Glm4MoeConfig, Glm4MoeForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRMSNorm

from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    config_scoring,
    standard_attention_and_mlp,
    widen_tiny_routers,
)

# Router weights of the tiny model: sigmoid scores compare best where the logits are a few
# units apart (hidden rows are RMS-normalized, ~1 per value: logits ~0.2 * sqrt(64)), not
# where sigmoid saturates and near ties become likely. Correction biases of this size move
# some choices, as trained ones do.
TINY_ROUTER_STD = 0.2
TINY_CORRECTION_BIAS_STD = 0.1
SHARED_EXPERT = "mlp.shared_experts"


def routing(config: PretrainedConfig) -> Routing:
    return Routing(
        experts=int(config.n_routed_experts),
        experts_field="n_routed_experts",
        experts_per_token=int(config.num_experts_per_tok),
        scoring=config_scoring(config, "glm4_moe", "sigmoid"),
        normalize=bool(config.norm_topk_prob),
        scaling=float(config.routed_scaling_factor),
        groups=int(config.n_group),
        groups_per_token=int(config.topk_group),
    )


def draw_tiny_router(model: PreTrainedModel, weight_suffix: str, bias_suffix: str) -> None:
    """Draw the routers' weights `TINY_ROUTER_STD` wide and their correction biases
    `TINY_CORRECTION_BIAS_STD` wide (transformers initializes the biases to zero)."""
    widen_tiny_routers(model, weight_suffix, TINY_ROUTER_STD, bias_suffix, TINY_CORRECTION_BIAS_STD)


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Top 2 of 4 experts beside a shared one, layer 0 dense (`first_k_dense_replace`), q/k
    norms, attention biases, half-width rotary and GLM-4.5's scaling factor."""
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    hidden = int(settings["hidden_size"])
    defaults: dict[str, Any] = {
        "head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": hidden // 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "use_qk_norm": True,
        "attention_bias": True,
        "partial_rotary_factor": 0.5,
    }
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**{**defaults, **settings}))
    draw_tiny_router(model, "mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    return model


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="glm4_moe",
    architectures=("Glm4MoeForCausalLM",),
    column_parallel=(*_COLUMN, f"{SHARED_EXPERT}.gate_proj", f"{SHARED_EXPERT}.up_proj"),
    row_parallel=(*_ROW, f"{SHARED_EXPERT}.down_proj"),
    rms_norms=(Glm4MoeRMSNorm,),
    tiny_model=tiny_model,
    layout=DecoderLayout(qk_norms=("self_attn.q_norm", "self_attn.k_norm")),
    moe=MixtureOfExperts(
        routing=routing,
        correction_bias="mlp.gate.e_score_correction_bias",
        shared_expert=SHARED_EXPERT,
    ),
)
