"""Tiny random-weight models of every model family, saved like a Hugging Face checkout
(config.json + safetensors + tokenizer), for tests and benchmarks that need architectures
the machine has no real weights for. Their text is gibberish; their shapes are real. Each
family file's `tiny_model` builds the model with the real transformers class."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from exo.chat_protocol.tokenizer_loading import load_tokenizer
from exo.worker.engines.torch.model.families import FAMILIES, family_by_name

TOKENIZER_FILES = (
    "tokenizer.json",
    "tiktoken.model",
    "tokenizer_config.json",
    "chat_template.jinja",
)
ARCHITECTURES = tuple(family.name for family in FAMILIES)
# Families whose file describes a `*ForConditionalGeneration` checkpoint layout.
WRAPPED_ARCHITECTURES = tuple(
    family.name for family in FAMILIES if family.tiny_wrapped_config is not None
)
# A tensor of the vision tower a wrapped checkpoint carries and the text engine skips.
VISION_TENSOR = "vision_tower.patch_embedding.weight"


def save_tiny_model(
    directory: Path,
    architecture: str,
    tokenizer_source: Path | None,
    n_layers: int = 6,
    seed: int = 0,
    sliding_window: int = 8,
    wrapped: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random model of family `architecture` (a `ModelFamily.name`) with `n_layers`
    layers and the tokenizer of `tokenizer_source` (a model directory) into `directory`.

    Heads (4), KV heads (2) and MLP size (128) divide by 2, so tensor parallel applies.

    Args:
        tokenizer_source: where the tokenizer comes from; None for a weights-only model
            (then `vocab_size` must be in `overrides`).
        wrapped: save the `*ForConditionalGeneration` layout (config around a
            `text_config`, text tensors under `language_model.`, plus a vision tensor).
        overrides: config fields replacing the tiny defaults (e.g. `hidden_size`).

    Raises:
        KeyError: no family of that name.
        ValueError: `wrapped` for a family without a wrapped layout.
    """
    import torch
    from safetensors.torch import save_file

    family = family_by_name(architecture)
    tokenizer: Any = None
    settings: dict[str, Any] = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": n_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "tie_word_embeddings": True,
        "sliding_window": sliding_window,
    }
    if tokenizer_source is not None:
        tokenizer = load_tokenizer(tokenizer_source)
        settings["vocab_size"] = len(tokenizer)
        settings["eos_token_id"] = tokenizer.eos_token_id
        settings["bos_token_id"] = tokenizer.bos_token_id
    settings.update(overrides)
    torch.manual_seed(seed)
    model = family.tiny_model(settings)
    # Fresh norms are exactly 1 and biases 0; perturb everything so every weight matters.
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.02)
    model.config.architectures = [type(model).__name__]
    directory.mkdir(parents=True, exist_ok=True)
    if wrapped:
        if family.tiny_wrapped_config is None:
            raise ValueError(f"the {family.name} family has no wrapped checkpoint layout")
        config = family.tiny_wrapped_config(model.config)
        config.architectures = [family.wrapped_architectures[0]]
        _save_wrapped(directory, model, config, save_file)
    else:
        model.save_pretrained(directory, safe_serialization=True)
    if tokenizer_source is not None:
        for name in TOKENIZER_FILES:
            if (tokenizer_source / name).is_file():
                shutil.copy(tokenizer_source / name, directory / name)
    return directory


def _save_wrapped(directory: Path, model: Any, config: Any, save_file: Any) -> None:
    """Save `model`'s tensors under `language_model.` next to a vision tensor, with the
    multimodal `config` (as Gemma 3 4B+ and Mistral-Small 3.1 checkpoints are laid out)."""
    import torch

    tensors = {
        f"language_model.{name}": tensor.detach().contiguous()
        for name, tensor in model.state_dict().items()
    }
    if model.config.tie_word_embeddings:
        tensors.pop("language_model.lm_head.weight", None)
    tensors[VISION_TENSOR] = torch.zeros(8, 3, 2, 2)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config.to_dict(), indent=2))
    model.generation_config.save_pretrained(directory)


# A chat template that shows Hermes tool calls and thinking (what `template_traits` reads).
TOOLS_AND_THINKING_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}"
    "<|im_end|>\n{% endfor %}{% if tools %}<tool_call>{% endif %}<think>\n"
)


