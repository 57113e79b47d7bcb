"""MiniMax-M2 mixture-of-experts models (`MiniMaxM2ForCausalLM`: MiniMax-M2, M2.1): attention
whose queries and keys are RMS-normalized over the whole projection (all heads together,
`q_norm` over `heads * head_dim`), rotary over the first `rotary_dim` values of each head
(`partial_rotary_factor`), and in every layer a sparse block of `num_local_experts` gated
MLPs of `intermediate_size`: sigmoid scores (`scoring_func`), the top `num_experts_per_tok`
chosen on scores plus `e_score_correction_bias`, weighted by their scores renormalized.
Checkpoints keep the block as `block_sparse_moe` (experts' `w1` / `w3` / `w2`, the bias on
the block), which transformers' modules call `mlp`. Under tensor parallelism the q/k norms
are split with their projections and their sums of squares all-reduced
(`ModelFamily.projection_norms`).
"""

from __future__ import annotations

from typing import Any

from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2RMSNorm

from exo.worker.engines.torch.model.families.glm4_moe import draw_tiny_router
from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    config_scoring,
    standard_attention_and_mlp,
)

QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


def routing(config: PretrainedConfig) -> Routing:
    return Routing(
        experts=int(config.num_local_experts),
        experts_field="num_local_experts",
        experts_per_token=int(config.num_experts_per_tok),
        scoring=config_scoring(config, "minimax_m2", "sigmoid"),
        normalize=True,
    )


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Top 2 of 4 experts, rotary over half of each head (MiniMax-M2: 64 of 128)."""
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    defaults: dict[str, Any] = {
        "head_dim": 16,
        "rotary_dim": 8,
        "num_local_experts": 4,
        "num_experts_per_tok": 2,
    }
    model = MiniMaxM2ForCausalLM(MiniMaxM2Config(**{**defaults, **settings}))
    draw_tiny_router(model, "mlp.gate.weight", "mlp.e_score_correction_bias")
    return model


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="minimax_m2",
    architectures=("MiniMaxM2ForCausalLM",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(MiniMaxM2RMSNorm,),
    tiny_model=tiny_model,
    layout=DecoderLayout(qk_norms=QK_NORMS, qk_norms_per_head=False),
    moe=MixtureOfExperts(
        routing=routing,
        correction_bias="mlp.e_score_correction_bias",
        expert_gate_up=("w1", "w3"),
        expert_down="w2",
        expert_width="intermediate_size",
    ),
    projection_norms=QK_NORMS,
    checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
)
