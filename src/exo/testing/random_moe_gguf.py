"""Random-weight Qwen3-MoE GGUF files (GGUF architecture `qwen3moe`), written as llama.cpp's
converter lays them out, for tests and benchmarks.

The tensors are llama.cpp's (`llm_build_qwen3moe`): per layer the attention (`attn_q`,
`attn_k`, `attn_v`, `attn_output`, the per-head `attn_q_norm` / `attn_k_norm`), the norms,
the router `ffn_gate_inp` (F32, as llama.cpp's quantizations keep it) and the experts
stacked in `ffn_gate_exps` / `ffn_up_exps` (GGUF shape `[hidden, expert width, experts]`)
and `ffn_down_exps` (`[expert width, hidden, experts]`); metadata `qwen3moe.expert_count`,
`expert_used_count`, `expert_feed_forward_length` beside the dense keys. The linears are
Q4_K blocks of random bytes (gguf-py cannot quantize to Q4_K) with their fp16 `d` and `dmin`
set so the values centre on zero, or Q8_0 / F32 from Gaussian weights (`gguf.quants`); the
LM head Q6_K as llama.cpp's Q4_K_M keeps it. Tensors are written one at a time (no whole
model in memory: a Qwen3-30B-A3B layer's experts are 113 MB of Q4_K), optionally split
into several files (`-0000i-of-0000N.gguf`). The vocabulary is `random_gguf`'s byte-level one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from exo.testing.random_gguf import (
    Planned,
    add_byte_vocabulary,
    random_q4_k,
    random_q6_k,
    write_planned_tensors,
)


@dataclass(frozen=True, slots=True)
class MoeGgufShape:
    """A Qwen3-MoE model's shape (its config.json's fields)."""

    hidden_size: int = 256
    n_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    experts: int = 4
    experts_per_token: int = 2
    expert_intermediate_size: int = 256
    intermediate_size: int = 512  # the dense MLP width the metadata states (no layer uses it)
    vocab_size: int = 320
    context_length: int = 4096
    rope_theta: float = 1_000_000.0


# Qwen3-30B-A3B's config.json (Qwen/Qwen3-30B-A3B on the Hub): 48 layers; a bench writes
# fewer (`dataclasses.replace(QWEN3_30B_A3B, n_layers=...)`).
QWEN3_30B_A3B = MoeGgufShape(
    hidden_size=2048,
    n_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    experts=128,
    experts_per_token=8,
    expert_intermediate_size=768,
    intermediate_size=6144,
    vocab_size=151936,
    context_length=40960,
)


def _plan(shape: MoeGgufShape, tensor_type: str) -> list[Planned]:
    hidden, width = shape.hidden_size, shape.expert_intermediate_size
    query, key_value = shape.num_attention_heads, shape.num_key_value_heads
    planned: list[Planned] = [
        ("token_embd.weight", tensor_type, (shape.vocab_size, hidden)),
        ("output_norm.weight", "F32", (hidden,)),
        ("output.weight", "Q6_K" if tensor_type == "Q4_K" else tensor_type,
         (shape.vocab_size, hidden)),
    ]  # fmt: skip
    for layer in range(shape.n_layers):
        block = f"blk.{layer}."
        planned += [
            (block + "attn_norm.weight", "F32", (hidden,)),
            (block + "attn_q.weight", tensor_type, (query * shape.head_dim, hidden)),
            (block + "attn_k.weight", tensor_type, (key_value * shape.head_dim, hidden)),
            (block + "attn_v.weight", tensor_type, (key_value * shape.head_dim, hidden)),
            (block + "attn_output.weight", tensor_type, (hidden, query * shape.head_dim)),
            (block + "attn_q_norm.weight", "F32", (shape.head_dim,)),
            (block + "attn_k_norm.weight", "F32", (shape.head_dim,)),
            (block + "ffn_norm.weight", "F32", (hidden,)),
            (block + "ffn_gate_inp.weight", "F32", (shape.experts, hidden)),
            (block + "ffn_gate_exps.weight", tensor_type, (shape.experts, width, hidden)),
            (block + "ffn_up_exps.weight", tensor_type, (shape.experts, width, hidden)),
            (block + "ffn_down_exps.weight", tensor_type, (shape.experts, hidden, width)),
        ]
    return planned


def random_values(
    name: str, type_name: str, weights_shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """The stored array of one tensor: F32 values (norms around 1, a wide router, other
    weights Gaussian), or the blocks' bytes (uint8: Q4_K / Q6_K random blocks, other types
    quantized by `gguf.quants`)."""
    import gguf
    from gguf.quants import quantize

    if len(weights_shape) == 1:  # a norm: around 1
        return (1.0 + 0.1 * rng.standard_normal(weights_shape)).astype(np.float32)
    if name.endswith("ffn_gate_inp.weight"):  # the router: wide, so choices have margins
        return (rng.standard_normal(weights_shape) * 0.5).astype(np.float32)
    if type_name == "Q4_K":
        return random_q4_k(weights_shape, rng, 2e-4)
    if type_name == "Q6_K":
        return random_q6_k(weights_shape, rng, 1.5e-5)
    weights = (rng.standard_normal(weights_shape) * 0.05).astype(np.float32)
    if type_name == "F32":
        return weights
    return quantize(weights, gguf.GGMLQuantizationType[type_name])


def write_random_moe_gguf(
    path: Path,
    shape: MoeGgufShape = MoeGgufShape(),
    tensor_type: str = "Q4_K",
    seed: int = 0,
    split_max_tensors: int = 0,
    on_tensor: Callable[[int, int], None] | None = None,
) -> list[Path]:
    """Write a random-weight Qwen3-MoE GGUF of `shape` at `path`.

    Args:
        tensor_type: GGML type of the linears and the embedding: "Q4_K" (random blocks; the
            LM head Q6_K), "Q8_0" or "F32" (from Gaussian weights; the head the same).
        seed: the weights' random seed.
        split_max_tensors: at most this many tensors per file (0: one file); split files
            are named `<stem>-0000i-of-0000N.gguf` beside `path`.
        on_tensor: called as (tensors written, tensors) after each tensor.

    Returns:
        The files written, first part first.
    """
    import gguf

    writer = gguf.GGUFWriter(path, "qwen3moe", split_max_tensors=split_max_tensors)
    writer.add_name("random qwen3moe")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_per_token)
    writer.add_expert_feed_forward_length(shape.expert_intermediate_size)
    add_byte_vocabulary(writer, shape.vocab_size)
    files = write_planned_tensors(
        writer,
        path,
        _plan(shape, tensor_type),
        np.random.default_rng(seed),
        on_tensor,
        random_values,
    )
    return files
