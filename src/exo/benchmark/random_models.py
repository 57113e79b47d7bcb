"""Random-weight models at a real model's shape, with a synthetic word-level tokenizer of the
same vocabulary size, for speed measurements of shapes whose weights this machine cannot
download (their text is gibberish; their speed is the real shape's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# Qwen/Qwen3-0.6B's config.json (Hugging Face, 2025): 28 layers, hidden 1024, 16 query heads
# and 8 KV heads of 128, MLP 3072, vocabulary 151936, tied embeddings. Its heads divide by 2,
# so tensor parallel x2 applies.
QWEN3_0_6B_SHAPE: dict[str, Any] = {
    "n_layers": 28,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": True,
}
MARKER = ".exo-bench-random-model.json"


def save_word_tokenizer(directory: Path, vocab_size: int) -> None:
    """A word-level tokenizer of exactly `vocab_size` tokens: `<unk>`, `<s>`, `</s>` (EOS, id
    2) and the words `w3` … `w{vocab_size - 1}`, split on whitespace, so a text of n words
    (`w…` separated by spaces) is n tokens."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocabulary.update({f"w{index}": index for index in range(3, vocab_size)})
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "</s>",
        "bos_token": "<s>",
        "unk_token": "<unk>",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def random_model(directory: Path, model_type: str, shape: dict[str, Any], seed: int = 0) -> Path:
    """A random model of transformers `model_type` ("qwen3", "llama", ...) with `shape`
    (config fields, plus `n_layers`) in `directory` as bfloat16 safetensors, with a word
    tokenizer of its vocabulary size; built once: a directory holding the same shape and
    seed is reused.

    Returns:
        `directory`.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    description = {"model_type": model_type, "shape": shape, "seed": seed}
    marker = directory / MARKER
    if marker.is_file() and json.loads(marker.read_text()) == description:
        return directory
    settings = {name: value for name, value in shape.items() if name != "n_layers"}
    settings.update(num_hidden_layers=int(shape["n_layers"]), eos_token_id=2, bos_token_id=1)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    # Fresh norms are exactly 1 and biases 0; perturb everything so every weight matters.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    save_word_tokenizer(directory, int(shape["vocab_size"]))
    marker.write_text(json.dumps(description))
    return directory
