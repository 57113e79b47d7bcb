"""What a sentence-transformers model folder says happens after the transformer: its pooling
(`1_Pooling/config.json`) and dense projections (`2_Dense/`, `3_Dense/`, ...), in the order of
`modules.json`.

Both layouts of the pooling config are read: sentence-transformers 2-5's boolean flags
(`pooling_mode_mean_tokens: true`, ...) and 6's `pooling_mode: "mean"`. A `Normalize` module is
left to the runner (it L2-normalizes every embedding). Pooling modes computed: CLS (first token),
mean over the input's tokens, last token; prompts are the client's text, so every token pools
(`include_prompt` false is refused).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from exo.worker.engines.torch.embedding.weights import (
    EmbeddingModelError,
    read_json,
    read_safetensors,
)

POOLING_MODES = ("cls", "mean", "lasttoken")
# sentence-transformers 2-5's flag for each mode.
_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "lasttoken",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
}
# The files a sentence-transformers folder adds to a transformers checkpoint (download/ fetches
# them with the model): the module list, the transformer's settings, each module's folder.
SENTENCE_TRANSFORMERS_FILES = (
    "modules.json",
    "sentence_bert_config.json",
    "config_sentence_transformers.json",
)


@dataclass(frozen=True, slots=True)
class DenseProjection:
    """A sentence-transformers `Dense` module: `activation(x @ weight.T + bias)`, `weight`
    `[out, in]`; activation "identity" or "tanh"."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str

    def __call__(self, pooled: torch.Tensor) -> torch.Tensor:
        projected = F.linear(pooled, self.weight, self.bias)
        return torch.tanh(projected) if self.activation == "tanh" else projected


@dataclass(frozen=True, slots=True)
class SentenceHead:
    """The pooling and the dense projections after the transformer."""

    pooling: str
    projections: tuple[DenseProjection, ...]
    max_seq_length: int | None

    def __call__(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, out]` embeddings from `[B, S, hidden]` states and the `[B, S]` bool mask
        (inputs right-padded)."""
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "lasttoken":
            last = mask.sum(dim=1) - 1
            pooled = hidden[torch.arange(hidden.shape[0]), last]
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        for projection in self.projections:
            pooled = projection(pooled)
        return pooled


def _module_kind(entry: object, origin: Path) -> tuple[str, str]:
    if not isinstance(entry, dict) or not isinstance(entry.get("type"), str):
        raise EmbeddingModelError(f"{origin}: an entry has no type")
    return entry["type"].rsplit(".", 1)[-1], str(entry.get("path", ""))


def _pooling_mode(directory: Path) -> str:
    config = read_json(directory / "config.json")
    mode = config.get("pooling_mode")
    if mode is None:
        chosen = [name for flag, name in _POOLING_FLAGS.items() if config.get(flag)]
        if len(chosen) != 1:
            raise EmbeddingModelError(f"{directory}/config.json: pooling modes {chosen}, not one")
        mode = chosen[0]
    if mode not in POOLING_MODES:
        raise EmbeddingModelError(
            f"{directory}/config.json: pooling mode {mode!r} is not supported"
        )
    if config.get("include_prompt") is False:
        raise EmbeddingModelError(f"{directory}/config.json: include_prompt false is not supported")
    return str(mode)


def _dense(directory: Path) -> DenseProjection:
    config = read_json(directory / "config.json")
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    kind = activation.rsplit(".", 1)[-1].lower()
    if kind not in ("identity", "tanh"):
        raise EmbeddingModelError(f"{directory}: activation {activation} is not supported")
    if config.get("use_residual"):
        raise EmbeddingModelError(f"{directory}: use_residual is not supported")
    tensors = read_safetensors(directory)
    weight = tensors.get("linear.weight")
    if weight is None:
        raise EmbeddingModelError(f"{directory}: no linear.weight")
    expected = (int(config["out_features"]), int(config["in_features"]))
    if tuple(weight.shape) != expected:
        raise EmbeddingModelError(
            f"{directory}: linear.weight is {tuple(weight.shape)}, not {expected}"
        )
    return DenseProjection(weight, tensors.get("linear.bias"), kind)


def read_sentence_head(directory: Path, default_pooling: str) -> SentenceHead:
    """The head `directory/modules.json` describes; without one, `default_pooling` alone (as
    sentence-transformers wraps a plain transformers checkpoint, whose default is mean).

    Raises:
        EmbeddingModelError: a module other than Transformer, Pooling, Dense and Normalize, a
            pooling mode or activation not computed here, or a missing or malformed file.
    """
    settings_path = directory / "sentence_bert_config.json"
    max_seq_length = None
    if settings_path.is_file():
        value = read_json(settings_path).get("max_seq_length")
        max_seq_length = int(value) if isinstance(value, int) else None
    modules_path = directory / "modules.json"
    if not modules_path.is_file():
        return SentenceHead(default_pooling, (), max_seq_length)
    import json

    entries = json.loads(modules_path.read_text(encoding="utf-8"))
    if not isinstance(entries, list):
        raise EmbeddingModelError(f"{modules_path} is not a list")
    pooling: str | None = None
    projections: list[DenseProjection] = []
    for entry in entries:
        kind, path = _module_kind(entry, modules_path)
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            pooling = _pooling_mode(directory / path)
        elif kind == "Dense":
            if pooling is None:
                raise EmbeddingModelError(f"{modules_path}: a Dense module before the pooling")
            projections.append(_dense(directory / path))
        elif kind != "Normalize":
            raise EmbeddingModelError(f"{modules_path}: module {entry['type']} is not supported")
    if pooling is None:
        raise EmbeddingModelError(f"{modules_path} has no Pooling module")
    return SentenceHead(pooling, tuple(projections), max_seq_length)
