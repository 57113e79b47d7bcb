"""exo's own forward for EmbeddingGemma: the Gemma 3 text model (`gemma3_text`) with
bidirectional attention (`use_bidirectional_attention: true`), read from its checkpoint.

The layer is Gemma 3's decoder layer (the `gemma3` family's layout: RMSNorms scaling by
`1 + weight` before and after attention and the MLP, Q/K norms, GELU-tanh gated MLP, embeddings
scaled by `sqrt(hidden)`, queries scaled by `query_pre_attn_scalar ** -0.5`, RoPE per layer type),
with every causal mask replaced: a full-attention layer sees every real token of its input, a
sliding layer the real tokens within `sliding_window // 2` positions either side (transformers'
reading of EmbeddingGemma's config: `sliding_window = sliding_window // 2 + 1` as an exclusive
distance bound). The config is parsed by transformers' `Gemma3TextConfig` (which converts older
rope fields); no transformers model code runs. Everything runs in float32.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.embedding.weights import EmbeddingModelError, take, weight_prefix
from exo.worker.engines.torch.model.families.gemma3 import FAMILY as GEMMA3
from exo.worker.engines.torch.model.families.spec import attention_windows_from_layer_types

GEMMA_MODEL_TYPE = "gemma3_text"
_LAYER_TENSORS = (
    "input_layernorm.weight",
    "self_attn.q_proj.weight",
    "self_attn.k_proj.weight",
    "self_attn.v_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "post_attention_layernorm.weight",
    "pre_feedforward_layernorm.weight",
    "mlp.gate_proj.weight",
    "mlp.up_proj.weight",
    "mlp.down_proj.weight",
    "post_feedforward_layernorm.weight",
)


def gemma_config(config: Mapping[str, Any], origin: str) -> Any:
    """`config.json` of an EmbeddingGemma checkpoint as transformers' `Gemma3TextConfig`.

    Raises:
        EmbeddingModelError: not `gemma3_text`, not bidirectional (a causal Gemma 3 is a chat
            model: its embeddings are the decoder engine's), with attention-logit softcapping or
            an MLP activation other than GELU-tanh.
    """
    from transformers import Gemma3TextConfig

    if config.get("model_type") != GEMMA_MODEL_TYPE:
        raise EmbeddingModelError(
            f"{origin}: model_type {config.get('model_type')!r} is not gemma3_text"
        )
    if not config.get("use_bidirectional_attention"):
        raise EmbeddingModelError(f"{origin}: use_bidirectional_attention is not true")
    if config.get("attn_logit_softcapping") is not None:
        raise EmbeddingModelError(f"{origin}: attn_logit_softcapping is not supported")
    activation = config.get("hidden_activation", "gelu_pytorch_tanh")
    if activation != "gelu_pytorch_tanh":
        raise EmbeddingModelError(f"{origin}: hidden_activation {activation!r} is not supported")
    fields = {key: value for key, value in config.items() if key not in ("architectures",)}
    return Gemma3TextConfig.from_dict(fields)


def _inverse_frequencies(rope: Mapping[str, Any], head_dim: int, origin: str) -> torch.Tensor:
    """RoPE's `[head_dim / 2]` inverse frequencies for one layer type's `rope_parameters`:
    `theta ** (-2i / d)`, divided by `factor` for linear scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inverse = 1.0 / (float(rope["rope_theta"]) ** exponents)
    kind = rope.get("rope_type", "default")
    if kind == "linear":
        return inverse / float(rope["factor"])
    if kind != "default":
        raise EmbeddingModelError(f"{origin}: rope_type {kind!r} is not supported")
    return inverse


class GemmaEncoder:
    """A loaded EmbeddingGemma text model: `forward(ids, mask)` -> its final-norm hidden
    states. Holds plain tensors (each layer's in `_LAYER_TENSORS` order)."""

    def __init__(self, config: Any, tensors: Mapping[str, torch.Tensor], origin: str) -> None:
        """Raises:
        EmbeddingModelError: a tensor is missing."""
        prefix = weight_prefix(tensors, "embed_tokens.weight")
        self.config = config
        assert GEMMA3.layout is not None  # the gemma3 family states its layout
        self.norm_offset = GEMMA3.layout.norm_offset
        self.embed = take(tensors, prefix + "embed_tokens.weight")
        self.final_norm = take(tensors, prefix + "norm.weight")
        self.layers = [
            [take(tensors, f"{prefix}layers.{index}.{name}") for name in _LAYER_TENSORS]
            for index in range(config.num_hidden_layers)
        ]
        self.layer_types: list[str] = list(config.layer_types)
        # Exclusive distance bound of each sliding layer (None: full attention).
        self.windows = attention_windows_from_layer_types(config)
        self.head_dim = int(config.head_dim)
        self.inverse_frequencies = {
            kind: _inverse_frequencies(config.rope_parameters[kind], self.head_dim, origin)
            for kind in set(self.layer_types)
        }

    def _norm(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma's RMSNorm: `x / rms(x) * (offset + weight)` over the last dimension."""
        variance = hidden.pow(2).mean(-1, keepdim=True)
        normed = hidden * torch.rsqrt(variance + self.config.rms_norm_eps)
        return normed * (self.norm_offset + weight)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states.

        Args:
            ids: `[B, S]` token ids, right-padded.
            mask: `[B, S]` bool, True on each input's tokens.

        Returns:
            `[B, S, hidden]` float32 (rows past an input's end are meaningless).
        """
        config = self.config
        batch, length = ids.shape
        hidden = self.embed[ids] * torch.tensor(config.hidden_size**0.5, dtype=torch.float32)
        positions = torch.arange(length, dtype=torch.float32)
        rotations = {}
        for kind, inverse in self.inverse_frequencies.items():
            angles = torch.outer(positions, inverse)
            angles = torch.cat([angles, angles], dim=-1)  # [S, head_dim]
            rotations[kind] = (angles.cos(), angles.sin())
        keys_seen = mask[:, None, None, :]  # [B, 1, 1, S]
        distance = (positions[:, None] - positions[None, :]).abs()  # [S, S]
        masks: dict[int | None, torch.Tensor] = {None: keys_seen}
        for window in set(self.windows) - {None}:
            assert window is not None
            masks[window] = keys_seen & (distance < window)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        scale = float(config.query_pre_attn_scalar) ** -0.5
        for layer, kind, window in zip(self.layers, self.layer_types, self.windows, strict=True):
            (
                input_norm, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm,
                post_attention_norm, pre_mlp_norm, gate, up, down, post_mlp_norm,
            ) = layer  # fmt: skip
            normed = self._norm(hidden, input_norm)
            query = F.linear(normed, q_proj).view(batch, length, heads, self.head_dim)
            key = F.linear(normed, k_proj).view(batch, length, kv_heads, self.head_dim)
            value = F.linear(normed, v_proj).view(batch, length, kv_heads, self.head_dim)
            query = self._norm(query, q_norm).transpose(1, 2)
            key = self._norm(key, k_norm).transpose(1, 2)
            cos, sin = rotations[kind]
            query, key = _rotate(query, cos, sin), _rotate(key, cos, sin)
            attended = F.scaled_dot_product_attention(
                query, key, value.transpose(1, 2), attn_mask=masks[window], scale=scale,
                enable_gqa=heads != kv_heads,
            )  # fmt: skip
            attended = attended.transpose(1, 2).reshape(batch, length, heads * self.head_dim)
            hidden = hidden + self._norm(F.linear(attended, o_proj), post_attention_norm)
            normed = self._norm(hidden, pre_mlp_norm)
            inner = F.gelu(F.linear(normed, gate), approximate="tanh") * F.linear(normed, up)
            hidden = hidden + self._norm(F.linear(inner, down), post_mlp_norm)
        return self._norm(hidden, self.final_norm)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout over `[..., S, head_dim]`."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin
