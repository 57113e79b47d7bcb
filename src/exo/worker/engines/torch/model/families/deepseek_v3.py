"""DeepSeek-V3 mixture-of-experts models (`DeepseekV3ForCausalLM`: DeepSeek-V3, V3.1, and
Kimi-K2, whose config says `model_type: kimi_k2` over the same architecture): multi-head
latent attention (MLA: queries through `q_a_proj` / `q_a_layernorm` / `q_b_proj`, or one
`q_proj` where `q_lora_rank` is null; keys and values from one `kv_lora_rank` latent and
one shared rope key, `kv_a_proj_with_mqa` / `kv_a_layernorm` / `kv_b_proj`), run by the
lean forward over a KV cache that holds only the latent and the rope key
(`direct_forward_mla`). The first `first_k_dense_replace` layers have a dense MLP, every
later one `n_routed_experts` gated MLPs of `moe_intermediate_size` beside a shared MLP of
`n_shared_experts * moe_intermediate_size`, routed as GLM-4.5 (sigmoid scores, the choice
on scores plus `e_score_correction_bias` among the best `topk_group` of `n_group` groups,
`norm_topk_prob`, `routed_scaling_factor`: `glm4_moe.routing`). The multi-token-prediction
layers (`num_nextn_predict_layers`, stored as `model.layers.<num_hidden_layers>`) are not
loaded: their index is past every shard's layers.

Tensor parallelism splits the heads (`q_b_proj` / `q_proj` and `kv_b_proj` by rows,
`o_proj` by columns); the low-rank projections before the heads stay whole on every rank,
which therefore caches the same latents.
"""

from __future__ import annotations

from typing import Any

from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm

from exo.worker.engines.torch.model.families.glm4_moe import SHARED_EXPERT, draw_tiny_router
from exo.worker.engines.torch.model.families.spec import (
    DecoderLayout,
    MixtureOfExperts,
    ModelFamily,
    Routing,
    config_scoring,
)


def routing(config: PretrainedConfig) -> Routing:
    """DeepSeek-V3's router (`noaux_tc`: sigmoid, correction bias, groups)."""
    return Routing(
        experts=int(config.n_routed_experts),
        experts_field="n_routed_experts",
        experts_per_token=int(config.num_experts_per_tok),
        scoring=config_scoring(config, "deepseek_v3", "sigmoid"),
        normalize=bool(config.norm_topk_prob),
        scaling=float(config.routed_scaling_factor),
        groups=int(config.n_group),
        groups_per_token=int(config.topk_group),
    )


def tiny_model(settings: dict[str, Any]) -> PreTrainedModel:
    """Top 2 of 8 experts in the best of 2 groups beside a shared one, layer 0 dense,
    low-rank queries (32) and a latent of 64 (+ a rope key of 8) per token, DeepSeek-V3's
    interleaved rotary and scaling factor. The ranks are multiples of 32, as the real
    models' (torch's int8 kernel, `Int8Linear`'s fallback, crashes on 24 input columns)."""
    settings = {key: value for key, value in settings.items() if key != "sliding_window"}
    hidden = int(settings["hidden_size"])
    heads = int(settings["num_attention_heads"])
    defaults: dict[str, Any] = {
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "n_group": 2,
        "topk_group": 1,
        "moe_intermediate_size": hidden // 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "q_lora_rank": 32,
        "kv_lora_rank": 64,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
    }
    merged = {**defaults, **settings, "num_key_value_heads": heads}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**merged))
    draw_tiny_router(model, "mlp.gate.weight", "mlp.gate.e_score_correction_bias")
    return model


_HEADS = ("self_attn.q_b_proj", "self_attn.q_proj", "self_attn.kv_b_proj")
_SHARED = (f"{SHARED_EXPERT}.gate_proj", f"{SHARED_EXPERT}.up_proj")
FAMILY = ModelFamily(
    name="deepseek_v3",
    architectures=("DeepseekV3ForCausalLM",),
    column_parallel=(*_HEADS, "mlp.gate_proj", "mlp.up_proj", *_SHARED),
    row_parallel=("self_attn.o_proj", "mlp.down_proj", f"{SHARED_EXPERT}.down_proj"),
    rms_norms=(DeepseekV3RMSNorm,),
    tiny_model=tiny_model,
    layout=DecoderLayout(qkv=(), latent_attention=True),
    moe=MixtureOfExperts(
        routing=routing,
        correction_bias="mlp.gate.e_score_correction_bias",
        shared_expert=SHARED_EXPERT,
    ),
)
