"""How many bytes the KV cache takes: the dtype keys and values are stored in, the KV
geometry of a rank (`KVGeometry`, from a card or a loaded model's config), bytes per token,
sliding-window layers' shorter footprint, and the KV budget a runner is given.

Apart from `memory` (the weights' bytes) because the engine, the scheduler and the API
size the KV cache from here without sizing weights; `memory.serving_peak_bytes` adds this
budget to a share's weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from exo.shared.models.architectures import is_encoder_architecture
from exo.shared.models.weight_formats import FLOAT32_BYTES
from exo.shared.models.weight_share import WeightShare, kv_heads_per_rank, whole_model
from exo.shared.types.models import ModelCard

# How a runner stores keys and values (`--kv-cache-dtype`): bfloat16 by default on CPU (half
# the bytes per token of float32; products and sums stay float32, only the stored values are
# rounded: the cost, teacher-forced against float32 KV, is in
# docs/benchmarks/2026-12-05-kv-bf16.md), float32 where a test or the user asks; on other
# devices the model's dtype (`kv_cache_torch_dtype`).
KVCacheDtype = Literal["bfloat16", "float32"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("bfloat16", "float32")
DEFAULT_KV_CACHE_DTYPE: KVCacheDtype = "bfloat16"
KV_CACHE_DTYPE_BYTES: dict[KVCacheDtype, int] = {"bfloat16": 2, "float32": FLOAT32_BYTES}
# Bytes of one stored key or value placement sizes the KV cache with (the default dtype's;
# a node storing float32 keeps to the same bytes with half the tokens:
# `kv_cache_tokens_for_dtype`).
KV_CACHE_VALUE_BYTES = KV_CACHE_DTYPE_BYTES[DEFAULT_KV_CACHE_DTYPE]


def kv_cache_tokens_for_dtype(tokens: int, dtype: KVCacheDtype | None) -> int:
    """The tokens a KV budget of `tokens` at `KV_CACHE_VALUE_BYTES` per value (what placement
    reserved) holds in `dtype`'s bytes (None: the default dtype): the same memory, fewer
    tokens for a wider dtype (at least 1)."""
    if dtype is None:
        return tokens
    return max(1, tokens * KV_CACHE_VALUE_BYTES // KV_CACHE_DTYPE_BYTES[dtype])


# Tokens of KV cache placement checks a node can hold for a runner (running requests and
# the prefix cache together): eight concurrent requests of 1,024 tokens, or one of 8,192.
# A node's `--kv-cache-tokens` replaces it (`NodeInfo.kv_cache_tokens`); without one,
# placement gives each runner this plus a fraction of the node's memory left
# (`exo.master.placement_memory.memory_sized_kv_cache_tokens`), in `Instance.kv_cache_tokens`.
DEFAULT_KV_CACHE_TOKENS = 8_192
# The smallest budget a node accepts: one request of a few hundred tokens.
MIN_KV_CACHE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV cache of one rank: `layers` decoder layers, each holding `kv_heads` key and
    value heads of `head_dim` values per token. The one place KV sizes are computed:
    placement and speed prediction build it from the card (`kv_geometry`), the engine from
    the loaded model's config (`kv_geometry_of_config`)."""

    layers: int
    kv_heads: int
    head_dim: int
    latent_values: int = 0
    value_bytes: int = KV_CACHE_VALUE_BYTES

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes: layers × KV heads × head dim × 2 (a key and a value) ×
        `value_bytes` (default `KV_CACHE_VALUE_BYTES`); with multi-head latent attention
        (`latent_values` > 0: the values are the first `latent_values` of each key) the key
        alone."""
        kinds = 1 if self.latent_values else 2
        return self.layers * self.kv_heads * self.head_dim * kinds * self.value_bytes


def latent_kv_geometry(text_config: Any, layers: int) -> KVGeometry | None:
    """The KV geometry of multi-head latent attention (a config with `kv_lora_rank`:
    DeepSeek-V2/V3, Kimi-K2), duck-typed over a transformers config: per layer and token one
    compressed "head" of `kv_lora_rank + qk_rope_head_dim` values (the normed latent, the
    rotated rope key), whose first `kv_lora_rank` values serve as the values; the same on
    every tensor rank (all heads share the latent). None for other attention. Source:
    DeepSeek-V2 paper (arXiv:2405.04434), section 2.1."""
    rank = getattr(text_config, "kv_lora_rank", None)
    if not rank:
        return None
    rope = int(getattr(text_config, "qk_rope_head_dim", 0) or 0)
    return KVGeometry(layers, 1, int(rank) + rope, latent_values=int(rank))


def kv_geometry(card: ModelCard, share: WeightShare | None = None) -> KVGeometry:
    """The KV geometry of a node holding `share` of `card`'s model (the whole model when
    None): its layers, its part of the KV heads (multi-head latent attention: one latent
    head, whole on every tensor rank; `latent_kv_geometry`)."""
    share = share or whole_model(card)
    latent = card.latent_attention
    if latent is not None:  # MLA: one latent + rope key per layer, on every tensor rank
        width = latent.kv_lora_rank + latent.qk_rope_head_dim
        return KVGeometry(share.layers, 1, width, latent_values=latent.kv_lora_rank)
    return KVGeometry(
        layers=share.layers,
        kv_heads=share.kv_heads(card),
        head_dim=card.attention_head_dim,
    )


def kv_geometry_of_config(
    text_config: Any, layers: int, tensor_parallel_ranks: int = 1
) -> KVGeometry:
    """The KV geometry of a loaded model from its (text) transformers config, duck-typed so
    this module stays free of transformers: `num_key_value_heads` (else the attention
    heads), `head_dim` (else hidden size / heads).

    Args:
        text_config: the model's text config.
        layers: decoder layers this rank holds.
        tensor_parallel_ranks: ranks the KV heads are split over.
    """
    latent = latent_kv_geometry(text_config, layers)
    if latent is not None:
        return latent
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    return KVGeometry(layers, kv_heads_per_rank(kv_heads, tensor_parallel_ranks), head_dim)


def kv_cache_bytes_per_token(card: ModelCard, share: WeightShare | None = None) -> int:
    """Bytes of KV cache one token takes on a node holding `share` (`KVGeometry`); 0 for
    an encoder card (no KV cache: every input is one bidirectional forward)."""
    if is_encoder_architecture(card.architecture):
        return 0
    return kv_geometry(card, share).bytes_per_token


# A sliding-window layer keeps, beyond its window, up to this many positions of a sequence
# (the engine releases the ones its window no longer sees `SLIDING_WINDOW_TRIM_CHUNK` at a
# time, `SLIDING_WINDOW_TRIM_SLACK` behind the window: worker/engines/torch/batching/
# kv_footprint.py, which says why).
SLIDING_WINDOW_TRIM_SLACK = 128
SLIDING_WINDOW_TRIM_CHUNK = 64
SLIDING_WINDOW_EXTRA_POSITIONS = SLIDING_WINDOW_TRIM_SLACK + SLIDING_WINDOW_TRIM_CHUNK - 1


def kv_budget_tokens_of_length(card: ModelCard, length: int) -> int:
    """KV budget tokens (tokens of every layer: `kv_cache_bytes_per_token` bytes each) one
    sequence of `length` tokens holds: `ceil((F x length + S x min(length, window +
    SLIDING_WINDOW_EXTRA_POSITIONS)) / layers)` with `S` the card's sliding-window layers
    and `F` the others; `length` for a card without them."""
    sliding = card.sliding_window
    if sliding is None:
        return length
    layers = card.n_layers
    kept = min(length, sliding.window + SLIDING_WINDOW_EXTRA_POSITIONS)
    return -(-((layers - sliding.layers) * length + sliding.layers * kept) // layers)


def longest_length_in_kv_budget(card: ModelCard, budget_tokens: int) -> int:
    """The longest sequence whose `kv_budget_tokens_of_length` fits `budget_tokens`
    (`budget_tokens` itself for a card without sliding-window layers; a card whose every
    layer slides fits any length past its window: `budget_tokens x layers` then)."""
    sliding = card.sliding_window
    kept = 0 if sliding is None else sliding.window + SLIDING_WINDOW_EXTRA_POSITIONS
    if sliding is None or budget_tokens <= kept:
        return max(0, budget_tokens)
    full = card.n_layers - sliding.layers
    if full <= 0:
        return budget_tokens * card.n_layers
    return (card.n_layers * budget_tokens - sliding.layers * kept) // full


def kv_cache_budget_bytes(
    card: ModelCard, share: WeightShare | None = None, tokens: int | None = None
) -> int:
    """The KV cache memory a runner holding `share` may use: `tokens` (default
    `DEFAULT_KV_CACHE_TOKENS`) times `kv_cache_bytes_per_token`."""
    budget_tokens = DEFAULT_KV_CACHE_TOKENS if tokens is None else tokens
    return budget_tokens * kv_cache_bytes_per_token(card, share)
