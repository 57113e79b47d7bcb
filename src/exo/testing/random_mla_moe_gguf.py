"""Random-weight DeepSeek-V3-style GGUF files, laid out as llama.cpp's converter writes them
(`convert_hf_to_gguf.py`: `DeepseekV2Model` → arch `deepseek2`, `Glm4MoeModel` → arch
`glm4moe`), for tests.

Both: the first `dense_layers` layers with a dense gated MLP (`ffn_gate` / `ffn_up` /
`ffn_down`), every later one the router `ffn_gate_inp` (F32), the correction bias
`exp_probs_b.bias` (F32), the experts stacked in `ffn_{gate,up,down}_exps` and one shared
expert (`ffn_*_shexp`); metadata `expert_count`, `expert_used_count`,
`expert_shared_count`, `expert_feed_forward_length`, `leading_dense_block_count`,
`expert_gating_func` (sigmoid), `expert_weights_scale`, `expert_weights_norm`,
`expert_group_count` / `expert_group_used_count`.

deepseek2: multi-head latent attention as the converter stores it since it split
`kv_b_proj` (`attn_q_a` / `attn_q_a_norm` / `attn_q_b`, or `attn_q` without a q rank;
`attn_kv_a_mqa`, `attn_kv_a_norm`; `attn_k_b` row-major `[heads, kv_lora_rank, nope]` and
`attn_v_b` `[heads, v, kv_lora_rank]`; head_count_kv 1, key_length = kv_lora_rank + rope,
value_length = kv_lora_rank, key_length_mla / value_length_mla the real head widths), or as
before the split (`kv_b_layout="joint"`: one `attn_kv_b` `[heads * (nope + v),
kv_lora_rank]`, key_length / value_length the head widths, head_count_kv = heads); YaRN
(`rope.scaling.*`, `yarn_log_multiplier` 0.1 × mscale_all_dim).

glm4moe: grouped-query attention with biases and per-head q/k norms, partial rotary
(`rope.dimension_count` < key_length), `post_attention_norm`, and one MTP layer after the
decoder layers (`nextn_predict_layers` 1, counted in `block_count`: a whole layer plus
`nextn.eh_proj` / `enorm` / `hnorm` / `shared_head_norm`).

Linears are `tensor_type` ("Q4_K": random blocks where a row is whole 256-value
super-blocks, Q8_0 elsewhere, the LM head Q6_K; "Q8_0" / "F32" from Gaussian weights);
the vocabulary is `random_gguf`'s byte-level one.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from exo.testing.random_gguf import add_byte_vocabulary, write_planned_tensors
from exo.testing.random_moe_gguf import random_values

_Planned = tuple[str, str, tuple[int, ...]]


@dataclass(frozen=True, slots=True)
class MlaMoeGgufShape:
    """A DeepSeek-V3 (`deepseek2`) or GLM-4.5 (`glm4moe`) model's shape; widths multiples
    of 32. `q_lora_rank` 0: one `attn_q`; the MLA fields are unused for glm4moe, whose head
    width is `head_dim` and rotary width `rope_dim`."""

    architecture: Literal["deepseek2", "glm4moe"] = "deepseek2"
    hidden_size: int = 256
    n_layers: int = 2
    dense_layers: int = 1
    num_attention_heads: int = 4
    num_key_value_heads: int = 2  # glm4moe
    head_dim: int = 64  # glm4moe
    rope_dim: int = 32  # glm4moe: its partial rotary width
    q_lora_rank: int = 64
    kv_lora_rank: int = 64
    qk_rope_head_dim: int = 16
    qk_nope_head_dim: int = 32
    v_head_dim: int = 32
    experts: int = 8
    experts_per_token: int = 2
    expert_groups: int = 2
    expert_groups_per_token: int = 1
    shared_experts: int = 1
    expert_intermediate_size: int = 256
    intermediate_size: int = 512
    routed_scaling_factor: float = 2.5
    vocab_size: int = 320
    context_length: int = 4096
    rope_theta: float = 10000.0
    yarn_factor: float = 4.0  # deepseek2; 0: no YaRN
    yarn_original_context: int = 1024
    mscale_all_dim: float = 1.0
    mtp_layers: int = 1  # glm4moe


GLM4MOE_SHAPE = MlaMoeGgufShape(
    architecture="glm4moe", experts=4, expert_groups=1, expert_groups_per_token=1
)


def _linear_type(tensor_type: str, columns: int) -> str:
    """`tensor_type`, or Q8_0 where a row is no whole Q4_K super-block (as llama.cpp's
    quantizer falls back)."""
    return tensor_type if tensor_type != "Q4_K" or columns % 256 == 0 else "Q8_0"


def _sparse_mlp(shape: MlaMoeGgufShape, block: str, tensor_type: str) -> list[_Planned]:
    hidden, width, experts = shape.hidden_size, shape.expert_intermediate_size, shape.experts
    shared = width * shape.shared_experts
    linear = _linear_type(tensor_type, hidden)
    return [
        (block + "ffn_gate_inp.weight", "F32", (experts, hidden)),
        (block + "exp_probs_b.bias", "F32", (experts,)),
        (block + "ffn_gate_exps.weight", linear, (experts, width, hidden)),
        (block + "ffn_up_exps.weight", linear, (experts, width, hidden)),
        (
            block + "ffn_down_exps.weight",
            _linear_type(tensor_type, width),
            (experts, hidden, width),
        ),
        (block + "ffn_gate_shexp.weight", linear, (shared, hidden)),
        (block + "ffn_up_shexp.weight", linear, (shared, hidden)),
        (block + "ffn_down_shexp.weight", _linear_type(tensor_type, shared), (hidden, shared)),
    ]


def _dense_mlp(shape: MlaMoeGgufShape, block: str, tensor_type: str) -> list[_Planned]:
    hidden, width = shape.hidden_size, shape.intermediate_size
    linear = _linear_type(tensor_type, hidden)
    return [
        (block + "ffn_gate.weight", linear, (width, hidden)),
        (block + "ffn_up.weight", linear, (width, hidden)),
        (block + "ffn_down.weight", _linear_type(tensor_type, width), (hidden, width)),
    ]


def _mla_attention(
    shape: MlaMoeGgufShape, block: str, tensor_type: str, kv_b_layout: str
) -> list[_Planned]:
    hidden, heads = shape.hidden_size, shape.num_attention_heads
    latent, rope = shape.kv_lora_rank, shape.qk_rope_head_dim
    nope, value = shape.qk_nope_head_dim, shape.v_head_dim
    query = heads * (nope + rope)
    planned: list[_Planned] = [(block + "attn_norm.weight", "F32", (hidden,))]
    if shape.q_lora_rank:
        planned += [
            (block + "attn_q_a.weight", _linear_type(tensor_type, hidden),
             (shape.q_lora_rank, hidden)),
            (block + "attn_q_a_norm.weight", "F32", (shape.q_lora_rank,)),
            (block + "attn_q_b.weight", _linear_type(tensor_type, shape.q_lora_rank),
             (query, shape.q_lora_rank)),
        ]  # fmt: skip
    else:
        planned.append(
            (block + "attn_q.weight", _linear_type(tensor_type, hidden), (query, hidden))
        )
    planned += [
        (
            block + "attn_kv_a_mqa.weight",
            _linear_type(tensor_type, hidden),
            (latent + rope, hidden),
        ),
        (block + "attn_kv_a_norm.weight", "F32", (latent,)),
    ]
    if kv_b_layout == "split":
        planned += [
            (block + "attn_k_b.weight", _linear_type(tensor_type, nope), (heads, latent, nope)),
            (block + "attn_v_b.weight", _linear_type(tensor_type, latent), (heads, value, latent)),
        ]
    else:
        planned.append(
            (block + "attn_kv_b.weight", _linear_type(tensor_type, latent),
             (heads * (nope + value), latent))
        )  # fmt: skip
    planned.append(
        (block + "attn_output.weight", _linear_type(tensor_type, heads * value),
         (hidden, heads * value))
    )  # fmt: skip
    return planned


def _gqa_attention(shape: MlaMoeGgufShape, block: str, tensor_type: str) -> list[_Planned]:
    hidden, head_dim = shape.hidden_size, shape.head_dim
    query, key_value = shape.num_attention_heads * head_dim, shape.num_key_value_heads * head_dim
    linear = _linear_type(tensor_type, hidden)
    return [
        (block + "attn_norm.weight", "F32", (hidden,)),
        (block + "attn_q.weight", linear, (query, hidden)),
        (block + "attn_q.bias", "F32", (query,)),
        (block + "attn_k.weight", linear, (key_value, hidden)),
        (block + "attn_k.bias", "F32", (key_value,)),
        (block + "attn_v.weight", linear, (key_value, hidden)),
        (block + "attn_v.bias", "F32", (key_value,)),
        (block + "attn_q_norm.weight", "F32", (head_dim,)),
        (block + "attn_k_norm.weight", "F32", (head_dim,)),
        (block + "attn_output.weight", _linear_type(tensor_type, query), (hidden, query)),
    ]


def _plan(shape: MlaMoeGgufShape, tensor_type: str, kv_b_layout: str) -> list[_Planned]:
    hidden = shape.hidden_size
    head_type = "Q6_K" if tensor_type == "Q4_K" else tensor_type
    planned: list[_Planned] = [
        ("token_embd.weight", _linear_type(tensor_type, hidden), (shape.vocab_size, hidden)),
        ("output_norm.weight", "F32", (hidden,)),
        ("output.weight", head_type, (shape.vocab_size, hidden)),
    ]
    glm = shape.architecture == "glm4moe"
    blocks = shape.n_layers + (shape.mtp_layers if glm else 0)
    for layer in range(blocks):
        block = f"blk.{layer}."
        if glm:
            planned += _gqa_attention(shape, block, tensor_type)
            planned.append((block + "post_attention_norm.weight", "F32", (hidden,)))
        else:
            planned += _mla_attention(shape, block, tensor_type, kv_b_layout)
            planned.append((block + "ffn_norm.weight", "F32", (hidden,)))
        if layer < shape.dense_layers:
            planned += _dense_mlp(shape, block, tensor_type)
        else:
            planned += _sparse_mlp(shape, block, tensor_type)
        if layer >= shape.n_layers:  # GLM's MTP layer
            planned += [
                (block + "nextn.eh_proj.weight", "F32", (hidden, 2 * hidden)),
                (block + "nextn.enorm.weight", "F32", (hidden,)),
                (block + "nextn.hnorm.weight", "F32", (hidden,)),
                (block + "nextn.shared_head_norm.weight", "F32", (hidden,)),
            ]
    return planned


def _values(
    name: str, type_name: str, weights_shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """`random_values`, but routers narrow enough that sigmoid scores do not saturate into
    ties, correction and attention biases small, and a few-unit-wide LM head."""
    if name.endswith("ffn_gate_inp.weight"):
        return (rng.standard_normal(weights_shape) * 0.05).astype(np.float32)
    if name.endswith("exp_probs_b.bias"):
        return (rng.standard_normal(weights_shape) * 0.1).astype(np.float32)
    if name.endswith(".bias"):
        return (rng.standard_normal(weights_shape) * 0.02).astype(np.float32)
    return random_values(name, type_name, weights_shape, rng)


def write_random_mla_moe_gguf(
    path: Path,
    shape: MlaMoeGgufShape = MlaMoeGgufShape(),
    tensor_type: str = "Q8_0",
    seed: int = 0,
    split_max_tensors: int = 0,
    kv_b_layout: Literal["split", "joint"] = "split",
) -> list[Path]:
    """Write a random-weight `shape.architecture` GGUF at `path` (module docstring).

    Args:
        tensor_type: GGML type of the linears: "Q4_K", "Q8_0" or "F32".
        seed: the weights' random seed.
        split_max_tensors: at most this many tensors per file (0: one file).
        kv_b_layout: deepseek2's MLA up-projection as `attn_k_b` / `attn_v_b` ("split",
            llama.cpp's converter today) or one `attn_kv_b` ("joint", before the split).

    Returns:
        The files written, first part first.
    """
    import gguf

    architecture = shape.architecture
    writer = gguf.GGUFWriter(path, architecture, split_max_tensors=split_max_tensors)
    writer.add_name(f"random {architecture}")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    glm = architecture == "glm4moe"
    writer.add_block_count(shape.n_layers + (shape.mtp_layers if glm else 0))
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.rope_theta)
    if glm:
        writer.add_head_count_kv(shape.num_key_value_heads)
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
        writer.add_rope_dimension_count(shape.rope_dim)
        writer.add_nextn_predict_layers(shape.mtp_layers)
    else:
        _add_mla_metadata(writer, shape, kv_b_layout)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_per_token)
    writer.add_expert_shared_count(shape.shared_experts)
    writer.add_expert_feed_forward_length(shape.expert_intermediate_size)
    writer.add_leading_dense_block_count(shape.dense_layers)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(shape.routed_scaling_factor)
    writer.add_expert_weights_norm(True)
    writer.add_expert_group_count(shape.expert_groups)
    writer.add_expert_group_used_count(shape.expert_groups_per_token)
    add_byte_vocabulary(writer, shape.vocab_size)
    planned = _plan(shape, tensor_type, kv_b_layout)
    return write_planned_tensors(writer, path, planned, np.random.default_rng(seed), None, _values)


def _add_mla_metadata(gguf_writer: Any, shape: MlaMoeGgufShape, kv_b_layout: str) -> None:
    """deepseek2's MLA and YaRN keys, as the converter writes them for `kv_b_layout`."""

    latent, rope = shape.kv_lora_rank, shape.qk_rope_head_dim
    if shape.q_lora_rank:
        gguf_writer.add_q_lora_rank(shape.q_lora_rank)
    gguf_writer.add_kv_lora_rank(latent)
    gguf_writer.add_rope_dimension_count(rope)
    if kv_b_layout == "split":  # MQA over the latent
        gguf_writer.add_head_count_kv(1)
        gguf_writer.add_key_length(latent + rope)
        gguf_writer.add_value_length(latent)
        gguf_writer.add_key_length_mla(shape.qk_nope_head_dim + rope)
        gguf_writer.add_value_length_mla(shape.v_head_dim)
    else:
        gguf_writer.add_head_count_kv(shape.num_attention_heads)
        gguf_writer.add_key_length(shape.qk_nope_head_dim + rope)
        gguf_writer.add_value_length(shape.v_head_dim)
    if shape.yarn_factor:
        import gguf

        gguf_writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        gguf_writer.add_rope_scaling_factor(shape.yarn_factor)
        gguf_writer.add_rope_scaling_orig_ctx_len(shape.yarn_original_context)
        gguf_writer.add_rope_scaling_yarn_log_mul(0.1 * shape.mscale_all_dim)
