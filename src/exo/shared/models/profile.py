"""The model profile: a card is what placement knows of a model before any file is read;
at load the runner adds what only the model's own files give (its `config.json` geometry,
the tool-call format its tokenizer's chat template shows) and reports every fact the card
states otherwise, so a wrong card is seen (runner log, `RunnerReady.card_mismatches`,
`/models`) instead of silently sizing placement and memory with the wrong numbers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exo.shared.models.cards import sliding_window_of_config
from exo.shared.models.latent_attention import latent_attention_of_config
from exo.shared.models.moe import moe_geometry_of_config
from exo.shared.types.models import ModelCard, MoeGeometry, ToolCallFormat


def text_config_of(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text decoder's part of a `config.json` (`text_config` of multimodal checkpoints,
    else the whole config), as the card's shapes are."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def card_mismatches(
    card: ModelCard,
    config: Mapping[str, Any],
    tool_call_format: ToolCallFormat | None = None,
) -> tuple[str, ...]:
    """Every fact of `card` that its model's files state otherwise, one line each
    (`"num_key_value_heads: card 3, config.json 5"`); empty when they agree.

    Args:
        card: the card placement used.
        config: the model's `config.json` as loaded (a multimodal one's `text_config` is
            read).
        tool_call_format: the format detected from the tokenizer at load (None: not
            checked). A card declaring "none" (not trained to call tools) is not a
            mismatch: exo still prompts such a model in a format of its own.
    """
    text = text_config_of(config)
    heads = text.get("num_attention_heads")
    hidden = text.get("hidden_size")
    head_dim = text.get("head_dim") or (
        hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else None
    )
    facts: list[tuple[str, Any, Any]] = [
        ("n_layers", card.n_layers, text.get("num_hidden_layers")),
        ("hidden_size", card.hidden_size, hidden),
        ("num_attention_heads", card.num_attention_heads, heads),
        ("num_key_value_heads", card.num_key_value_heads, text.get("num_key_value_heads", heads)),
        ("intermediate_size", card.intermediate_size, text.get("intermediate_size")),
        ("vocab_size", card.vocab_size, text.get("vocab_size")),
        ("head_dim", card.attention_head_dim, head_dim),
    ]
    tie = config.get("tie_word_embeddings", text.get("tie_word_embeddings"))
    if isinstance(tie, bool):
        facts.append(("tie_word_embeddings", card.tie_word_embeddings, tie))
    found = [
        f"{name}: card {stated}, config.json {actual}"
        for name, stated, actual in facts
        if actual is not None and stated != actual
    ]
    found += _moe_mismatches(card, text)
    found += _latent_attention_mismatches(card, text)
    sliding = sliding_window_of_config(text)
    # Only where both say (a card without it sizes every layer whole: over-reserving).
    states_layers = isinstance(text.get("layer_types"), list)
    if states_layers and card.sliding_window is not None and card.sliding_window != sliding:
        found.append(f"sliding_window: card {card.sliding_window}, config.json {sliding}")
    positions = text.get("max_position_embeddings")
    if isinstance(positions, int) and card.context_length > positions:
        found.append(
            f"context_length: card {card.context_length}, config.json max_position_embeddings "
            f"{positions}"
        )
    if (
        tool_call_format is not None
        and card.tool_call_format != "none"
        and card.tool_call_format != tool_call_format
    ):
        found.append(
            f"tool_call_format: card {card.tool_call_format}, chat template {tool_call_format}"
        )
    return tuple(found)


_GEOMETRY_FIELDS = (
    "experts",
    "experts_per_token",
    "expert_intermediate_size",
    "dense_layers",
    "shared_expert_intermediate_size",
    "correction_bias",
    "mxfp4_experts",
)


def _moe_mismatches(card: ModelCard, text: Mapping[str, Any]) -> list[str]:
    """The card's MoE geometry against the config's: a card that misses a model's experts
    sizes its memory as a dense model of `intermediate_size` (Qwen3-30B-A3B: 1/16 of its
    expert weights), so a missing or different geometry is reported field by field."""
    try:
        actual = moe_geometry_of_config(text)
    except ValueError as error:
        return [f"moe: config.json {error}"]
    stated = card.moe
    if stated is None and actual is None:
        return []
    if stated is None or actual is None:
        return [f"moe: card {_describe(stated)}, config.json {_describe(actual)}"]
    return [
        f"moe.{name}: card {getattr(stated, name)}, config.json {getattr(actual, name)}"
        for name in _GEOMETRY_FIELDS
        if getattr(stated, name) != getattr(actual, name)
    ]


def _describe(geometry: MoeGeometry | None) -> str:
    if geometry is None:
        return "dense"
    return f"{geometry.experts} experts, {geometry.experts_per_token} per token"


def _latent_attention_mismatches(card: ModelCard, text: Mapping[str, Any]) -> list[str]:
    """The card's MLA ranks against the config's (a card without them sizes the KV cache
    as full keys and values of every head: DeepSeek-V3's 70x its latent)."""
    try:
        actual = latent_attention_of_config(text)
    except ValueError as error:
        return [f"latent_attention: config.json {error}"]
    if card.latent_attention != actual:
        return [f"latent_attention: card {card.latent_attention}, config.json {actual}"]
    return []
