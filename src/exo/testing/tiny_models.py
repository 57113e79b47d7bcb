"""Tiny random-weight models of several architectures, saved like a Hugging Face
checkout (config.json + safetensors + tokenizer), for tests that need architectures
the machine has no real weights for. Their text is gibberish; their shapes are real."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma", "gemma3")


def save_tiny_model(
    directory: Path,
    architecture: str,
    tokenizer_source: Path,
    n_layers: int = 6,
    seed: int = 0,
    sliding_window: int = 8,
) -> Path:
    """Write a random `architecture` model with `n_layers` layers and the tokenizer of
    `tokenizer_source` (a model directory) into `directory`.

    Heads (4), KV heads (2) and MLP size (128) divide by 2, so tensor parallel applies.

    Raises:
        ValueError: an architecture not in `ARCHITECTURES`.
    """
    import torch
    from transformers import (
        AutoTokenizer,
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        GemmaConfig,
        GemmaForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        PreTrainedModel,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    common: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "tie_word_embeddings": True,
    }
    torch.manual_seed(seed)
    model: PreTrainedModel
    if architecture == "llama":
        model = LlamaForCausalLM(LlamaConfig(**common))
    elif architecture == "qwen2":  # biases on q/k/v
        model = Qwen2ForCausalLM(Qwen2Config(**common))
    elif architecture == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=16))
    elif architecture == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, head_dim=16))
    elif architecture == "gemma":  # Gemma2 has no SDPA attention in transformers
        model = GemmaForCausalLM(GemmaConfig(**common, head_dim=16))
    elif architecture == "gemma3":
        layer_types = ["sliding_attention", "full_attention"] * (n_layers // 2) + [
            "sliding_attention"
        ] * (n_layers % 2)
        model = Gemma3ForCausalLM(
            Gemma3TextConfig(
                **common,
                head_dim=16,
                sliding_window=sliding_window,
                layer_types=layer_types,
            )
        )
    else:
        raise ValueError(f"no tiny model for {architecture!r}; known: {ARCHITECTURES}")
    # Fresh norms are exactly 1 and biases 0; perturb everything so every weight matters.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.config.architectures = [type(model).__name__]
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (tokenizer_source / name).is_file():
            shutil.copy(tokenizer_source / name, directory / name)
    return directory