def save_tiny_checkout(
    directory: Path,
    architecture: str = "llama",
    chat_template: str | None = TOOLS_AND_THINKING_TEMPLATE,
    config_update: dict[str, Any] | None = None,
    shards: int = 1,
    n_layers: int = 2,
    **overrides: Any,
) -> Path:
    """A tiny random model laid out like a Hub repository: config.json, safetensors weights
    (one file, or `shards` files with `model.safetensors.index.json`), a small word-level
    `tokenizer.json`, `tokenizer_config.json` and, unless None, `chat_template.jinja`.

    The tokenizer's 64 ids are `<unk>` 0, `<s>` 1 (the config's bos), `</s>` 2 (its eos)
    and the words `w0`..`w60`; text is split at whitespace and punctuation (each word one
    id, any other word `<unk>`) and decoded words are joined with spaces.

    Args:
        config_update: fields merged into the saved config.json (e.g. `auto_map`, or another
            `architectures`), as a repository with custom code would have them.
        overrides: config fields the model is built with (`save_tiny_model`'s), e.g.
            `tie_word_embeddings=False` for an LM head of its own.
    """
    from safetensors.torch import load_file, save_file
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import WordLevel

    vocabulary = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i + 3 for i in range(61)}}
    # The family's own special ids (MiniMax-M2's ~200,000) would lie outside the vocabulary.
    special_ids = {"bos_token_id": vocabulary["<s>"], "eos_token_id": vocabulary["</s>"]}
    save_tiny_model(
        directory, architecture, None, n_layers=n_layers, vocab_size=len(vocabulary),
        **{**special_ids, **overrides},
    )  # fmt: skip
    tokenizer = Tokenizer(WordLevel(vocabulary, unk_token="<unk>"))
    # Without a pre-tokenizer a whole prompt is one word, i.e. one `<unk>`.
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    # WordPiece's decoder joins the words with spaces (no word has its `##` prefix).
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    if chat_template is not None:
        (directory / "chat_template.jinja").write_text(chat_template)
    if config_update:
        config = json.loads((directory / "config.json").read_text())
        (directory / "config.json").write_text(json.dumps({**config, **config_update}, indent=2))
    if shards > 1:
        tensors = load_file(str(directory / "model.safetensors"))
        (directory / "model.safetensors").unlink()
        names = sorted(tensors)
        weight_map: dict[str, str] = {}
        for index in range(shards):
            file_name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
            part = {name: tensors[name] for name in names[index::shards]}
            save_file(part, str(directory / file_name), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(part, file_name))
        total = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        index_content = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_content))
    return directory


def save_mxfp4_twin(float_directory: Path, directory: Path) -> Path:
    """The tiny gpt-oss model in `float_directory` as an MXFP4 checkpoint, laid out as
    gpt-oss's own: each stacked expert weight (`mlp.experts.gate_up_proj` `[experts, hidden,
    2 * intermediate]`, `down_proj` `[experts, intermediate, hidden]`) replaced by its
    output-major MXFP4 `<name>_blocks` / `<name>_scales` (`quant.mxfp4.quantize_mxfp4`),
    every other tensor as it was, and `quantization_config.quant_method = "mxfp4"`."""
    import torch
    from safetensors.torch import load_file, save_file

    from exo.worker.engines.torch.quant.mxfp4 import quantize_mxfp4

    directory.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(float_directory / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2).contiguous())
            quantized[f"{name}_blocks"], quantized[f"{name}_scales"] = blocks, scales
        else:
            quantized[name] = tensor
    save_file(quantized, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((float_directory / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }  # fmt: skip
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    for path in float_directory.iterdir():
        if path.name not in ("config.json", "model.safetensors") and path.is_file():
            shutil.copy(path, directory / path.name)
    return directory


def save_fp8_twins(
    float_directory: Path, fp8_directory: Path, dequantized_directory: Path, block: tuple[int, int]
) -> tuple[Path, Path]:
    """The tiny model in `float_directory` as an FP8 block checkpoint laid out as
    DeepSeek-V3's (`quant.fp8_blocks`): every decoder-layer projection weight (`*proj.weight`
    under `model.layers.`, experts included) as float8_e4m3fn with its `weight_scale_inv`
    on the `block` grid, everything else (embedding, norms, routers, LM head) as it was, and
    `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
    "dynamic", "weight_block_size": block}`; and its float twin: the same checkpoint with
    each FP8 weight dequantized to float32 and no quantization config.

    Returns:
        (`fp8_directory`, `dequantized_directory`).
    """
    from safetensors.torch import load_file, save_file

    from exo.worker.engines.torch.quant.fp8_blocks import (
        SCALE_SUFFIX,
        dequantize_fp8_blocks,
        quantize_fp8_blocks,
    )

    tensors = load_file(str(float_directory / "model.safetensors"))
    quantized: dict[str, Any] = {}
    dequantized: dict[str, Any] = {}
    for name, tensor in tensors.items():
        if name.startswith("model.layers.") and name.endswith("proj.weight") and tensor.ndim == 2:
            weight, scale_inv = quantize_fp8_blocks(tensor, block)
            quantized[name], quantized[f"{name}{SCALE_SUFFIX}"] = weight, scale_inv
            dequantized[name] = dequantize_fp8_blocks(weight, scale_inv, block)
        else:
            quantized[name] = dequantized[name] = tensor
    config = json.loads((float_directory / "config.json").read_text())
    for directory, content, quantization in (
        (fp8_directory, quantized, {
            "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
            "weight_block_size": list(block),
        }),
        (dequantized_directory, dequantized, None),
    ):  # fmt: skip
        directory.mkdir(parents=True, exist_ok=True)
        save_file(content, str(directory / "model.safetensors"), metadata={"format": "pt"})
        written = {**config, "quantization_config": quantization} if quantization else config
        (directory / "config.json").write_text(json.dumps(written, indent=2))
        for path in float_directory.iterdir():
            if path.name not in ("config.json", "model.safetensors") and path.is_file():
                shutil.copy(path, directory / path.name)
    return fp8_directory, dequantized_directory
