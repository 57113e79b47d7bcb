"""Hugging Face configs of the GGUF architectures transformers' GGUF reader does not know
(5.25 has no `deepseek2` nor `glm4moe`), built from the metadata llama.cpp's converter
(`convert_hf_to_gguf.py`: `DeepseekV2Model`, `Glm4MoeModel`, `TextModel`) writes.

**deepseek2** (DeepSeek-V3 / V3.1 / R1 and Kimi-K2, `DeepseekV2Model`
conversion) becomes a `DeepseekV3Config` (the `deepseek_v3` family). The converter writes
the MLA heads as MQA: files since llama.cpp split `kv_b_proj` into `attn_k_b` / `attn_v_b`
state `attention.head_count_kv` 1, `key_length` = `kv_lora_rank + qk_rope_head_dim`,
`value_length` = `kv_lora_rank` and the real head widths under `key_length_mla` (nope +
rope) / `value_length_mla` (v); older files state the head widths under `key_length` /
`value_length` and keep one `attn_kv_b`. `rope.dimension_count` is `qk_rope_head_dim`;
routing: `expert_count`, `expert_used_count`, `expert_shared_count`,
`leading_dense_block_count` (`first_k_dense_replace`), `expert_weights_scale`
(`routed_scaling_factor`, 1 when absent), `expert_weights_norm` (`norm_topk_prob`, false
when absent), `expert_group_count` / `expert_group_used_count` (`n_group` / `topk_group`;
files older than these keys route over all experts, as llama.cpp then does: 1 / 1) and
`expert_gating_func` (2 sigmoid; 1 softmax, llama.cpp's default when absent, is
DeepSeek-V2's router, which the family does not compute: refused naming the key). YaRN:
`rope.scaling.type` yarn, `.factor`, `.original_context_length`, and
`.yarn_log_multiplier` = 0.1 × DeepSeek's `mscale_all_dim` (the converter's legacy
factor), read back as `mscale` = `mscale_all_dim` (equal in DeepSeek-V3's, Kimi-K2's and
DeepSeek-V2's configs; their ratio is YaRN's cos/sin factor, 1), betas from
`.yarn_beta_fast` / `.yarn_beta_slow` where stated, else llama.cpp's 32 / 1. The MTP
layers are not converted (`skip_mtp`); a `nextn_predict_layers` key is subtracted from
`block_count` all the same. The converter permutes no rows: DeepSeek's interleaved rope is
llama.cpp's "norm" rope (`rope_interleave` true).

**glm4moe** (GLM-4.5, GLM-4.5-Air, GLM-4.6, GLM-4.7) becomes a `Glm4MoeConfig`:
`block_count` counts the `nextn_predict_layers` MTP layers stored after the decoder layers
(`blk.<num_hidden_layers>.nextn.*` and a whole layer beside), left out at conversion;
`key_length` is `head_dim`, `rope.dimension_count` / `key_length` the
`partial_rotary_factor` (GLM's rotate-half rope is llama.cpp's "neox" rope: no
permutation); attention biases and q/k norms where the file has `blk.0.attn_q.bias` /
`blk.0.attn_q_norm.weight`; routing as deepseek2 (gating sigmoid when absent: the
converter always writes it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from exo.download.gguf_tensors import GgufArray, GgufDirectory

DEEPSEEK2 = "deepseek2"
GLM4MOE = "glm4moe"
# llama.cpp's `LLAMA_EXPERT_GATING_FUNC_TYPE_*` (gguf's `ExpertGatingFuncType`).
_GATING_FUNCTIONS = {1: "softmax", 2: "sigmoid"}
# llama.cpp's YaRN betas where a file states none (`llama_cparams` defaults).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
# The converter writes `yarn_log_multiplier` as this times DeepSeek's `mscale_all_dim`.
_YARN_LOG_MULTIPLIER_PER_MSCALE = 0.1
_MISSING = object()


class GgufConfigError(ValueError):
    """A GGUF whose metadata the config cannot be built from (the key named)."""


def _value(directory: GgufDirectory, key: str, default: Any = _MISSING) -> Any:
    """`<architecture>.<key>` of the file's metadata, or `default`.

    Raises:
        GgufConfigError: the key is missing and no default is given.
    """
    name = f"{directory.architecture}.{key}"
    value = directory.metadata.get(name)
    if value is None:
        if default is _MISSING:
            raise GgufConfigError(f"the GGUF has no {name} in its metadata")
        return default
    return value


def decoder_layers(directory: GgufDirectory) -> int:
    """The decoder layers a model runs: `block_count` less the MTP layers
    (`nextn_predict_layers`) stored after them."""
    return int(_value(directory, "block_count")) - int(_value(directory, "nextn_predict_layers", 0))


def _routing(directory: GgufDirectory, default_gating: str) -> dict[str, Any]:
    """The DeepSeek-V3-style routing fields (module docstring)."""
    gating = _value(directory, "expert_gating_func", None)
    scoring = default_gating if gating is None else _GATING_FUNCTIONS.get(int(gating))
    if scoring != "sigmoid":
        key = f"{directory.architecture}.expert_gating_func"
        stated = "absent (llama.cpp: softmax)" if gating is None else f"{gating} ({scoring})"
        raise GgufConfigError(
            f"{key} is {stated}: this architecture is read with sigmoid routing (2) only "
            "(DeepSeek-V2's softmax router is not computed by the deepseek_v3 family)"
        )
    return {
        "n_routed_experts": int(_value(directory, "expert_count")),
        "num_experts_per_tok": int(_value(directory, "expert_used_count")),
        "n_shared_experts": int(_value(directory, "expert_shared_count", 0)),
        "moe_intermediate_size": int(_value(directory, "expert_feed_forward_length")),
        "first_k_dense_replace": int(_value(directory, "leading_dense_block_count", 0)),
        "routed_scaling_factor": float(_value(directory, "expert_weights_scale", 1.0)),
        "norm_topk_prob": bool(_value(directory, "expert_weights_norm", False)),
        "n_group": int(_value(directory, "expert_group_count", 1)),
        "topk_group": int(_value(directory, "expert_group_used_count", 1)),
        "scoring_func": scoring,
    }


def _common(directory: GgufDirectory) -> dict[str, Any]:
    """The dense fields every config here has."""
    tokens = directory.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GgufArray) or not tokens.count:
        raise GgufConfigError("the GGUF has no tokenizer.ggml.tokens")
    names = {tensor.name for tensor in directory.tensors}
    heads = int(_value(directory, "attention.head_count"))
    fields: dict[str, Any] = {
        "vocab_size": tokens.count,
        "hidden_size": int(_value(directory, "embedding_length")),
        "intermediate_size": int(_value(directory, "feed_forward_length")),
        "num_hidden_layers": decoder_layers(directory),
        "num_attention_heads": heads,
        "rms_norm_eps": float(_value(directory, "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_value(directory, "context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "dtype": "float32",
        **special_token_ids(directory),
    }
    return fields


def special_token_ids(directory: GgufDirectory) -> dict[str, int]:
    """The config's `bos_token_id` / `eos_token_id` / `pad_token_id` the file states
    (`tokenizer.ggml.*`)."""
    found: dict[str, int] = {}
    for key, field in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                       ("padding_token_id", "pad_token_id")):  # fmt: skip
        value = directory.metadata.get(f"tokenizer.ggml.{key}")
        if isinstance(value, int):
            found[field] = value
    return found


def _rope_parameters(directory: GgufDirectory, theta: float) -> dict[str, Any]:
    """Plain rope, or DeepSeek's YaRN (module docstring).

    Raises:
        GgufConfigError: a scaling type other than none / yarn, or yarn without its keys.
    """
    scaling = _value(directory, "rope.scaling.type", None)
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise GgufConfigError(
            f"{directory.architecture}.rope.scaling.type={scaling!r}: read with yarn or none"
        )
    log_multiplier = np.float32(_value(directory, "rope.scaling.yarn_log_multiplier", 0.0))
    # in float32, as the file stores it (0.1 * 1.0 reads back as 1.0, not 1.0000000149)
    mscale = float(log_multiplier / np.float32(_YARN_LOG_MULTIPLIER_PER_MSCALE))
    return {
        "rope_type": "yarn",
        "rope_theta": theta,
        "factor": float(_value(directory, "rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _value(directory, "rope.scaling.original_context_length")
        ),
        "beta_fast": float(_value(directory, "rope.scaling.yarn_beta_fast", YARN_BETA_FAST)),
        "beta_slow": float(_value(directory, "rope.scaling.yarn_beta_slow", YARN_BETA_SLOW)),
        "mscale": mscale,
        "mscale_all_dim": mscale,
    }


def deepseek2_fields(directory: GgufDirectory) -> dict[str, Any]:
    """`DeepseekV3Config` fields of a `deepseek2` GGUF (module docstring).

    Raises:
        GgufConfigError: a key it needs is missing, softmax routing, or head widths that
            do not add up (named).
    """
    rope = int(_value(directory, "rope.dimension_count"))
    mla_key = _value(directory, "attention.key_length_mla", None)
    key = int(mla_key if mla_key is not None else _value(directory, "attention.key_length"))
    value_key = "attention.value_length_mla" if mla_key is not None else "attention.value_length"
    if key <= rope:
        raise GgufConfigError(
            f"{directory.architecture}.attention.key_length{'_mla' if mla_key else ''}={key} "
            f"leaves no non-rotary key values beside rope.dimension_count={rope}"
        )
    q_rank = _value(directory, "attention.q_lora_rank", None)
    fields = {
        **_common(directory),
        **_routing(directory, "softmax"),
        "model_type": "deepseek_v3",
        "architectures": ["DeepseekV3ForCausalLM"],
        "num_key_value_heads": int(_value(directory, "attention.head_count")),
        "q_lora_rank": int(q_rank) if q_rank else None,
        "kv_lora_rank": int(_value(directory, "attention.kv_lora_rank")),
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": key - rope,
        "v_head_dim": int(_value(directory, value_key)),
        "head_dim": rope,  # DeepseekV3Config's own: the rope width
        "rope_interleave": True,
        "attention_bias": False,
        "rope_parameters": _rope_parameters(directory, float(_value(directory, "rope.freq_base"))),
    }
    return fields


def glm4moe_fields(directory: GgufDirectory) -> dict[str, Any]:
    """`Glm4MoeConfig` fields of a `glm4moe` GGUF (module docstring).

    Raises:
        GgufConfigError: a key it needs is missing, or softmax routing (named).
    """
    names = {tensor.name for tensor in directory.tensors}
    heads = int(_value(directory, "attention.head_count"))
    hidden = int(_value(directory, "embedding_length"))
    head_dim = int(_value(directory, "attention.key_length", hidden // heads))
    rope = int(_value(directory, "rope.dimension_count", head_dim))
    theta = float(_value(directory, "rope.freq_base"))
    return {
        **_common(directory),
        **_routing(directory, "sigmoid"),
        "model_type": "glm4_moe",
        "architectures": ["Glm4MoeForCausalLM"],
        "num_key_value_heads": int(_value(directory, "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "use_qk_norm": "blk.0.attn_q_norm.weight" in names,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": theta,
            "partial_rotary_factor": rope / head_dim,
        },
    }


# GGUF architecture → its config fields from metadata.
METADATA_CONFIGS: dict[str, Callable[[GgufDirectory], dict[str, Any]]] = {
    DEEPSEEK2: deepseek2_fields,
    GLM4MOE: glm4moe_fields,
}


def metadata_config(directory: GgufDirectory) -> Any:
    """The transformers config of a GGUF of `METADATA_CONFIGS` (float32).

    Raises:
        GgufConfigError: as the architecture's fields function.
    """
    from transformers import DeepseekV3Config, Glm4MoeConfig

    fields = METADATA_CONFIGS[directory.architecture](directory)
    fields.pop("model_type")  # the class says it
    config_class = DeepseekV3Config if directory.architecture == DEEPSEEK2 else Glm4MoeConfig
    return config_class(**fields)
