"""The number of weights a decoder's shapes imply, to check a card's stated parameter count.

Counts what the checkpoint of a Llama-style decoder holds (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 3): token embedding, per layer the attention projections (grouped-query: K and
V have `num_key_value_heads` heads of `head_dim`), their biases where the family has them,
the gated MLP (gate, up, down), the layer's norms, then the final norm and an untied LM
head. Fused projections (Phi-3's `qkv_proj`, `gate_up_proj`) hold the same weights. A
mixture-of-experts card's sparse layers hold every expert's gated MLP and the router instead
of the dense MLP (`ModelCard.moe`).
"""

from __future__ import annotations

from exo.shared.models.latent_attention import latent_attention_parameters
from exo.shared.types.models import ModelCard

# Norm vectors per decoder layer and whether each layer has per-head Q/K norms, by
# architecture (transformers' modeling files): Gemma 3 normalises before and after both
# attention and MLP and has q_norm/k_norm; Qwen3 has q_norm/k_norm; the rest have two.
_LAYER_NORMS = {"Gemma3ForCausalLM": 4, "Gemma3ForConditionalGeneration": 4}
_QK_NORM_ARCHITECTURES = frozenset(
    {
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)


def has_qk_norms(card: ModelCard) -> bool:
    """Whether each layer of the card's architecture has per-head Q/K RMSNorms."""
    return card.architecture in _QK_NORM_ARCHITECTURES


def decoder_parameter_count(card: ModelCard) -> int:
    """Weights of the card's text decoder, computed from its shapes.

    Args:
        card: A card with the decoder's shapes (a multimodal card's vision tower is not
            counted: it is `card.vision_parameter_count`).

    Returns:
        The number of parameters (elements, not bytes).
    """
    hidden = card.hidden_size
    head_dim = card.attention_head_dim
    query_width = card.num_attention_heads * head_dim
    key_value_width = card.num_key_value_heads * head_dim
    attention = hidden * query_width + 2 * hidden * key_value_width + query_width * hidden
    if card.latent_attention is not None:
        attention = latent_attention_parameters(
            card.latent_attention, hidden, card.num_attention_heads
        )
    if card.attention_bias:
        attention += query_width + 2 * key_value_width
    if has_qk_norms(card):
        attention += 2 * head_dim
    mlp = 3 * hidden * card.intermediate_size
    norms = _LAYER_NORMS.get(card.architecture, 2) * hidden
    per_layer = attention + mlp + norms
    embedding = card.vocab_size * hidden
    lm_head = 0 if card.tie_word_embeddings else card.vocab_size * hidden
    layers = card.n_layers * per_layer
    if card.moe is not None:  # sparse layers: every expert, the shared one and the router
        experts = card.moe.experts * 3 * hidden * card.moe.expert_intermediate_size
        experts += 3 * hidden * card.moe.shared_expert_intermediate_size
        sparse = card.moe.sparse_layers(card.n_layers)
        router = card.moe.experts * hidden + (card.moe.experts if card.moe.correction_bias else 0)
        layers += sparse * (experts + router - mlp)
    return embedding + layers + hidden + lm_head


def active_parameter_count(card: ModelCard) -> int:
    """Weights one token reads: `decoder_parameter_count` with each sparse layer's routed
    experts cut to the `experts_per_token` it is routed to (the router whole); the
    embedding's one row per token is counted whole, as published active counts do."""
    total = decoder_parameter_count(card)
    if card.moe is None:
        return total
    unread = card.moe.experts - card.moe.experts_per_token
    per_expert = 3 * card.hidden_size * card.moe.expert_intermediate_size
    return total - card.moe.sparse_layers(card.n_layers) * unread * per_expert


def human_parameter_count(count: int) -> str:
    """`134515008` -> "135M", `8030261248` -> "8.0B" (Ollama's `parameter_size` style)."""
    for divisor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= divisor:
            value = count / divisor
            return f"{value:.0f}{suffix}" if value >= 100 else f"{value:.1f}{suffix}"
    return str(count)
