"""Mixtral mixture-of-experts models (`MixtralForCausalLM`: Mixtral-8x7B, Mixtral-8x22B):
Mistral's attention (sliding window where `sliding_window` is set) and in every layer a
sparse block of `num_local_experts` gated MLPs of `intermediate_size`, softmax routing to
the top `num_experts_per_tok` renormalized over the chosen. Checkpoints on the Hub keep the
block as `block_sparse_moe` (`gate`, `experts.N.w1` gate / `w3` up / `w2` down), which
transformers' modules call `mlp`.
"""

from __future__ import annotations

from typing import Any

from transformers import MixtralConfig, MixtralForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.mixtral.modeling_mixtral import MixtralRMSNorm

from exo.worker.engines.torch.model.families.qwen3_moe import TINY_ROUTER_STD
from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    config_scoring,
    standard_attention_and_mlp,
    widen_tiny_routers,
)


def routing(config: PretrainedConfig) -> Routing:
    return Routing(
        experts=int(config.num_local_experts),
        experts_field="num_local_experts",
        experts_per_token=int(config.num_experts_per_tok),
        scoring=config_scoring(config, "mixtral", "softmax"),
        normalize=True,
    )


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Top 2 of 4 experts (Mixtral-8x7B routes to 2 of 8), a sliding window where the
    settings give one."""
    defaults: dict[str, Any] = {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2}
    model = MixtralForCausalLM(MixtralConfig(**{**defaults, **settings}))
    widen_tiny_routers(model, "mlp.gate.weight", TINY_ROUTER_STD)
    return model


_COLUMN, _ROW = standard_attention_and_mlp()
FAMILY = ModelFamily(
    name="mixtral",
    architectures=("MixtralForCausalLM",),
    column_parallel=_COLUMN,
    row_parallel=_ROW,
    rms_norms=(MixtralRMSNorm,),
    tiny_model=tiny_model,
    layout=DecoderLayout(),
    moe=MixtureOfExperts(
        routing=routing,
        expert_gate_up=("w1", "w3"),
        expert_down="w2",
        expert_width="intermediate_size",
    ),
    checkpoint_renames=((".block_sparse_moe.", ".mlp."),),
)
