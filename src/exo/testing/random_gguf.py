"""Random-weight GGUF files of a real model shape, quantized, for tests and benchmarks.

`write_random_gguf` writes what llama.cpp's converter would for a checkpoint of the given
shape: GGUF tensor names (gguf-py's `TensorNameMap`), llama's Q/K rows in llama.cpp's
interleaved rotary order, Gemma norms stored plus one, the decoder-layer linears in a GGML
quantized type (`gguf.quants.quantize`), the embedding in Q8_0 (as llama.cpp's Q4_0 / Q4_1
files keep it), and a byte-level vocabulary (the 256 byte symbols of GPT-2's byte-level BPE,
then filler tokens) so any text tokenizes. Weights are Gaussian with a fixed seed. The same
file loads in llama.cpp and in exo (`exo.download.gguf_models.card_for_gguf` then
`exo.download.pypi_gguf.prepare_model`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from exo.download.gguf_repack import gguf_name_map


@dataclass(frozen=True, slots=True)
class RandomGgufShape:
    """A decoder-only model's shape. `architecture`: GGUF's `general.architecture`
    ("llama" or "gemma3")."""

    architecture: str = "llama"
    hidden_size: int = 128
    n_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    intermediate_size: int = 256
    vocab_size: int = 320
    context_length: int = 2048
    sliding_window: int = 512


# Gemma 3 270M's shape (its config.json on the Hub).
GEMMA3_270M = RandomGgufShape(
    architecture="gemma3",
    hidden_size=640,
    n_layers=18,
    num_attention_heads=4,
    num_key_value_heads=1,
    head_dim=256,
    intermediate_size=2048,
    vocab_size=262144,
    context_length=32768,
    sliding_window=512,
)

_BOS, _EOS = 1, 2
_FIRST_FILLER = 3 + 256  # after the specials and the byte symbols (`_vocabulary`)
PLAIN_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

# A tensor to write: (GGUF name, GGML type name, weights shape `[..., out, in]`).
Planned = tuple[str, str, tuple[int, ...]]


def _byte_symbols() -> list[str]:
    """GPT-2's byte-level BPE alphabet: the printable bytes as themselves, the other bytes
    as the code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: dict[int, str] = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in symbols:
            symbols[byte] = chr(256 + extra)
            extra += 1
    return [symbols[byte] for byte in range(256)]


def _vocabulary(size: int) -> list[str]:
    specials = ["<unk>", "<s>", "</s>"]
    tokens = [*specials, *_byte_symbols()]
    if size < len(tokens):
        raise ValueError(f"vocab_size {size} is below the {len(tokens)} byte-level tokens")
    return tokens + [f"<filler_{index}>" for index in range(size - len(tokens))]


def _hf_config(shape: RandomGgufShape) -> Any:
    from transformers import Gemma3TextConfig, LlamaConfig

    common: dict[str, Any] = {
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": shape.n_layers,
        "num_attention_heads": shape.num_attention_heads,
        "num_key_value_heads": shape.num_key_value_heads,
        "head_dim": shape.head_dim,
        "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size,
        "max_position_embeddings": shape.context_length,
        "tie_word_embeddings": True,
    }
    match shape.architecture:
        case "llama":
            return LlamaConfig(**common)
        case "gemma3":
            return Gemma3TextConfig(**common, sliding_window=shape.sliding_window)
    raise ValueError(f"no random GGUF writer for {shape.architecture!r}")


