"""The random-weight embedding models `bench/bench_embeddings.py` times, each written twice
with the same float16-rounded values: as the safetensors folder exo loads and as the GGUF
llama.cpp loads (cached under the bench's `--cache-dir`, `.done` markers).

NomicBERT at nomic-embed-text-v1.5's shape (`NomicShape`, `prepare_nomic`: NomicBERT's own
tensor names in float32; `write_nomic_gguf`, llama.cpp's `nomic-bert` architecture with
tensor names from gguf-py's tensor map and a WordPiece vocabulary of placeholder words) and
Qwen3 at Qwen3-Embedding-0.6B's shape (`QwenShape`, `prepare_qwen`; `write_qwen_gguf`,
llama.cpp's `qwen3` with block types quantized by gguf-py). The token ids both engines are
given (`CLS_ID`, `SEP_ID`, `QWEN_END_ID`, ...) are these vocabularies'. The bench's
docstring gives the shapes' sources and the weights' distributions.

Usage: PYTHONPATH=src python bench/embedding_weights.py [--model nomic|qwen3] [--layers N]
       [--gguf-type f16] [--qwen-gguf-type q4_1] [--cache-dir DIR]
writes one model's folder and GGUF into the cache (as the bench would before timing) and
prints their paths.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_CACHE = Path.home() / ".cache" / "exo-bench-embeddings"
# bert-base-uncased's special token ids, which nomic-embed-text's vocabulary keeps.
PAD_ID, UNKNOWN_ID, CLS_ID, SEP_ID, MASK_ID = 0, 100, 101, 102, 103


@dataclass(frozen=True, slots=True)
class NomicShape:
    """A NomicBERT encoder's shape (defaults: nomic-embed-text-v1.5's config.json)."""

    hidden_size: int = 768
    layers: int = 12
    heads: int = 12
    intermediate_size: int = 3072
    vocab_size: int = 30528
    max_positions: int = 2048
    rope_base: float = 1000.0
    layer_norm_eps: float = 1e-12

    def key(self) -> str:
        return (
            f"nomic-h{self.hidden_size}-l{self.layers}-a{self.heads}-f{self.intermediate_size}"
            f"-v{self.vocab_size}"
        )


def random_nomic_tensors(shape: NomicShape, seed: int = 0) -> dict[str, np.ndarray]:
    """NomicBERT's tensors by their checkpoint names, float16-representable float32 values.

    Returns:
        name -> array; matrices `[out, in]` as torch stores them.
    """
    rng = np.random.default_rng(seed)
    hidden, inner = shape.hidden_size, shape.intermediate_size

    def matrix(rows: int, columns: int, scale: float = 0.02) -> np.ndarray:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * scale
        return values.astype(np.float16).astype(np.float32)

    def norm() -> tuple[np.ndarray, np.ndarray]:
        weight = 1.0 + 0.1 * rng.standard_normal(hidden, dtype=np.float32)
        bias = 0.02 * rng.standard_normal(hidden, dtype=np.float32)
        return weight.astype(np.float32), bias.astype(np.float32)

    tensors: dict[str, np.ndarray] = {
        "embeddings.word_embeddings.weight": matrix(shape.vocab_size, hidden, 0.5),
        "embeddings.token_type_embeddings.weight": matrix(2, hidden, 0.5),
    }
    tensors["emb_ln.weight"], tensors["emb_ln.bias"] = norm()
    for index in range(shape.layers):
        at = f"encoder.layers.{index}."
        tensors[at + "attn.Wqkv.weight"] = matrix(3 * hidden, hidden)
        tensors[at + "attn.out_proj.weight"] = matrix(hidden, hidden)
        tensors[at + "mlp.fc11.weight"] = matrix(inner, hidden)
        tensors[at + "mlp.fc12.weight"] = matrix(inner, hidden)
        tensors[at + "mlp.fc2.weight"] = matrix(hidden, inner)
        tensors[at + "norm1.weight"], tensors[at + "norm1.bias"] = norm()
        tensors[at + "norm2.weight"], tensors[at + "norm2.bias"] = norm()
    return tensors


def _placeholder_vocabulary(size: int) -> list[str]:
    """BERT-style specials at their bert-base ids, then unused words (llama.cpp's WordPiece
    vocabulary marks a word start with U+2581, as its converter writes BERT vocabularies)."""
    tokens = [f"\u2581w{index}" for index in range(size)]
    for index, special in (
        (PAD_ID, "[PAD]"), (UNKNOWN_ID, "[UNK]"), (CLS_ID, "[CLS]"), (SEP_ID, "[SEP]"),
        (MASK_ID, "[MASK]"),
    ):  # fmt: skip
        tokens[index] = special
    return tokens


def write_nomic_gguf(
    path: Path, shape: NomicShape, tensors: dict[str, np.ndarray], tensor_type: str = "f16"
) -> Path:
    """A GGUF of llama.cpp's `nomic-bert` architecture holding `tensors`.

    Tensor names come from gguf-py's `TensorNameMap` for `MODEL_ARCH.NOMIC_BERT`
    (`mlp.fc11` -> `ffn_up`, `mlp.fc12` -> `ffn_gate`, so llama.cpp computes
    `silu(gate) * up` as NomicBERT does); metadata: the shape, `attention.causal` false,
    `pooling_type` mean, `rope.freq_base`, a `bert` tokenizer with two token types.

    Args:
        tensor_type: "f16" or "f32" for the matrices; 1-D tensors are always float32.

    Returns:
        `path`.
    """
    import gguf

    if tensor_type not in ("f16", "f32"):
        raise ValueError(f"tensor_type {tensor_type!r}: f16 or f32")
    architecture = gguf.MODEL_ARCH.NOMIC_BERT
    names = gguf.get_tensor_name_map(architecture, shape.layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[architecture])
    writer.add_name("random nomic-embed-text-v1.5 shape")
    writer.add_context_length(shape.max_positions)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_layer_norm_eps(shape.layer_norm_eps)
    writer.add_causal_attention(False)
    writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_rope_freq_base(shape.rope_base)
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_F16 if tensor_type == "f16" else gguf.LlamaFileType.ALL_F32
    )
    writer.add_tokenizer_model("bert")
    writer.add_token_list(_placeholder_vocabulary(shape.vocab_size))
    token_types = [gguf.TokenType.NORMAL] * shape.vocab_size
    for special in (PAD_ID, UNKNOWN_ID, CLS_ID, SEP_ID, MASK_ID):
        token_types[special] = gguf.TokenType.CONTROL
    writer.add_token_types(token_types)
    writer.add_token_type_count(2)
    # gguf-py keeps BERT's [CLS] as the BOS id and [SEP] as both separator and EOS.
    writer.add_bos_token_id(CLS_ID)
    writer.add_eos_token_id(SEP_ID)
    writer.add_sep_token_id(SEP_ID)
    writer.add_pad_token_id(PAD_ID)
    writer.add_unk_token_id(UNKNOWN_ID)
    writer.add_mask_token_id(MASK_ID)
    for name, values in tensors.items():
        stem, _, suffix = name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        # llama.cpp adds the token-type row to float32 activations: it stays float32, as
        # its converter keeps it.
        matrix = values.ndim == 2 and tensor_type == "f16" and mapped != "token_types"
        writer.add_tensor(f"{mapped}.{suffix}", values.astype(np.float16 if matrix else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_nomic_folder(directory: Path, shape: NomicShape, tensors: dict[str, np.ndarray]) -> Path:
    """The model folder exo's encoder loads: NomicBERT's custom-code `config.json`,
    `model.safetensors` (float32) and a placeholder word-level tokenizer (the bench feeds token
    ids; no `modules.json`, so pooling is exo's default for the family, mean).

    Returns:
        `directory`.
    """
    import torch
    from safetensors.torch import save_file

    from exo.testing.tiny_encoders import save_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "model_type": "nomic_bert", "architectures": ["NomicBertModel"],
        "n_embd": shape.hidden_size, "n_layer": shape.layers, "n_head": shape.heads,
        "n_inner": shape.intermediate_size, "vocab_size": shape.vocab_size,
        "activation_function": "swiglu", "rotary_emb_base": shape.rope_base,
        "rotary_emb_fraction": 1.0, "rotary_emb_interleaved": False, "prenorm": False,
        "layer_norm_epsilon": shape.layer_norm_eps, "max_trained_positions": shape.max_positions,
        "n_positions": shape.max_positions, "type_vocab_size": 2, "pad_token_id": PAD_ID,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {name: torch.from_numpy(values).contiguous() for name, values in tensors.items()},
        str(directory / "model.safetensors"),
    )
    save_tokenizer(directory, "nomic_bert")
    return directory


def prepare_nomic(cache_dir: Path, shape: NomicShape, gguf_type: str) -> tuple[Path, Path]:
    """`(exo folder, GGUF)` for `shape`, written once into `cache_dir` (a `.done` marker
    guards against a half-written cache)."""
    base = cache_dir / shape.key()
    folder, gguf_path = base / "exo", base / f"model-{gguf_type}.gguf"
    marker = base / f".done-{gguf_type}"
    if not marker.is_file():
        base.mkdir(parents=True, exist_ok=True)
        tensors = random_nomic_tensors(shape)
        write_nomic_folder(folder, shape, tensors)
        write_nomic_gguf(gguf_path, shape, tensors, gguf_type)
        marker.write_text("ok\n")
    return folder, gguf_path


@dataclass(frozen=True, slots=True)
class QwenShape:
    """A Qwen3 decoder's shape (defaults: Qwen3-Embedding-0.6B's config.json, numbers from
    issue 42: 28 layers, hidden 1024, 16 heads of 128, 8 KV heads, MLP 3072, vocabulary
    151,669, rope theta 1e6, RMSNorm eps 1e-6, tied embeddings, last-token pooling)."""

    hidden_size: int = 1024
    layers: int = 28
    heads: int = 16
    kv_heads: int = 8
    head_dim: int = 128
    intermediate_size: int = 3072
    vocab_size: int = 151669
    max_positions: int = 32768
    rope_theta: float = 1e6
    rms_norm_eps: float = 1e-6

    def key(self) -> str:
        return (
            f"qwen3-h{self.hidden_size}-l{self.layers}-a{self.heads}-kv{self.kv_heads}"
            f"-d{self.head_dim}-f{self.intermediate_size}-v{self.vocab_size}"
        )


def random_qwen_tensors(shape: QwenShape, seed: int = 0) -> dict[str, np.ndarray]:
    """Qwen3's tensors by their transformers names (`model.` prefix, no `lm_head`: tied),
    float16-representable float32 values; matrices `[out, in]`."""
    rng = np.random.default_rng(seed)
    hidden, inner, head = shape.hidden_size, shape.intermediate_size, shape.head_dim

    def matrix(rows: int, columns: int, scale: float = 0.02) -> np.ndarray:
        values = rng.standard_normal((rows, columns), dtype=np.float32) * scale
        return values.astype(np.float16).astype(np.float32)

    def norm(width: int) -> np.ndarray:
        weight = 1.0 + 0.1 * rng.standard_normal(width, dtype=np.float32)
        return weight.astype(np.float16).astype(np.float32)

    tensors = {"model.embed_tokens.weight": matrix(shape.vocab_size, hidden, 0.5)}
    for index in range(shape.layers):
        at = f"model.layers.{index}."
        tensors[at + "input_layernorm.weight"] = norm(hidden)
        tensors[at + "self_attn.q_proj.weight"] = matrix(shape.heads * head, hidden)
        tensors[at + "self_attn.k_proj.weight"] = matrix(shape.kv_heads * head, hidden)
        tensors[at + "self_attn.v_proj.weight"] = matrix(shape.kv_heads * head, hidden)
        tensors[at + "self_attn.o_proj.weight"] = matrix(hidden, shape.heads * head)
        tensors[at + "self_attn.q_norm.weight"] = norm(head)
        tensors[at + "self_attn.k_norm.weight"] = norm(head)
        tensors[at + "post_attention_layernorm.weight"] = norm(hidden)
        tensors[at + "mlp.gate_proj.weight"] = matrix(inner, hidden)
        tensors[at + "mlp.up_proj.weight"] = matrix(inner, hidden)
        tensors[at + "mlp.down_proj.weight"] = matrix(hidden, inner)
    tensors["model.norm.weight"] = norm(hidden)
    return tensors


# GGUF types the Qwen3 file's matrices may take: gguf-py quantizes the block types in numpy.
QWEN_GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0", "q4_1")
# A placeholder SentencePiece vocabulary: `<unk>`, `<s>`, `</s>` (the end of every input),
# the 256 byte tokens llama.cpp's SPM vocabulary looks up (its newline), then words.
QWEN_END_ID = 2
QWEN_FIRST_WORD = 3 + 256


def _placeholder_spm_vocabulary(size: int) -> tuple[list[str], list[float], list[int]]:
    import gguf

    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    types += [gguf.TokenType.BYTE] * 256
    tokens += [f"\u2581w{index}" for index in range(size - len(tokens))]
    types += [gguf.TokenType.NORMAL] * (size - len(types))
    return tokens, [0.0] * size, [int(kind) for kind in types]


def write_qwen_gguf(
    path: Path, shape: QwenShape, tensors: dict[str, np.ndarray], tensor_type: str = "q4_1"
) -> Path:
    """A GGUF of llama.cpp's `qwen3` architecture holding `tensors` (tied embeddings: no
    `output.weight`), last-token pooling.

    Tensor names from gguf-py's `TensorNameMap` for `MODEL_ARCH.QWEN3` (no Q/K permutation:
    llama.cpp rotates Qwen3 NeoX-style, as transformers' `rotate_half`); metadata: the
    shape, `attention.key_length` / `value_length` (Qwen3's head_dim is not hidden /
    heads), `pooling_type` last, a placeholder SentencePiece vocabulary (the bench feeds
    token ids). Matrices in `tensor_type` (block types quantized by gguf-py's numpy code),
    1-D tensors float32.

    Returns:
        `path`.
    """
    import gguf

    if tensor_type not in QWEN_GGUF_TYPES:
        raise ValueError(f"tensor_type {tensor_type!r}: one of {QWEN_GGUF_TYPES}")
    quant = {
        "f32": gguf.GGMLQuantizationType.F32, "f16": gguf.GGMLQuantizationType.F16,
        "q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0,
        "q4_1": gguf.GGMLQuantizationType.Q4_1,
    }[tensor_type]  # fmt: skip
    file_type = {
        "f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
        "q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
    }[tensor_type]  # fmt: skip
    architecture = gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(architecture, shape.layers)
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[architecture])
    writer.add_name("random Qwen3-Embedding-0.6B shape")
    writer.add_context_length(shape.max_positions)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_block_count(shape.layers)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_pooling_type(gguf.PoolingType.LAST)
    writer.add_file_type(file_type)
    tokens, scores, types = _placeholder_spm_vocabulary(shape.vocab_size)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(QWEN_END_ID)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)
    for name, values in tensors.items():
        stem, _, suffix = name.rpartition(".")
        mapped = names.get_name(stem)
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        if values.ndim == 1 or tensor_type == "f32":
            writer.add_tensor(f"{mapped}.{suffix}", values.astype(np.float32))
        elif tensor_type == "f16":
            writer.add_tensor(f"{mapped}.{suffix}", values.astype(np.float16))
        else:
            blocks = gguf.quants.quantize(values, quant)
            writer.add_tensor(f"{mapped}.{suffix}", blocks, raw_dtype=quant)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_qwen_folder(directory: Path, shape: QwenShape, tensors: dict[str, np.ndarray]) -> Path:
    """The model folder exo's engine loads: a `Qwen3ForCausalLM` `config.json` (tied
    embeddings), `model.safetensors` (float32) and a word-level placeholder tokenizer whose
    `</s>` is id `QWEN_END_ID` (the EOS; "last" pooling's end token: the bench's inputs end
    with it, so the backend appends nothing).

    Returns:
        `directory`.
    """
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "hidden_size": shape.hidden_size, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim, "intermediate_size": shape.intermediate_size,
        "vocab_size": shape.vocab_size, "max_position_embeddings": shape.max_positions,
        "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps,
        "hidden_act": "silu", "tie_word_embeddings": True, "attention_bias": False,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": QWEN_END_ID,
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(
        {name: torch.from_numpy(values).contiguous() for name, values in tensors.items()},
        str(directory / "model.safetensors"),
        metadata={"format": "pt"},
    )
    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": QWEN_END_ID}
    vocabulary.update({f"w{index}": QWEN_FIRST_WORD + index for index in range(64)})
    Tokenizer(WordLevel(vocabulary, unk_token="<unk>")).save(str(directory / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "model_max_length": shape.max_positions,
    }  # fmt: skip
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return directory


def prepare_qwen(cache_dir: Path, shape: QwenShape, gguf_type: str) -> tuple[Path, Path]:
    """`(exo folder, GGUF)` for `shape`, written once into `cache_dir` (`.done` markers)."""
    base = cache_dir / shape.key()
    folder, gguf_path = base / "exo", base / f"model-{gguf_type}.gguf"
    folder_marker, gguf_marker = base / ".done-exo", base / f".done-{gguf_type}"
    if not (folder_marker.is_file() and gguf_marker.is_file()):
        base.mkdir(parents=True, exist_ok=True)
        tensors = random_qwen_tensors(shape)
        if not folder_marker.is_file():
            write_qwen_folder(folder, shape, tensors)
            folder_marker.write_text("ok\n")
        if not gguf_marker.is_file():
            write_qwen_gguf(gguf_path, shape, tensors, gguf_type)
            gguf_marker.write_text("ok\n")
    return folder, gguf_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--model",
        choices=("nomic", "qwen3"),
        default="nomic",
        help="nomic: nomic-embed-text-v1.5's shape; qwen3: Qwen3-Embedding-0.6B's",
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="layers (default: the model's, 12 or 28)"
    )
    parser.add_argument(
        "--gguf-type", choices=("f16", "f32"), default="f16", help="nomic: GGUF matrix type"
    )
    parser.add_argument(
        "--qwen-gguf-type", choices=QWEN_GGUF_TYPES, default="q4_1", help="qwen3: GGUF matrix type"
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=DEFAULT_CACHE, help="where the random models are kept"
    )
    arguments = parser.parse_args(argv)
    layers = {} if arguments.layers is None else {"layers": arguments.layers}
    if arguments.model == "nomic":
        folder, gguf_path = prepare_nomic(
            arguments.cache_dir, NomicShape(**layers), arguments.gguf_type
        )
    else:
        folder, gguf_path = prepare_qwen(
            arguments.cache_dir, QwenShape(**layers), arguments.qwen_gguf_type
        )
    print(f"exo folder: {folder}\nGGUF: {gguf_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
