"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2) in the lean forward, over a
compressed KV cache.

transformers' `DeepseekV3Attention` projects each token to a latent `c` of `kv_lora_rank`
values (`kv_a_proj_with_mqa`, then `kv_a_layernorm`) and one rope key of
`qk_rope_head_dim` values shared by all heads, and expands the latent through `kv_b_proj`
into every head's non-rotary key (`qk_nope_head_dim`) and value (`v_head_dim`). The cache
here holds only `[c, rotated rope key]` per token and layer (`SlotKVCache` with
`latent_values`: one "head" of `kv_lora_rank + qk_rope_head_dim`; the values are its first
`kv_lora_rank` values, a view), and attention runs in the absorbed form (DeepSeek-V2 paper,
arXiv:2405.04434, section 2.1.2): a head's non-rotary query times `kv_b_proj`'s key rows
for that head is a query in latent space, so

    score(t, s) = (q_nope W_uk) . c_s + q_rope . k_rope_s
    output(t)   = W_uv (sum_s p(t, s) c_s)

— one SDPA call over the cached latents as a single shared key/value head (MQA), then each
head's `[kv_lora_rank]` output through its `v_head_dim` rows of `kv_b_proj`. Absorbed, not
expanded per step: expanding would cost `heads * (nope + v) * kv_lora_rank` multiply-adds
per cached token per step (the whole context, every decode step) where absorbing costs
that once per new token; and the cache stays the latent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from exo.worker.engines.torch.model.direct_forward_parts import (
    LeanUnsupportedError,
    Projection,
    norm_weight,
)

# (queries [1, heads, T, latent + rope], keys [1, 1, T, latent + rope], values [1, 1, T,
# latent], scaling) -> [1, T, heads, latent]: `batch_attention.attend` bound to a step.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def dense_weight(module: nn.Module, in_features: int) -> torch.Tensor:
    """A bias-free linear's weight `[out, in]` float32, whatever holds it (a dense weight,
    or a quantized module read back by multiplying the identity)."""
    if type(module) is nn.Linear:
        return module.weight.detach().float()
    if getattr(module, "bias", None) is not None:
        raise LeanUnsupportedError("a kv_b_proj with a bias")
    with torch.no_grad():
        identity = torch.eye(in_features, dtype=torch.float32)
        return module(identity).float().t().contiguous()