def _permute_rows(array: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's order of a llama Q/K projection's rows (rotary halves interleaved);
    transformers' `LlamaTensorProcessor` undoes it."""
    rows = array.shape[0]
    permuted: np.ndarray = (
        array.reshape(heads, 2, rows // heads // 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )
    return permuted


_Q4_K_BYTES, _Q6_K_BYTES, _SUPER_BLOCK = 144, 210, 256
# The Q6_K `d` of `write_random_gguf`'s blocks: weights below ~0.06, like its Gaussian ones.
_Q6_K_SCALE = 1.5e-5


def random_q4_k(shape: tuple[int, ...], rng: np.random.Generator, scale: float) -> np.ndarray:
    """Q4_K blocks of random nibbles and 6-bit sub-block scales / mins for weights of
    `shape` (`[..., rows, in]`, `in` a multiple of 256): uint8 `[..., rows, in / 256 * 144]`.
    `d` is `scale` and `dmin` 7.5 `scale` (the mean of `d sc q` is `d` x 31.5 x 7.5, of
    `dmin m` `dmin` x 31.5), so the values centre on zero within ~`scale` x 945."""
    *leading, columns = shape
    blocks = rng.integers(0, 256, (*leading, columns // _SUPER_BLOCK, _Q4_K_BYTES), np.uint8)
    blocks[..., 0:2] = np.full(blocks.shape[:-1], scale, np.float16)[..., None].view(np.uint8)
    dmin = np.full(blocks.shape[:-1], 7.5 * scale, np.float16)
    blocks[..., 2:4] = dmin[..., None].view(np.uint8)
    return blocks.reshape(*leading, -1)


def random_q6_k(shape: tuple[int, ...], rng: np.random.Generator, scale: float) -> np.ndarray:
    """Q6_K blocks (random 6-bit values and int8 sub-block scales, fp16 `d` = `scale`) for
    weights of `shape` (`[rows, in]`, `in` a multiple of 256)."""
    *leading, columns = shape
    blocks = rng.integers(0, 256, (*leading, columns // _SUPER_BLOCK, _Q6_K_BYTES), np.uint8)
    d = np.full(blocks.shape[:-1], scale, np.float16)
    blocks[..., 208:210] = d[..., None].view(np.uint8)
    return blocks.reshape(*leading, -1)


def write_random_gguf(
    path: Path,
    shape: RandomGgufShape = RandomGgufShape(),
    tensor_type: str = "Q4_0",
    embedding_type: str = "Q8_0",
    seed: int = 0,
    types: Mapping[str, str] | None = None,
    one_merge: bool = False,
    file_type: int | None = None,
) -> Path:
    """Write a random-weight GGUF of `shape` at `path`.

    Args:
        tensor_type: GGML type of the decoder-layer linears ("Q4_0", "Q4_1", "Q8_0", "F16",
            "F32": the types `gguf.quants.quantize` writes).
        embedding_type: GGML type of the (tied) token embedding.
        seed: the weights' random seed.
        types: other types for some linears, by their GGUF kind (`{"ffn_down": "Q6_K",
            "attn_v": "Q8_0"}`), as llama.cpp's Q4_K_M files keep some; "Q6_K" (which
            `gguf` cannot quantize to) writes random 6-bit values and sub-block scales
            (inputs a multiple of 256).
        one_merge: give the vocabulary one BPE merge ("a b" into the first filler token,
            as `random_moe_gguf` does): llama.cpp refuses a BPE vocabulary without merges.
        file_type: the `general.file_type` (llama.cpp's `llama_ftype` id, 15 for Q4_K_M) to
            state; None states none (the tensors' types are `tensor_type` and `types`).

    Returns:
        `path`.

    Raises:
        ValueError: an architecture with no writer, or too small a vocabulary.
    """
    import gguf
    from gguf.quants import quantize

    from exo.shared.models.skeleton import empty_model

    config = _hf_config(shape)
    skeleton = empty_model(config)
    shapes = {name: tuple(tensor.shape) for name, tensor in skeleton.state_dict().items()}
    del skeleton
    names = gguf_name_map(shape.architecture, list(shapes), shape.n_layers)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), shape.architecture)
    arch = shape.architecture
    writer.add_name(f"random {arch}")
    if file_type is not None:
        writer.add_file_type(file_type)
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.n_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_attention_heads)
    writer.add_head_count_kv(shape.num_key_value_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    if arch == "gemma3":
        writer.add_sliding_window(shape.sliding_window)
    add_byte_vocabulary(writer, shape.vocab_size, one_merge=one_merge)
    for gguf_name, hf_name in sorted(names.items()):
        if hf_name == "lm_head.weight":
            continue
        tensor_shape = shapes[hf_name]
        if len(tensor_shape) == 1:
            values = (1.0 + 0.1 * rng.standard_normal(tensor_shape)).astype(np.float32)
            writer.add_tensor(gguf_name, values)
            continue
        weights = (rng.standard_normal(tensor_shape) * 0.02).astype(np.float32)
        if arch == "llama" and ".attn_q." in gguf_name:
            weights = _permute_rows(weights, shape.num_attention_heads)
        elif arch == "llama" and ".attn_k." in gguf_name:
            weights = _permute_rows(weights, shape.num_key_value_heads)
        type_name = embedding_type if gguf_name.startswith("token_embd") else tensor_type
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else None
        type_name = (types or {}).get(kind or "", type_name)
        qtype = gguf.GGMLQuantizationType[type_name]
        if qtype == gguf.GGMLQuantizationType.Q6_K:
            blocks = random_q6_k(tensor_shape, rng, _Q6_K_SCALE)
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        elif qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, weights)
        elif qtype == gguf.GGMLQuantizationType.F16:
            writer.add_tensor(gguf_name, weights.astype(np.float16))
        else:
            writer.add_tensor(gguf_name, quantize(weights, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_byte_vocabulary(
    writer: Any,
    vocab_size: int,
    *,
    one_merge: bool = True,
    pre: str | None = "default",
    chat_template: str = PLAIN_CHAT_TEMPLATE,
) -> None:
    """The byte-level vocabulary of `vocab_size` tokens (`_vocabulary`) on a
    `gguf.GGUFWriter`: BOS 1, EOS 2, no BOS added, `chat_template`.

    Args:
        one_merge: give it one BPE merge (two byte symbols into the first filler token):
            llama.cpp and transformers refuse a BPE vocabulary without merges.
        pre: `tokenizer.ggml.pre` (None: the key left out, as Ollama's first gpt-oss
            blobs do).
    """
    writer.add_vocab_size(vocab_size)
    tokens = _vocabulary(vocab_size)
    merges = ["a b"] if one_merge and len(tokens) > _FIRST_FILLER else []
    if merges:
        tokens[_FIRST_FILLER] = "ab"
    writer.add_tokenizer_model("gpt2")
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if index < 3 else 1 for index in range(len(tokens))])
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(_BOS)
    writer.add_eos_token_id(_EOS)
    writer.add_add_bos_token(False)
    writer.add_chat_template(chat_template)


def write_planned_tensors(
    writer: Any,
    path: Path,
    planned: list[Planned],
    rng: np.random.Generator,
    on_tensor: Callable[[int, int], None] | None,
    values: Callable[[str, str, tuple[int, ...], np.random.Generator], np.ndarray],
) -> list[Path]:
    """Write the `planned` tensors and the metadata already added, then close `writer` (a
    `gguf.GGUFWriter` for `path`, maybe split): each tensor's stored array is
    `values(name, type name, weights shape, rng)`, drawn in plan order one tensor at a time
    (no whole model in memory); `on_tensor(written, total)` after each.

    Returns:
        The files written, first part first.
    """
    import gguf

    for name, type_name, weights_shape in planned:
        qtype = gguf.GGMLQuantizationType[type_name]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        *leading, columns = weights_shape
        nbytes = int(np.prod(leading)) * columns // block_size * type_size
        dtype = np.dtype(np.float32) if type_name == "F32" else np.dtype(np.uint8)
        raw = None if type_name == "F32" else qtype
        byte_shape = (*leading, columns // block_size * type_size)
        writer.add_tensor_info(
            name, weights_shape if raw is None else byte_shape, dtype, nbytes, raw
        )
    files: list[Path] = writer.format_shard_names(path)
    writer.write_header_to_file(path)
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (name, type_name, weights_shape) in enumerate(planned):
        writer.write_tensor_data(values(name, type_name, weights_shape, rng))
        if on_tensor is not None:
            on_tensor(index + 1, len(planned))
    writer.close()
    return files
