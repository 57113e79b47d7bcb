"""Tiny GGUF files and Ollama stores for tests: a tiny random Llama written in llama.cpp's
GGUF layout (tensor names, the Q/K row permutation, a byte-level BPE vocabulary of single
characters with a BOS added to every text), and a store holding it under an Ollama name."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from exo.testing.tiny_models import save_tiny_checkout

# checkpoint name inside a decoder layer -> llama.cpp's name
_LAYER_TENSORS = {
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
}
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m.content }}{% endfor %}"


SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
"""Ids 0, 1 (BOS) and 2 (EOS), as in `save_tiny_checkout`'s vocabulary."""
TINY_GGUF_CHARACTERS = " abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.,!?'-:;"
"""The characters the tiny GGUF's byte-level BPE vocabulary holds, one token each (no
merges): 61, so that with the special tokens it fills the tiny model's 64 ids. Other
characters (digits among them) are left out of a tokenized text."""


def byte_level_tokens(vocab_size: int) -> list[str]:
    """The tiny GGUF's token list: the special tokens, then `TINY_GGUF_CHARACTERS` as
    GPT-2's byte-level symbols (a space is "Ġ", U+0120; printable ASCII is itself).

    A word-level list (`save_tiny_checkout`'s words `w0`..`w60`) under `tokenizer.ggml.model`
    "gpt2" with no merges tokenized every text to no ids: byte-level BPE starts from single
    characters, and none was in the vocabulary.
    """
    symbols = ["\u0120" if character == " " else character for character in TINY_GGUF_CHARACTERS]
    tokens = [*SPECIAL_TOKENS, *symbols]
    assert len(tokens) == vocab_size, f"{len(tokens)} tokens for a vocabulary of {vocab_size}"
    return tokens


def _permute(array: Any, heads: int) -> Any:
    """llama.cpp's Q/K row order (rotary pairs interleaved), which loaders undo."""
    rows = array.shape[0]
    return (
        array.reshape(heads, 2, rows // heads // 2, *array.shape[1:])
        .swapaxes(1, 2)
        .reshape(array.shape)
    )


def save_tiny_gguf(path: Path, n_layers: int = 2) -> Path:
    """Write a tiny random Llama (`save_tiny_checkout`'s, kept next to it as
    `<path>.checkout/` to compare with) as a float32 GGUF at `path`.

    Returns:
        `path`.
    """
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    checkout = save_tiny_checkout(path.with_suffix(".checkout"), "llama", n_layers=n_layers)
    config = json.loads((checkout / "config.json").read_text())
    tensors = load_file(str(checkout / "model.safetensors"))
    vocabulary = json.loads((checkout / "tokenizer.json").read_text())["model"]["vocab"]
    tokens = byte_level_tokens(len(vocabulary))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config.get("rope_theta") or 10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)  # as Llama's: a prompt is never empty
    writer.add_chat_template(TINY_CHAT_TEMPLATE)
    for name, array in sorted(tensors.items()):
        if name == "model.embed_tokens.weight":
            target = "token_embd.weight"
        elif name == "model.norm.weight":
            target = "output_norm.weight"
        elif name == "lm_head.weight":
            target = "output.weight"
        else:
            _, _, index, rest = name.split(".", 3)
            target = f"blk.{index}.{_LAYER_TENSORS[rest]}"
            if rest == "self_attn.q_proj.weight":
                array = _permute(array, config["num_attention_heads"])
            elif rest == "self_attn.k_proj.weight":
                array = _permute(array, config["num_key_value_heads"])
        writer.add_tensor(target, np.ascontiguousarray(np.asarray(array, dtype=np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_to_ollama_store(store: Path, name: str, tag: str, gguf_path: Path) -> Path:
    """Put `gguf_path` into an Ollama store as `<name>:<tag>` (blob + manifest).

    Returns:
        The blob's path.
    """
    data = gguf_path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    blob = store / "blobs" / f"sha256-{digest}"
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json"},
        "layers": [
            {
                "mediaType": "application/vnd.ollama.image.model",
                "digest": f"sha256:{digest}",
                "size": len(data),
            }
        ],
    }
    path = store / "manifests" / "registry.ollama.ai" / "library" / name / tag
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(manifest))
    return blob
