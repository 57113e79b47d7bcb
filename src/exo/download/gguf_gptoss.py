"""gpt-oss GGUF files (GGUF architecture `gpt-oss`: llama.cpp's converter, ggml-org's and
others' GGUFs on the Hub, and the blobs Ollama's converter writes since its MXFP4 moved to
ggml's type): their config, their MXFP4 expert blocks in exo's layout, their tokenizer.

**MXFP4 blocks.** GGML's MXFP4 (type 39, `ggml-common.h` `block_mxfp4`; `gguf.quants.MXFP4`)
stores 32 inputs in 17 bytes: the e8m0 scale byte `e`, then 16 bytes whose low nibbles are
inputs 0-15 and high nibbles inputs 16-31 (the layout of Q4_0). The 4-bit codes are E2M1
values (sign bit 3), ggml's table holding them doubled with a scale of `2 ** (e - 128)`:
the same value as exo's `2 ** (e - 127)` times the undoubled E2M1 value. So a block becomes
exo's MXFP4 (`quant/mxfp4.py`: blocks `[out, in / 32, 16]` with inputs 2j / 2j + 1 in the
low / high nibble of byte j, scales `[out, in / 32]` the same e8m0 byte) by moving nibbles
only, nothing dequantized (`repack_mxfp4`).

**Config.** transformers 5.25's GGUF config reader fails on every gpt-oss GGUF with YaRN
keys (it converts the key's length field, an array, with `float()`), so the config is built
here from the metadata llama.cpp's converter writes (`gptoss_config`): the dense keys,
`expert_count` / `expert_used_count`, `expert_feed_forward_length`,
`attention.sliding_window`, `rope.scaling.type` (yarn), `.factor`,
`.original_context_length`, and Ollama's `rope.scaling.yarn_beta_fast` / `yarn_beta_slow`
where present. What a GGUF does not store is llama.cpp's fixed choice for the architecture:
sliding attention on even layers, full on odd (`set_swa_pattern(2)`), YaRN betas 32 / 1,
the SwiGLU clamp 7.0 and alpha 1.702 (transformers' defaults), and no YaRN truncation
(gpt-oss's own `truncate: false`).

**Tokenizer.** transformers builds it from the GGUF's `gpt2` vocabulary and merges with
the `gpt-4o` split pattern (`tokenizer.ggml.pre`, o200k's), read by `PreTrainedTokenizerFast`
directly (`AutoTokenizer` would read the config first, and fail as above). It does not read
`tokenizer.ggml.eos_token_ids` (Ollama's list), so the generation config's stop tokens are
the file's `eos_token_id` plus harmony's `<|return|>` / `<|call|>` / `<|endoftext|>` where the
vocabulary has them (`harmony_stop_ids`).

**Ollama's first gpt-oss blobs** (arch `gptoss`; what its converter wrote at its gpt-oss
commit fa7776f, from OpenAI's original checkpoint, and what `ollama pull gpt-oss:20b` /
`:120b` gave then): the keys under `gptoss.` (no `rope.scaling.type`: YaRN whenever
`rope.scaling.factor` is there; no `expert_feed_forward_length`; no `tokenizer.ggml.pre`, so
the o200k split is set here), tensors named after the original checkpoint (`attn_qkv`:
query, key and value rows in that order; `attn_out`; `attn_sinks` without `.weight`;
`ffn_norm` the post-attention norm; `ffn_gate_up_exps` with gate and up rows interleaved, as
gpt-oss's `gate_up_proj`), and MXFP4 under the retired type 4 (`gguf_tensors.OLLAMA_MXFP4`):
blocks of a scale byte + 16 bytes already in Hugging Face's nibble order, so exo's blocks
are those bytes as they are (`repack_ollama_mxfp4`). This reading follows Ollama's converter
and model code (`convert/convert_gptoss.go`, `model/models/gptoss/model.go` at fa7776f); no
real blob was at hand to check it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from exo.download.gguf_configs import special_token_ids
from exo.download.gguf_tensors import GgufArray, GgufDirectory

GPT_OSS = "gpt-oss"  # its `general.architecture`
OLLAMA_GPTOSS = "gptoss"  # Ollama's first blobs' `general.architecture`
ARCHITECTURES = (GPT_OSS, OLLAMA_GPTOSS)
MXFP4_BLOCK_BYTES = 17  # e8m0 scale, 16 bytes of nibbles
MXFP4_BLOCK = 32
# llama.cpp's fixed gpt-oss choices (see the module docstring).
YARN_BETA_FAST, YARN_BETA_SLOW = 32.0, 1.0
SWIGLU_LIMIT = 7.0
HARMONY_STOP_TOKENS = ("<|return|>", "<|call|>", "<|endoftext|>")


class GgufGptOssError(ValueError):
    """A gpt-oss GGUF whose metadata or tensors this reader cannot use (named)."""


def repack_mxfp4(data: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """GGML MXFP4 blocks of a `[rows, in]` weight (raw bytes, `[rows, in / 32 * 17]`) as
    exo's MXFP4: blocks uint8 `[rows, in / 32, 16]` (input 2j in the low nibble of byte j,
    2j + 1 in the high one) and scales uint8 `[rows, in / 32]`.

    Raises:
        GgufGptOssError: bytes that are no whole blocks.
    """
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if raw.shape[1] % MXFP4_BLOCK_BYTES:
        raise GgufGptOssError(f"MXFP4: {raw.shape[1]} bytes per row is no whole block count")
    blocks = raw.reshape(rows, -1, MXFP4_BLOCK_BYTES)
    nibbles = blocks[..., 1:]
    codes = np.concatenate([nibbles & 15, nibbles >> 4], axis=-1)  # [rows, groups, 32]
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return np.ascontiguousarray(packed), np.ascontiguousarray(blocks[..., 0])


def repack_ollama_mxfp4(data: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Ollama's first MXFP4 blocks (type 4: the scale byte, then 16 bytes in exo's own
    nibble order) of a `[rows, in]` weight as exo's blocks `[rows, in / 32, 16]` and scales
    `[rows, in / 32]` (copies of the bytes).

    Raises:
        GgufGptOssError: bytes that are no whole blocks.
    """
    raw = np.asarray(data, dtype=np.uint8).reshape(rows, -1)
    if raw.shape[1] % MXFP4_BLOCK_BYTES:
        raise GgufGptOssError(f"MXFP4: {raw.shape[1]} bytes per row is no whole block count")
    blocks = raw.reshape(rows, -1, MXFP4_BLOCK_BYTES)
    return np.ascontiguousarray(blocks[..., 1:]), np.ascontiguousarray(blocks[..., 0])