class LeanLatentAttention:
    """One layer's MLA (`DeepseekV3Attention`), called on the normed `[T, hidden]` rows;
    returns the attention's `[T, hidden]` output (all-reduced on a tensor rank, as the
    output projection is).

    On a tensor rank the query projection's last linear (`q_b_proj` / `q_proj`) and
    `kv_b_proj` hold this rank's heads; the latent projection is whole on every rank, so
    every rank caches the same latents.

    Raises:
        LeanUnsupportedError: a projection before the heads that all-reduces.
    """

    __slots__ = (
        "heads", "interleave", "key_up", "kv_down", "kv_norm", "latent", "latent_dtype", "nope",
        "output", "query_down", "query_norm", "query_up", "rope", "scaling", "value", "value_up",
    )  # fmt: skip

    def __init__(self, attention: Any, bf16: bool) -> None:
        config = attention.config
        self.latent = int(config.kv_lora_rank)
        self.rope = int(config.qk_rope_head_dim)
        self.nope = int(config.qk_nope_head_dim)
        self.value = int(config.v_head_dim)
        self.interleave = bool(getattr(config, "rope_interleave", False))
        self.scaling = float(attention.scaling)  # with YaRN's mscale folded in
        self.query_down: Projection | None = None
        self.query_norm: tuple[torch.Tensor, float] | None = None
        if attention.q_proj is None:  # low-rank queries (q_lora_rank)
            self.query_down = Projection([attention.q_a_proj], bf16)
            self.query_norm = norm_weight(attention.q_a_layernorm, 0.0)
            self.query_up = Projection([attention.q_b_proj], bf16)
        else:
            self.query_up = Projection([attention.q_proj], bf16)
        self.kv_down = Projection([attention.kv_a_proj_with_mqa], bf16)
        self.kv_norm = norm_weight(attention.kv_a_layernorm, 0.0)
        for projection in (self.query_down, self.query_up, self.kv_down):
            if projection is not None and projection.reduce:
                raise LeanUnsupportedError("an MLA projection before the heads that all-reduces")
        weight = dense_weight(attention.kv_b_proj, self.latent)  # [heads * (nope + v), latent]
        # The dtype kv_b_proj reads the latent in (bfloat16 around quantized kernels): the
        # cached latent is rounded to it, as transformers' expansion rounds its input.
        self.latent_dtype = Projection([attention.kv_b_proj], bf16).in_dtype
        self.heads = weight.shape[0] // (self.nope + self.value)
        if self.query_up.out_features != self.heads * (self.nope + self.rope):
            raise LeanUnsupportedError("MLA query and kv_b_proj head counts differ")
        per_head = weight.view(self.heads, self.nope + self.value, self.latent)
        self.key_up = per_head[:, : self.nope].contiguous()  # [heads, nope, latent]
        self.value_up = per_head[:, self.nope :].contiguous()  # [heads, v, latent]
        self.output = Projection([attention.o_proj], bf16)

    @property
    def cache_width(self) -> int:
        """Values cached per token: the latent, then the rope key."""
        return self.latent + self.rope

    def __call__(
        self,
        normed: torch.Tensor,
        table: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        attend: Attend,
        attention_dtype: torch.dtype,
    ) -> torch.Tensor:
        """`normed` `[T, hidden]`, `table` the step's rotary `(cos, sin, perm)` over
        `qk_rope_head_dim` → `[T, hidden]` float32. Attention runs in `attention_dtype`
        (float32 over a bfloat16 cache, which stores the latents rounded)."""
        rows = normed.shape[0]
        heads, nope, latent = self.heads, self.nope, self.latent
        if self.query_down is not None and self.query_norm is not None:
            low = self.query_down(normed.to(self.query_down.in_dtype)).float()
            weight, eps = self.query_norm
            low = F.rms_norm(low, (low.shape[-1],), weight, eps)
            query = self.query_up(low.to(self.query_up.in_dtype))
        else:
            query = self.query_up(normed.to(self.query_up.in_dtype))
        query = query.float().view(rows, heads, nope + self.rope)
        compressed = self.kv_down(normed.to(self.kv_down.in_dtype)).float()  # [T, latent+rope]
        weight, eps = self.kv_norm
        content = F.rms_norm(compressed[:, :latent], (latent,), weight, eps)  # [T, latent]
        content = content.to(self.latent_dtype).float()
        # Rotary over the queries' rope parts and the shared rope key together.
        rotary = torch.cat([query[:, :, nope:], compressed[:, None, latent:]], dim=1)
        if self.interleave:  # pairs (x0, x1), (x2, x3)...: evens then odds, as transformers
            rotary = torch.cat([rotary[..., 0::2], rotary[..., 1::2]], dim=-1)
        cos, sin, perm = table
        rotary = rotary * cos + rotary.index_select(-1, perm) * sin  # [T, heads + 1, rope]
        absorbed = torch.einsum("thn,hnl->thl", query[:, :, :nope], self.key_up)
        queries = torch.cat([absorbed, rotary[:, :heads]], dim=-1)  # [T, heads, latent+rope]
        key = torch.cat([content, rotary[:, heads]], dim=-1)  # [T, latent + rope]
        keys = key.view(1, 1, rows, self.cache_width).to(attention_dtype)
        queries = queries.transpose(0, 1).unsqueeze(0).to(attention_dtype)
        attended = attend(queries, keys, keys[..., :latent], self.scaling)  # [1, T, heads, latent]
        values = torch.einsum("thl,hvl->thv", attended[0].float(), self.value_up)  # [T, heads, v]
        out = self.output(values.reshape(rows, heads * self.value).to(self.output.in_dtype))
        return out.float()
