"""Random-weight gpt-oss GGUF files (GGUF architecture `gpt-oss`), laid out as llama.cpp's
converter (`convert_hf_to_gguf.py`, `GptOssModel`) and ggml-org's gpt-oss GGUFs store them,
for tests.

Per layer: `attn_norm`, `attn_q` / `attn_k` / `attn_v` / `attn_output` with their biases,
`attn_sinks.weight` (one logit per head), `post_attention_norm`, the router `ffn_gate_inp`
with its bias, and the experts stacked in `ffn_gate_exps` / `ffn_up_exps` (GGUF shape
`[hidden, expert width, experts]`, the checkpoint's interleaved gate / up split apart) and
`ffn_down_exps` (`[expert width, hidden, experts]`) in GGML type MXFP4 (quantized by
`gguf.quants`: blocks of 32 inputs, one e8m0 byte then 16 bytes of E2M1 nibbles, inputs 0-15
in the low nibbles and 16-31 in the high ones), each with an F32 `.bias` `[out, experts]`.
Metadata: the dense keys, `expert_count`, `expert_used_count`, `expert_feed_forward_length`,
`attention.sliding_window` and the YaRN keys (`rope.scaling.type` "yarn", `.factor`,
`.original_context_length`). Linears and the embedding are Q8_0 (or F32), norms and biases
F32. The vocabulary is `random_gguf`'s byte-level one.

`write_random_block_gptoss_gguf` writes the same layout at a real model's size
(`GPT_OSS_20B`) for benchmarks: every block of random bytes (MXFP4 with a fixed e8m0 scale,
Q8_0 with a fixed fp16 `d`) instead of quantized Gaussian weights, one tensor at a time, so
no whole model (nor a float32 copy of one tensor: gpt-oss-20b's embedding is 2.3 GB in
float32) is ever in memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exo.testing.random_gguf import Planned, add_byte_vocabulary, write_planned_tensors


@dataclass(frozen=True, slots=True)
class GptOssGgufShape:
    """A gpt-oss model's shape (its config.json's fields); widths multiples of 32."""

    hidden_size: int = 64
    n_layers: int = 2  # sliding, full
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    experts: int = 4
    experts_per_token: int = 2
    intermediate_size: int = 64  # an expert's width
    vocab_size: int = 320
    context_length: int = 512
    sliding_window: int = 16
    rope_theta: float = 150000.0
    rope_factor: float = 32.0
    original_context_length: int = 16


# gpt-oss-20b's config.json (openai/gpt-oss-20b on the Hub; the copy named in
# `exo/resources/model_cards/gpt-oss-20b.toml`): 24 layers, even ones sliding (window 128),
# odd ones full; YaRN factor 32 over 4,096 positions. A bench writes fewer layers
# (`dataclasses.replace(GPT_OSS_20B, n_layers=...)`).
GPT_OSS_20B = GptOssGgufShape(
    hidden_size=2880,
    n_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    experts=32,
    experts_per_token=4,
    intermediate_size=2880,
    vocab_size=201088,
    context_length=131072,
    sliding_window=128,
    rope_theta=150000.0,
    rope_factor=32.0,
    original_context_length=4096,
)


def _plan(shape: GptOssGgufShape, tensor_type: str) -> list[Planned]:
    hidden, width, experts = shape.hidden_size, shape.intermediate_size, shape.experts
    query = shape.num_attention_heads * shape.head_dim
    key_value = shape.num_key_value_heads * shape.head_dim
    planned: list[Planned] = [
        ("token_embd.weight", tensor_type, (shape.vocab_size, hidden)),
        ("output_norm.weight", "F32", (hidden,)),
        ("output.weight", tensor_type, (shape.vocab_size, hidden)),
    ]
    for layer in range(shape.n_layers):
        block = f"blk.{layer}."
        planned += [
            (block + "attn_norm.weight", "F32", (hidden,)),
            (block + "attn_q.weight", tensor_type, (query, hidden)),
            (block + "attn_q.bias", "F32", (query,)),
            (block + "attn_k.weight", tensor_type, (key_value, hidden)),
            (block + "attn_k.bias", "F32", (key_value,)),
            (block + "attn_v.weight", tensor_type, (key_value, hidden)),
            (block + "attn_v.bias", "F32", (key_value,)),
            (block + "attn_output.weight", tensor_type, (hidden, query)),
            (block + "attn_output.bias", "F32", (hidden,)),
            (block + "attn_sinks.weight", "F32", (shape.num_attention_heads,)),
            (block + "post_attention_norm.weight", "F32", (hidden,)),
            (block + "ffn_gate_inp.weight", "F32", (experts, hidden)),
            (block + "ffn_gate_inp.bias", "F32", (experts,)),
            (block + "ffn_gate_exps.weight", "MXFP4", (experts, width, hidden)),
            (block + "ffn_gate_exps.bias", "F32", (experts, width)),
            (block + "ffn_up_exps.weight", "MXFP4", (experts, width, hidden)),
            (block + "ffn_up_exps.bias", "F32", (experts, width)),
            (block + "ffn_down_exps.weight", "MXFP4", (experts, hidden, width)),
            (block + "ffn_down_exps.bias", "F32", (experts, hidden)),
        ]
    return planned


def _values(
    name: str, type_name: str, weights_shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """One tensor's stored array: F32 values, or its blocks' bytes (uint8)."""
    import gguf
    from gguf.quants import quantize

    if name.endswith("norm.weight"):  # around 1
        return (1.0 + 0.1 * rng.standard_normal(weights_shape)).astype(np.float32)
    if name.endswith("attn_sinks.weight"):  # a visible share of each softmax
        return rng.standard_normal(weights_shape).astype(np.float32)
    if name.endswith("ffn_gate_inp.weight"):  # the router: wide, so choices have margins
        return (rng.standard_normal(weights_shape) * 0.5).astype(np.float32)
    if name.endswith(".bias"):
        return (rng.standard_normal(weights_shape) * 0.02).astype(np.float32)
    scale = 0.3 if name == "output.weight" else 0.05  # logits not nearly flat
    weights = (rng.standard_normal(weights_shape) * scale).astype(np.float32)
    if type_name == "F32":
        return weights
    return quantize(weights, gguf.GGMLQuantizationType[type_name])


def _tensors(
    shape: GptOssGgufShape, tensor_type: str, seed: int
) -> dict[str, tuple[str, np.ndarray]]:
    """Every tensor of the llama.cpp layout, in order: name → (GGML type name, stored
    array)."""
    rng = np.random.default_rng(seed)
    return {
        name: (type_name, _values(name, type_name, weights_shape, rng))
        for name, type_name, weights_shape in _plan(shape, tensor_type)
    }


def _add_metadata(writer: Any, shape: GptOssGgufShape, ollama_first: bool) -> None:
    """The keys llama.cpp's converter writes; for Ollama's first blobs (`ollama_first`) the
    ones its converter wrote at fa7776f (no `rope.scaling.type`, no
    `expert_feed_forward_length`, no `tokenizer.ggml.pre`)."""
    import gguf

    writer.add_name("random gpt-oss")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    if not ollama_first:
        writer.add_expert_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(shape.rope_theta)
    if not ollama_first:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(shape.rope_factor)
    writer.add_rope_scaling_orig_ctx_len(shape.original_context_length)
    writer.add_sliding_window(shape.sliding_window)
    writer.add_expert_count(shape.experts)
    writer.add_expert_used_count(shape.experts_per_token)
    # Harmony's shape, shortened (the real template also renders tools and reasoning).
    add_byte_vocabulary(
        writer,
        shape.vocab_size,
        pre=None if ollama_first else "gpt-4o",
        chat_template=(
            "{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}"
            "<|channel|>final{% endif %}<|message|>{{ m.content }}<|end|>{% endfor %}"
            "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
        ),
    )


# Random blocks' scales: MXFP4's e8m0 byte 120 (values 2^-7 x E2M1 codes, RMS ~0.023) and
# Q8_0's fp16 `d` (RMS ~0.02): about 1/sqrt(in) at gpt-oss-20b's widths, so activations
# neither vanish nor blow up over a few layers.
RANDOM_MXFP4_SCALE_BYTE = 120
RANDOM_Q8_0_D = 2.7e-4
_Q8_0_BLOCK_BYTES = 34  # fp16 d, 32 int8 values


def random_mxfp4(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """MXFP4 blocks (GGML type 39) of random E2M1 codes with the e8m0 scale byte
    `RANDOM_MXFP4_SCALE_BYTE`, for weights of `shape` (`[..., rows, in]`, `in` a multiple of
    32): uint8 `[..., rows, in / 32 * 17]`."""
    *leading, columns = shape
    blocks = rng.integers(0, 256, (*leading, columns // 32, 17), np.uint8)
    blocks[..., 0] = RANDOM_MXFP4_SCALE_BYTE
    return blocks.reshape(*leading, -1)


def random_q8_0(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Q8_0 blocks of random int8 values with fp16 `d` = `RANDOM_Q8_0_D`, for weights of
    `shape` (`[..., rows, in]`, `in` a multiple of 32): uint8 `[..., rows, in / 32 * 34]`."""
    *leading, columns = shape
    blocks = rng.integers(0, 256, (*leading, columns // 32, _Q8_0_BLOCK_BYTES), np.uint8)
    d = np.full(blocks.shape[:-1], RANDOM_Q8_0_D, np.float16)
    blocks[..., 0:2] = d[..., None].view(np.uint8)
    return blocks.reshape(*leading, -1)


def _random_block_values(
    name: str, type_name: str, weights_shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """One tensor's stored array for `write_random_block_gptoss_gguf`: random MXFP4 or
    Q8_0 blocks, F32 as `_values` makes them."""
    if type_name == "MXFP4":
        return random_mxfp4(weights_shape, rng)
    if type_name == "Q8_0":
        return random_q8_0(weights_shape, rng)
    return _values(name, type_name, weights_shape, rng)


def write_random_block_gptoss_gguf(
    path: Path,
    shape: GptOssGgufShape = GPT_OSS_20B,
    seed: int = 0,
    on_tensor: Callable[[int, int], None] | None = None,
) -> Path:
    """Write a random-block gpt-oss GGUF of `shape` at `path` (one file; the module
    docstring): `write_random_gptoss_gguf`'s tensors and metadata with Q8_0 linears,
    embedding and LM head and MXFP4 experts of random block bytes, written one tensor at a
    time.

    Args:
        seed: the blocks' random seed.
        on_tensor: called as (tensors written, tensors) after each tensor.

    Returns:
        `path`.
    """
    import gguf

    writer = gguf.GGUFWriter(path, "gpt-oss")
    _add_metadata(writer, shape, ollama_first=False)
    planned = _plan(shape, "Q8_0")
    rng = np.random.default_rng(seed)
    write_planned_tensors(writer, path, planned, rng, on_tensor, values=_random_block_values)
    return path


def _write(path: Path, architecture: str, shape: GptOssGgufShape,
           tensors: dict[str, tuple[str, np.ndarray]]) -> None:  # fmt: skip
    import gguf

    writer = gguf.GGUFWriter(path, architecture)
    _add_metadata(writer, shape, ollama_first=architecture == "gptoss")
    for name, (type_name, values) in tensors.items():
        raw = None if type_name == "F32" else gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, values, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_random_gptoss_gguf(
    path: Path, shape: GptOssGgufShape = GptOssGgufShape(), tensor_type: str = "Q8_0", seed: int = 0
) -> Path:
    """Write a random-weight gpt-oss GGUF of `shape` at `path` (one file), as llama.cpp's
    converter lays it out.

    Args:
        tensor_type: GGML type of the attention linears, the embedding and the LM head
            ("Q8_0" or "F32"); the experts are always MXFP4.
        seed: the weights' random seed.

    Returns:
        `path`.
    """
    _write(path, "gpt-oss", shape, _tensors(shape, tensor_type, seed))
    return path


def write_ollama_first_gptoss_gguf(
    path: Path, shape: GptOssGgufShape = GptOssGgufShape(), tensor_type: str = "Q8_0", seed: int = 0
) -> Path:
    """The same weights as `write_random_gptoss_gguf` with the same arguments, laid out as
    Ollama's first gpt-oss blobs (`exo.download.gguf_gptoss`'s docstring): arch `gptoss`,
    `attn_qkv` (query, key, value rows), `attn_out`, `attn_sinks`, `ffn_norm`,
    `ffn_gate_up_exps` (gate and up rows interleaved, and their biases), MXFP4 under type 4
    in Hugging Face's nibble order (each block the scale byte, then exo's 16 bytes).

    Returns:
        `path`.
    """
    from exo.download.gguf_gptoss import repack_mxfp4

    source = _tensors(shape, tensor_type, seed)

    def hf_blocks(raw: np.ndarray) -> np.ndarray:
        """ggml MXFP4 bytes `[..., rows, row bytes]` → scale byte + exo's nibbles."""
        rows = int(np.prod(raw.shape[:-1]))
        blocks, scales = repack_mxfp4(raw.reshape(rows, -1), rows)
        joined = np.concatenate([scales[..., None], blocks], axis=-1)
        return joined.reshape(raw.shape)

    def interleaved(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """`[experts, rows, ...]` twice → `[experts, 2 rows, ...]`, gate rows even."""
        return np.stack([gate, up], axis=2).reshape(gate.shape[0], -1, *gate.shape[2:])

    renamed = {
        "token_embd.weight": "token_embd.weight", "output_norm.weight": "output_norm.weight",
        "output.weight": "output.weight",
    }  # fmt: skip
    tensors = {new: source[old] for old, new in renamed.items()}
    for layer in range(shape.n_layers):
        block = f"blk.{layer}."

        def of(name: str, block: str = block) -> np.ndarray:
            return source[block + name][1]

        tensors[block + "attn_norm.weight"] = source[block + "attn_norm.weight"]
        for part in ("weight", "bias"):
            qkv = np.concatenate([of(f"attn_{k}.{part}") for k in ("q", "k", "v")], axis=0)
            tensors[f"{block}attn_qkv.{part}"] = (source[f"{block}attn_q.{part}"][0], qkv)
            tensors[f"{block}attn_out.{part}"] = source[f"{block}attn_output.{part}"]
        tensors[block + "attn_sinks"] = source[block + "attn_sinks.weight"]
        tensors[block + "ffn_norm.weight"] = source[block + "post_attention_norm.weight"]
        for part in ("weight", "bias"):
            tensors[f"{block}ffn_gate_inp.{part}"] = source[f"{block}ffn_gate_inp.{part}"]
        gate_up = interleaved(of("ffn_gate_exps.weight"), of("ffn_up_exps.weight"))
        tensors[block + "ffn_gate_up_exps.weight"] = ("MXFP4", hf_blocks(gate_up))
        gate_up_bias = interleaved(of("ffn_gate_exps.bias"), of("ffn_up_exps.bias"))
        tensors[block + "ffn_gate_up_exps.bias"] = ("F32", gate_up_bias)
        tensors[block + "ffn_down_exps.weight"] = ("MXFP4", hf_blocks(of("ffn_down_exps.weight")))
        tensors[block + "ffn_down_exps.bias"] = source[block + "ffn_down_exps.bias"]
    _write(path, "gptoss", shape, tensors)
    # gguf-py writes MXFP4 as type 39; Ollama's first blobs say 4 (same block bytes).
    data = bytearray(path.read_bytes())
    for name, (type_name, values) in tensors.items():
        if type_name == "MXFP4":
            encoded = name.encode()
            at = data.index(len(encoded).to_bytes(8, "little") + encoded) + 8 + len(encoded)
            type_at = at + 4 + 8 * values.ndim  # after u32 dimensions and u64 sizes
            assert int.from_bytes(data[type_at : type_at + 4], "little") == 39
            data[type_at : type_at + 4] = (4).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path
