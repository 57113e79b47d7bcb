"""A mixture-of-experts model's geometry from its `config.json`, without transformers: how
many experts, how many a token uses, how wide each is, and which layers keep a dense MLP.
Cards (`cards.card_from_config`), the load-time check of a card (`profile.card_mismatches`)
and memory (`memory.py`) read it; the engine's family files say the same through the
layers transformers builds (`worker/engines/torch/model/families/spec.MixtureOfExperts`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exo.shared.types.models import MoeGeometry

# Config fields naming the routed experts per layer, by family: Qwen2/3-MoE, Mixtral and
# MiniMax-M2 (and transformers' saved Qwen3-MoE configs), DeepSeek-V3 / GLM-4.5.
_EXPERT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# The field each MoE architecture's own checkpoints name their experts with (refusals name
# it: transformers 5 saves a Qwen3-MoE config's `num_experts` as `num_local_experts`, an
# alias its config class maps back). The family files name the same (`Routing.experts_field`).
_OWN_EXPERT_FIELD = {
    "Qwen2MoeForCausalLM": "num_experts",
    "Qwen3MoeForCausalLM": "num_experts",
    "MixtralForCausalLM": "num_local_experts",
    "GptOssForCausalLM": "num_local_experts",
    "MiniMaxM2ForCausalLM": "num_local_experts",
    "DeepseekV3ForCausalLM": "n_routed_experts",
    "Glm4MoeForCausalLM": "n_routed_experts",
}
# Router scoring functions the engine's MoE families compute (`scoring_func`, where a
# config states one: DeepSeek-V3, MiniMax-M2).
_SCORING_FUNCTIONS = ("softmax", "sigmoid")


def moe_geometry_of_config(config: Mapping[str, Any]) -> MoeGeometry | None:
    """The sparse blocks a (text) config describes, None for a dense model (no experts
    field, or 0 experts).

    A layer `i` is dense where `mlp_only_layers` lists it, where `decoder_sparse_step` (>1)
    skips it (sparse only where `(i + 1) % step == 0`, as transformers' Qwen2/3-MoE decoder
    layers decide), or below `first_k_dense_replace` (DeepSeek-V3, GLM-4.5). An expert's
    width is `moe_intermediate_size`, else `intermediate_size` (Mixtral's and MiniMax-M2's
    experts). A shared expert is `n_shared_experts` experts wide (DeepSeek-V3, GLM-4.5), or
    `shared_expert_intermediate_size` (Qwen2-MoE). Experts are MXFP4 where
    `quantization_config.quant_method` is "mxfp4".

    Raises:
        ValueError: experts without `num_experts_per_tok`, more per token than experts, or
            a `scoring_func` no family computes (the message names the field).
    """
    field = next((name for name in _EXPERT_FIELDS if isinstance(config.get(name), int)), None)
    experts = 0 if field is None else int(config[field])
    if field is None or experts <= 0:
        return None
    per_token = config.get("num_experts_per_tok")
    if not isinstance(per_token, int):
        raise ValueError(f"a config with {experts} experts has no num_experts_per_tok")
    if not 0 < per_token <= experts:
        raise ValueError(
            f"num_experts_per_tok={per_token} must be between 1 and "
            f"{_expert_field_named(config, field, experts)}"
        )
    scoring = config.get("scoring_func")
    if scoring is not None and scoring not in _SCORING_FUNCTIONS:
        raise ValueError(
            f"scoring_func={scoring!r} is no router scoring the engine computes "
            f"({', '.join(_SCORING_FUNCTIONS)})"
        )
    width = config.get("moe_intermediate_size") or config.get("intermediate_size")
    if not isinstance(width, int):
        raise ValueError("a MoE config has neither moe_intermediate_size nor intermediate_size")
    layers = int(config.get("num_hidden_layers") or 0)
    step = config.get("decoder_sparse_step") or 1
    only_dense = set(config.get("mlp_only_layers") or ())
    first_sparse = int(config.get("first_k_dense_replace") or 0)
    dense = tuple(
        layer
        for layer in range(layers)
        if layer in only_dense or (layer + 1) % int(step) != 0 or layer < first_sparse
    )
    shared = int(config.get("n_shared_experts") or 0) * width
    shared = shared or int(config.get("shared_expert_intermediate_size") or 0)
    return MoeGeometry(
        experts=experts,
        experts_per_token=per_token,
        expert_intermediate_size=width,
        dense_layers=dense,
        shared_expert_intermediate_size=shared,
        correction_bias=_has_correction_bias(config),
        mxfp4_experts=_has_mxfp4_experts(config),
    )


def _has_mxfp4_experts(config: Mapping[str, Any]) -> bool:
    """Whether the checkpoint stores its experts as MXFP4: `quantization_config.quant_method`
    "mxfp4" (gpt-oss; the engine's loader reads the same field, `model.loading`)."""
    quantization = config.get("quantization_config")
    return isinstance(quantization, Mapping) and quantization.get("quant_method") == "mxfp4"


# Model types whose router always holds an `e_score_correction_bias`, whatever
# `topk_method` says (transformers' DeepseekV3TopkRouter, Glm4MoeTopkRouter,
# MiniMaxM2SparseMoeBlock).
_ROUTER_BIAS_MODEL_TYPES = frozenset({"deepseek_v3", "kimi_k2", "glm4_moe", "minimax_m2"})


def _has_correction_bias(config: Mapping[str, Any]) -> bool:
    """Whether each sparse layer's router holds an `[experts]` correction bias: DeepSeek's
    `topk_method: noaux_tc`, or a model type whose router always has one."""
    return (
        config.get("topk_method") == "noaux_tc"
        or config.get("model_type") in _ROUTER_BIAS_MODEL_TYPES
    )


def _expert_field_named(config: Mapping[str, Any], field: str, experts: int) -> str:
    """`<field>=<experts>` with the field as the model's own checkpoints spell it, and the
    spelling this config used where that differs (`num_experts=4 (num_local_experts in
    this config)`)."""
    architectures = config.get("architectures")
    architecture = architectures[0] if isinstance(architectures, list) and architectures else None
    own = _OWN_EXPERT_FIELD.get(str(architecture), field)
    named = f"{own}={experts}"
    return named if own == field else f"{named} ({field} in this config)"


def experts_of_rank(experts: int, rank: int, world_size: int) -> range:
    """The expert ids rank `rank` of `world_size` expert-parallel ranks holds in every MoE
    layer: a contiguous run, `experts / world_size` each, the later ranks taking one more
    where it does not divide (4 experts over 3 ranks: [0], [1], [2, 3]).

    Raises:
        ValueError: more ranks than experts (a rank would hold none).
    """
    if not 0 < world_size <= experts:
        raise ValueError(f"{experts} experts cannot be split over {world_size} ranks")
    return range(rank * experts // world_size, (rank + 1) * experts // world_size)
