"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) from a `config.json`, without
transformers: the ranks cards state (`cards.card_from_config`), the load-time check of a
card (`profile.card_mismatches`) and the KV geometry (`kv_cache_memory.kv_geometry`) read.
The engine runs it in `worker/engines/torch/model/direct_forward_mla.py`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exo.shared.types.models import LatentAttention

# Model types and architectures whose attention is MLA (Kimi-K2's config says `kimi_k2`
# over DeepseekV3ForCausalLM).
LATENT_ATTENTION_MODEL_TYPES = ("deepseek_v2", "deepseek_v3", "kimi_k2")
LATENT_ATTENTION_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_REQUIRED = ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim")


def latent_attention_of_config(config: Mapping[str, Any]) -> LatentAttention | None:
    """The MLA ranks a (text) config states, None for another attention (no MLA model type
    or architecture and no `kv_lora_rank`).

    Raises:
        ValueError: an MLA config without a positive `kv_lora_rank` (or rope / nope / value
            head width); the message names the field.
    """
    architectures = config.get("architectures") or ()
    latent = (
        config.get("model_type") in LATENT_ATTENTION_MODEL_TYPES
        or any(name in LATENT_ATTENTION_ARCHITECTURES for name in architectures)
        or config.get("kv_lora_rank") is not None
    )
    if not latent:
        return None
    values: dict[str, int] = {}
    for name in _REQUIRED:
        value = config.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(
                f"{name}={value!r}: multi-head latent attention needs it as a positive integer "
                "(the latent / head widths the KV cache and projections are sized by)"
            )
        values[name] = value
    q_rank = config.get("q_lora_rank")
    if q_rank is not None and (not isinstance(q_rank, int) or q_rank <= 0):
        raise ValueError(f"q_lora_rank={q_rank!r}: a positive integer, or null for one q_proj")
    return LatentAttention(**values, q_lora_rank=q_rank)


def latent_attention_parameters(latent: LatentAttention, hidden: int, heads: int) -> int:
    """Weights of one MLA layer's attention (transformers' `DeepseekV3Attention`, no
    biases): the query path (`q_a_proj`, its norm, `q_b_proj`; or `q_proj`),
    `kv_a_proj_with_mqa`, its norm, `kv_b_proj` and `o_proj`."""
    query = heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim)
    rank = latent.q_lora_rank
    count = hidden * rank + rank + rank * query if rank else hidden * query
    count += hidden * (latent.kv_lora_rank + latent.qk_rope_head_dim) + latent.kv_lora_rank
    count += latent.kv_lora_rank * heads * (latent.qk_nope_head_dim + latent.v_head_dim)
    return count + heads * latent.v_head_dim * hidden