def ollama_first_names(layers: int) -> dict[str, str]:
    """GGUF tensor name → checkpoint name for Ollama's first gpt-oss blobs, but the fused
    `attn_qkv` (`ollama_first_row_splits`) and the experts (`gguf_experts`)."""
    names = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    for layer in range(layers):
        block, model = f"blk.{layer}.", f"model.layers.{layer}."
        names[block + "attn_norm.weight"] = model + "input_layernorm.weight"
        names[block + "attn_sinks"] = model + "self_attn.sinks"
        names[block + "attn_sinks.weight"] = model + "self_attn.sinks"
        names[block + "ffn_norm.weight"] = model + "post_attention_layernorm.weight"
        for part in ("weight", "bias"):
            names[f"{block}attn_out.{part}"] = f"{model}self_attn.o_proj.{part}"
            names[f"{block}ffn_gate_inp.{part}"] = f"{model}mlp.router.{part}"
    return names


def ollama_first_row_splits(config: Any) -> dict[str, list[tuple[str, int, int]]]:
    """`blk.N.attn_qkv.weight` / `.bias` → (checkpoint name, first row, end row) of the
    query, key and value projections in it."""
    query = int(config.num_attention_heads) * int(config.head_dim)
    key_value = int(config.num_key_value_heads) * int(config.head_dim)
    bounds = {
        "q_proj": (0, query),
        "k_proj": (query, query + key_value),
        "v_proj": (query + key_value, query + 2 * key_value),
    }
    return {
        f"blk.{layer}.attn_qkv.{part}": [
            (f"model.layers.{layer}.self_attn.{linear}.{part}", start, end)
            for linear, (start, end) in bounds.items()
        ]
        for layer in range(int(config.num_hidden_layers))
        for part in ("weight", "bias")
    }


def _metadata(directory: GgufDirectory, key: str, required: bool = True) -> Any:
    prefix = directory.architecture  # "gpt-oss" or Ollama's first "gptoss"
    value = directory.metadata.get(f"{prefix}.{key}")
    if value is None and required:
        raise GgufGptOssError(f"the GGUF has no {prefix}.{key} in its metadata")
    return value


