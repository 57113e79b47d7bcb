"""exo's own forward for BERT-style encoders: BERT (`bert`), XLM-RoBERTa / RoBERTa
(`xlm-roberta`, `roberta`) and NomicBERT (`nomic_bert`), read from the checkpoint's tensors.

All three are post-norm transformer encoders (Devlin et al. 2018, "BERT", arXiv 1810.04805):
embeddings -> LayerNorm, then per layer `x = LN(x + Attention(x)); x = LN(x + MLP(x))`, with
bidirectional attention over the unpadded tokens (a key-padding mask; no KV cache, no causal
mask). They differ in:
- positions: BERT adds learned absolute position embeddings from 0; RoBERTa's start at
  `pad_token_id + 1` and skip padding (fairseq's `make_positions`, as transformers'
  `create_position_ids_from_input_ids`); NomicBERT has none and rotates queries and keys
  instead (RoPE, Su et al. 2021, arXiv 2104.09864, the half-split layout, base
  `rotary_emb_base` = 1000);
- the MLP: `fc2(act(fc1(x)))` with biases (BERT, RoBERTa: GELU) or SwiGLU without biases
  (NomicBERT: `fc2(silu(fc12(x)) * fc11(x))`, Shazeer 2020, arXiv 2002.05202);
- biases: NomicBERT's projections have none.

Tensor names are the checkpoints' own (transformers' `BertModel` / `XLMRobertaModel` layout,
NomicBERT's custom-code layout `encoder.layers.N.attn.Wqkv` that nomic-embed-text ships), under
any prefix a task head adds (`bert.`, `roberta.`). Q, K and V are fused into one projection at
load. Everything runs in float32.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.embedding.weights import (
    EmbeddingModelError,
    config_field,
    required_field,
    take,
    weight_prefix,
)

ENCODER_MODEL_TYPES = ("bert", "roberta", "xlm-roberta", "nomic_bert")
# Transformers' names for the activations BERT-style configs state (`hidden_act`).
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "swish": F.silu,
}


@dataclass(frozen=True, slots=True)
class EncoderGeometry:
    """An encoder's shapes and variant, read from its `config.json`.

    Attributes:
        positions: "absolute" (BERT), "offset" (RoBERTa: from `pad_token_id + 1`) or
            "rotary" (NomicBERT).
        gated: the MLP is SwiGLU (NomicBERT) rather than `fc2(act(fc1(x)))`.
        max_positions: tokens one input may have (RoBERTa: `max_position_embeddings - 2`,
            the padding index and the positions below it being unused).
    """

    model_type: str
    hidden_size: int
    heads: int
    layers: int
    layer_norm_eps: float
    activation: str
    positions: str
    gated: bool
    pad_token_id: int
    max_positions: int
    rope_base: float = 1000.0


def encoder_geometry(config: Mapping[str, Any], origin: str) -> EncoderGeometry:
    """The geometry of a BERT / RoBERTa / XLM-RoBERTa / NomicBERT `config.json`; NomicBERT's
    custom-code names (`n_embd`, `n_head`, `n_layer`, `layer_norm_epsilon`,
    `rotary_emb_base`, `max_trained_positions`) are read as well as transformers' own.

    Raises:
        EmbeddingModelError: another model type, or a variant this forward does not compute
            (pre-norm NomicBERT, interleaved or partial rotary, an unknown activation,
            relative position embeddings), named.
    """
    model_type = str(config.get("model_type"))
    if model_type not in ENCODER_MODEL_TYPES:
        raise EmbeddingModelError(
            f"{origin}: model_type {model_type!r} is not an encoder exo computes "
            f"({', '.join(ENCODER_MODEL_TYPES)})"
        )
    hidden = int(required_field(config, origin, "hidden_size", "n_embd"))
    heads = int(required_field(config, origin, "num_attention_heads", "n_head"))
    layers = int(required_field(config, origin, "num_hidden_layers", "n_layer"))
    eps = float(config_field(config, "layer_norm_eps", "layer_norm_epsilon", default=1e-12))
    pad = int(config_field(config, "pad_token_id", default=1 if "roberta" in model_type else 0))
    if hidden % heads:
        raise EmbeddingModelError(f"{origin}: hidden size {hidden} is not a multiple of {heads}")
    if model_type == "nomic_bert":
        for field, wanted in (
            ("prenorm", False),
            ("rotary_emb_interleaved", False),
            ("rotary_emb_fraction", 1.0),
        ):
            if field in config and config[field] != wanted:
                raise EmbeddingModelError(f"{origin}: {field} {config[field]!r} is not supported")
        rope = config.get("rope_parameters") or {}
        base = float(config_field(rope, "rope_theta", default=None) or 0) or float(
            config_field(config, "rotary_emb_base", "rope_theta", default=1000.0)
        )
        activation = str(config_field(config, "activation_function", "hidden_act", default="silu"))
        activation = "silu" if activation == "swiglu" else activation
        max_positions = int(
            config_field(
                config, "max_trained_positions", "max_position_embeddings", "n_positions",
                default=2048,
            )
        )  # fmt: skip
        return EncoderGeometry(
            model_type, hidden, heads, layers, eps, _activation(activation, origin), "rotary",
            gated=True, pad_token_id=pad, max_positions=max_positions, rope_base=base,
        )  # fmt: skip
    kind = config.get("position_embedding_type", "absolute")
    if kind not in (None, "absolute"):
        raise EmbeddingModelError(f"{origin}: position_embedding_type {kind!r} is not supported")
    offset = "roberta" in model_type
    max_positions = int(required_field(config, origin, "max_position_embeddings"))
    return EncoderGeometry(
        model_type, hidden, heads, layers, eps,
        _activation(str(config.get("hidden_act", "gelu")), origin),
        "offset" if offset else "absolute", gated=False, pad_token_id=pad,
        max_positions=max_positions - (pad + 1 if offset else 0),
    )  # fmt: skip


def _activation(name: str, origin: str) -> str:
    if name not in _ACTIVATIONS:
        raise EmbeddingModelError(f"{origin}: hidden_act {name!r} is not supported")
    return name


@dataclass(slots=True)
class EncoderLayer:
    """One layer's tensors: `qkv` `[3 * hidden, hidden]` (Q, K, V stacked), `up` `[inner,
    hidden]` or, gated, `[2 * inner, hidden]` (gate rows first, then up); biases None where
    the checkpoint has none; norms `(weight, bias)`."""

    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    out: torch.Tensor
    out_bias: torch.Tensor | None
    attention_norm: tuple[torch.Tensor, torch.Tensor]
    up: torch.Tensor
    up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None
    mlp_norm: tuple[torch.Tensor, torch.Tensor]


class Encoder:
    """A loaded BERT-style encoder: `forward(ids, mask)` -> the last layer's hidden states.

    Built from the checkpoint's tensors with `Encoder.from_tensors`; holds only plain
    tensors (no `nn.Module`).
    """

    def __init__(
        self,
        geometry: EncoderGeometry,
        word: torch.Tensor,
        position: torch.Tensor | None,
        token_type: torch.Tensor | None,
        embedding_norm: tuple[torch.Tensor, torch.Tensor],
        layers: list[EncoderLayer],
    ) -> None:
        self.geometry = geometry
        self.word = word
        self.position = position
        # Every input is one segment: token type 0 everywhere (as transformers' default).
        self.token_type_row = None if token_type is None else token_type[0]
        self.embedding_norm = embedding_norm
        self.layers = layers
        head_dim = geometry.hidden_size // geometry.heads
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inverse_frequencies = 1.0 / (geometry.rope_base**exponents)

    @classmethod
    def from_tensors(
        cls, geometry: EncoderGeometry, tensors: Mapping[str, torch.Tensor]
    ) -> Encoder:
        """The encoder whose weights are `tensors` (a checkpoint's names, any prefix).

        Raises:
            EmbeddingModelError: a tensor the geometry needs is missing.
        """
        prefix = weight_prefix(tensors, "embeddings.word_embeddings.weight")

        def get(name: str) -> torch.Tensor:
            return take(tensors, prefix + name)

        def optional(name: str) -> torch.Tensor | None:
            return tensors.get(prefix + name)

        layers: list[EncoderLayer] = []
        if geometry.model_type == "nomic_bert":
            embedding_norm = (get("emb_ln.weight"), get("emb_ln.bias"))
            for index in range(geometry.layers):
                at = f"encoder.layers.{index}."
                layers.append(
                    EncoderLayer(
                        qkv=get(at + "attn.Wqkv.weight"),
                        qkv_bias=optional(at + "attn.Wqkv.bias"),
                        out=get(at + "attn.out_proj.weight"),
                        out_bias=optional(at + "attn.out_proj.bias"),
                        attention_norm=(get(at + "norm1.weight"), get(at + "norm1.bias")),
                        # fc12 is SwiGLU's gate, fc11 the value it scales.
                        up=torch.cat([get(at + "mlp.fc12.weight"), get(at + "mlp.fc11.weight")]),
                        up_bias=None,
                        down=get(at + "mlp.fc2.weight"),
                        down_bias=optional(at + "mlp.fc2.bias"),
                        mlp_norm=(get(at + "norm2.weight"), get(at + "norm2.bias")),
                    )
                )
        else:
            embedding_norm = (get("embeddings.LayerNorm.weight"), get("embeddings.LayerNorm.bias"))
            for index in range(geometry.layers):
                at = f"encoder.layer.{index}."
                parts = ("query", "key", "value")
                layers.append(
                    EncoderLayer(
                        qkv=torch.cat([get(f"{at}attention.self.{p}.weight") for p in parts]),
                        qkv_bias=torch.cat([get(f"{at}attention.self.{p}.bias") for p in parts]),
                        out=get(at + "attention.output.dense.weight"),
                        out_bias=get(at + "attention.output.dense.bias"),
                        attention_norm=(
                            get(at + "attention.output.LayerNorm.weight"),
                            get(at + "attention.output.LayerNorm.bias"),
                        ),
                        up=get(at + "intermediate.dense.weight"),
                        up_bias=get(at + "intermediate.dense.bias"),
                        down=get(at + "output.dense.weight"),
                        down_bias=get(at + "output.dense.bias"),
                        mlp_norm=(
                            get(at + "output.LayerNorm.weight"),
                            get(at + "output.LayerNorm.bias"),
                        ),
                    )
                )
        position = None
        if geometry.positions != "rotary":
            position = get("embeddings.position_embeddings.weight")
        return cls(
            geometry,
            word=get("embeddings.word_embeddings.weight"),
            position=position,
            token_type=optional("embeddings.token_type_embeddings.weight"),
            embedding_norm=embedding_norm,
            layers=layers,
        )

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states.

        Args:
            ids: `[B, S]` token ids, right-padded (any id past an input's end).
            mask: `[B, S]` bool, True on each input's tokens.

        Returns:
            `[B, S, hidden]` float32 (rows past an input's end are meaningless).
        """
        geometry = self.geometry
        batch, length = ids.shape
        hidden = self.word[ids]
        if self.token_type_row is not None:
            hidden = hidden + self.token_type_row
        rotation = None
        if geometry.positions == "absolute":
            assert self.position is not None
            hidden = hidden + self.position[:length]
        elif geometry.positions == "offset":
            assert self.position is not None
            real = (ids != geometry.pad_token_id) & mask
            positions = torch.cumsum(real, dim=1) * real + geometry.pad_token_id
            hidden = hidden + self.position[positions]
        else:
            angles = torch.outer(
                torch.arange(length, dtype=torch.float32), self.inverse_frequencies
            )
            angles = torch.cat([angles, angles], dim=-1)  # [S, head_dim]
            rotation = (angles.cos(), angles.sin())
        hidden = _layer_norm(hidden, self.embedding_norm, geometry.layer_norm_eps)
        keys_seen = mask[:, None, None, :]  # [B, 1, 1, S]: every query sees every real key
        heads = geometry.heads
        head_dim = geometry.hidden_size // heads
        activation = _ACTIVATIONS[geometry.activation]
        for layer in self.layers:
            qkv = F.linear(hidden, layer.qkv, layer.qkv_bias)
            qkv = qkv.view(batch, length, 3, heads, head_dim).permute(2, 0, 3, 1, 4)
            query, key, value = qkv[0], qkv[1], qkv[2]  # [B, heads, S, head_dim]
            if rotation is not None:
                query, key = _rotate(query, *rotation), _rotate(key, *rotation)
            attended = F.scaled_dot_product_attention(
                query, key, value, attn_mask=keys_seen, scale=1.0 / math.sqrt(head_dim)
            )
            attended = attended.transpose(1, 2).reshape(batch, length, geometry.hidden_size)
            hidden = _layer_norm(
                hidden + F.linear(attended, layer.out, layer.out_bias),
                layer.attention_norm,
                geometry.layer_norm_eps,
            )
            inner = F.linear(hidden, layer.up, layer.up_bias)
            if geometry.gated:
                gate, up = inner.chunk(2, dim=-1)
                inner = activation(gate) * up
            else:
                inner = activation(inner)
            hidden = _layer_norm(
                hidden + F.linear(inner, layer.down, layer.down_bias),
                layer.mlp_norm,
                geometry.layer_norm_eps,
            )
        return hidden


def _layer_norm(
    hidden: torch.Tensor, norm: tuple[torch.Tensor, torch.Tensor], eps: float
) -> torch.Tensor:
    return F.layer_norm(hidden, norm[0].shape, norm[0], norm[1], eps)


def _rotate(states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE in the half-split layout: `x * cos + rotate_half(x) * sin` over `[..., S, d]`."""
    half = states.shape[-1] // 2
    rotated = torch.cat([-states[..., half:], states[..., :half]], dim=-1)
    return states * cos + rotated * sin


@dataclass(slots=True)
class ClassificationHead:
    """A sequence-classification head on the first token (`<s>` / `[CLS]`): RoBERTa's
    `out_proj(tanh(dense(h0)))` (`classifier.dense`, `classifier.out_proj`), or BERT's
    `classifier(tanh(pooler.dense(h0)))`. A reranker's score is its single logit."""

    dense: torch.Tensor
    dense_bias: torch.Tensor
    out: torch.Tensor
    out_bias: torch.Tensor

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor]) -> ClassificationHead:
        """The head in `tensors`.

        Raises:
            EmbeddingModelError: neither layout is there, or the head has more than one label.
        """
        if "classifier.out_proj.weight" in tensors:
            head = cls(
                take(tensors, "classifier.dense.weight"), take(tensors, "classifier.dense.bias"),
                take(tensors, "classifier.out_proj.weight"),
                take(tensors, "classifier.out_proj.bias"),
            )  # fmt: skip
        elif "classifier.weight" in tensors:
            prefix = weight_prefix(tensors, "pooler.dense.weight")
            head = cls(
                take(tensors, prefix + "pooler.dense.weight"),
                take(tensors, prefix + "pooler.dense.bias"),
                take(tensors, "classifier.weight"), take(tensors, "classifier.bias"),
            )  # fmt: skip
        else:
            raise EmbeddingModelError("the checkpoint has no sequence-classification head")
        if head.out.shape[0] != 1:
            raise EmbeddingModelError(
                f"the classification head has {head.out.shape[0]} labels; a reranker has 1"
            )
        return head

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[B]` logits from `[B, S, hidden]` states (read at position 0)."""
        first = torch.tanh(F.linear(hidden[:, 0], self.dense, self.dense_bias))
        return F.linear(first, self.out, self.out_bias)[:, 0]