def rope_parameters(directory: GgufDirectory) -> dict[str, Any]:
    """The YaRN `rope_parameters` of a gpt-oss GGUF (transformers' names), or plain rope
    where it states no scaling.

    Raises:
        GgufGptOssError: a scaling type other than yarn, or yarn without its keys.
    """
    theta = float(_metadata(directory, "rope.freq_base"))
    scaling = _metadata(directory, "rope.scaling.type", required=False)
    if scaling is None and _metadata(directory, "rope.scaling.factor", required=False):
        scaling = "yarn"  # Ollama's first blobs state the factor only
    if scaling in (None, "none"):
        return {"rope_type": "default", "rope_theta": theta}
    if scaling != "yarn":
        raise GgufGptOssError(
            f"{directory.architecture}.rope.scaling.type={scaling!r}: gpt-oss is read with "
            "yarn only"
        )
    beta_fast = _metadata(directory, "rope.scaling.yarn_beta_fast", required=False)
    beta_slow = _metadata(directory, "rope.scaling.yarn_beta_slow", required=False)
    return {
        "rope_type": "yarn",
        "factor": float(_metadata(directory, "rope.scaling.factor")),
        "original_max_position_embeddings": int(
            _metadata(directory, "rope.scaling.original_context_length")
        ),
        "beta_fast": float(YARN_BETA_FAST if beta_fast is None else beta_fast),
        "beta_slow": float(YARN_BETA_SLOW if beta_slow is None else beta_slow),
        "truncate": False,
        "rope_theta": theta,
    }


def gptoss_config(directory: GgufDirectory, mxfp4_experts: bool) -> Any:
    """The `GptOssConfig` of a gpt-oss GGUF (module docstring), float32; with
    `mxfp4_experts` its `quantization_config` says MXFP4 (`quant_method` "mxfp4", as
    gpt-oss's own checkpoints), so the loader holds the experts as MXFP4.

    Raises:
        GgufGptOssError: a metadata key it needs is missing (named).
    """
    from transformers import GptOssConfig

    tokens = directory.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, GgufArray) or not tokens.count:
        raise GgufGptOssError("the GGUF has no tokenizer.ggml.tokens")
    layers = int(_metadata(directory, "block_count"))
    heads = int(_metadata(directory, "attention.head_count"))
    hidden = int(_metadata(directory, "embedding_length"))
    width = _metadata(directory, "expert_feed_forward_length", required=False)
    names = {tensor.name for tensor in directory.tensors}
    settings: dict[str, Any] = {
        "vocab_size": tokens.count,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(width or _metadata(directory, "feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_metadata(directory, "attention.head_count_kv", False) or heads),
        "head_dim": int(_metadata(directory, "attention.key_length", False) or hidden // heads),
        "rms_norm_eps": float(_metadata(directory, "attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_metadata(directory, "context_length")),
        "sliding_window": int(_metadata(directory, "attention.sliding_window")),
        "layer_types": [
            "sliding_attention" if layer % 2 == 0 else "full_attention" for layer in range(layers)
        ],
        "num_local_experts": int(_metadata(directory, "expert_count")),
        "num_experts_per_tok": int(_metadata(directory, "expert_used_count")),
        "rope_parameters": rope_parameters(directory),
        "swiglu_limit": SWIGLU_LIMIT,
        "attention_bias": bool({"blk.0.attn_q.bias", "blk.0.attn_qkv.bias"} & names),
        "tie_word_embeddings": "output.weight" not in names,
        "architectures": ["GptOssForCausalLM"],
        "dtype": "float32",
        **special_token_ids(directory),
    }
    if mxfp4_experts:
        settings["quantization_config"] = {
            "quant_method": "mxfp4",
            "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                       "model.embed_tokens", "lm_head"],
        }  # fmt: skip
    return GptOssConfig(**settings)


def gptoss_tokenizer(gguf_path: Any, pre_tokenizer: object) -> Any:
    """The GGUF's tokenizer (module docstring): o200k's split where the file names no
    pre-tokenizer (Ollama's first blobs), transformers' split for `tokenizer.ggml.pre`
    otherwise (`pre_tokenizer`: the file's `tokenizer.ggml.pre`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.integrations.gguf.gguf_tokenizer_mapping import set_split_regex

    tokenizer = PreTrainedTokenizerFast.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name
    )
    if pre_tokenizer is None:
        set_split_regex(tokenizer, {"pre_tokenizer_type": "gpt-4o"})
    return tokenizer


def harmony_stop_ids(tokenizer: Any, eos_token_id: int | None, vocab_size: int) -> list[int]:
    """`eos_token_id` and the ids of `HARMONY_STOP_TOKENS` the model's vocabulary (ids below
    `vocab_size`: transformers' GPT-2 tokenizer adds `<|endoftext|>` past it where the
    GGUF lacks it) has, in order."""
    vocabulary = tokenizer.get_vocab()
    found = [eos_token_id] if eos_token_id is not None else []
    for token in HARMONY_STOP_TOKENS:
        index = vocabulary.get(token)
        if index is not None and index < vocab_size and index not in found:
            found.append(int(index))
    return found
