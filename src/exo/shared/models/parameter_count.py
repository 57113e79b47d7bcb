"""The number of weights a decoder's shapes imply, to check a card's stated parameter count.

Counts what the checkpoint of a Llama-style decoder holds (Llama, Mistral, Qwen2, Qwen3,
Phi-3, Gemma 3): token embedding, per layer the attention projections (grouped-query: K and
V have `num_key_value_heads` heads of `head_dim`), their biases where the family has them,
the gated MLP (gate, up, down), the layer's norms, then the final norm and an untied LM
head. Fused projections (Phi-3's `qkv_proj`, `gate_up_proj`) hold the same weights. A
mixture-of-experts card's sparse layers hold every expert's gated MLP and the router instead
of the dense MLP (`ModelCard.moe`). An encoder card (BERT, XLM-RoBERTa, NomicBERT: no decoder)
is counted by `encoder_parameter_count`.
"""

from __future__ import annotations

from exo.shared.models.latent_attention import latent_attention_parameters
from exo.shared.types.models import ModelCard

# Norm vectors per decoder layer and whether each layer has per-head Q/K norms, by
# architecture (transformers' modeling files): Gemma 3 normalises before and after both
# attention and MLP and has q_norm/k_norm; Qwen3 has q_norm/k_norm; the rest have two.
# EmbeddingGemma (`Gemma3TextModel`) is the Gemma 3 text model without an LM head.
_LAYER_NORMS = {
    "Gemma3ForCausalLM": 4, "Gemma3ForConditionalGeneration": 4, "Gemma3TextModel": 4,
}  # fmt: skip
_QK_NORM_ARCHITECTURES = frozenset(
    {
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
        "Gemma3TextModel",
        "Qwen3ForCausalLM",
        "Qwen3MoeForCausalLM",
    }
)


def has_qk_norms(card: ModelCard) -> bool:
    """Whether each layer of the card's architecture has per-head Q/K RMSNorms."""
    return card.architecture in _QK_NORM_ARCHITECTURES


# Post-norm encoders (transformers' `modeling_bert`, `modeling_xlm_roberta`, `modeling_nomic_bert`):
# whether the MLP is gated (NomicBERT's SwiGLU: 3 matrices, no biases) and whether the
# projections have biases; a sequence-classification head adds `dense` and a one-logit `out_proj`.
_ENCODERS = {
    "BertModel": (False, True),
    "XLMRobertaModel": (False, True),
    "XLMRobertaForSequenceClassification": (False, True),
    "NomicBertModel": (True, False),
}


def is_encoder(card: ModelCard) -> bool:
    """Whether the card is a BERT-style encoder (no decoder, no KV cache)."""
    return card.architecture in _ENCODERS


def encoder_parameter_count(card: ModelCard) -> int:
    """Weights of a BERT-style encoder from the card's shapes: the token embedding, its
    LayerNorm, per layer Q/K/V/O, the MLP and two LayerNorms (biases where the family has
    them), and a classification head. Not counted, as the card does not state their sizes:
    the position table (BERT, XLM-RoBERTa), the token-type rows and the pooler, together under
    2 % of all-MiniLM-L6-v2's and bge-m3's published counts."""
    gated, biased = _ENCODERS[card.architecture]
    hidden, inner = card.hidden_size, card.intermediate_size
    attention = 4 * hidden * hidden + (4 * hidden if biased else 0)
    mlp = (3 if gated else 2) * hidden * inner + ((inner + hidden) if biased else 0)
    per_layer = attention + mlp + 4 * hidden  # two LayerNorms' weights and biases
    head = hidden * hidden + 2 * hidden + 1 if "Classification" in card.architecture else 0
    return card.vocab_size * hidden + 2 * hidden + card.n_layers * per_layer + head


def decoder_parameter_count(card: ModelCard) -> int:
    """Weights of the card's text decoder, computed from its shapes (an encoder card's:
    `encoder_parameter_count`).

    Args:
        card: A card with the decoder's shapes (a multimodal card's vision tower is not
            counted: it is `card.vision_parameter_count`; an embedding-only card's LM head
            is not either).

    Returns:
        The number of parameters (elements, not bytes).
    """
    if is_encoder(card):
        return encoder_parameter_count(card)
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
    # An embedding-only decoder (Qwen3-Embedding) pools hidden states and is published as the
    # bare decoder sentence-transformers saves: no LM head, whatever its base model ties.
    headless = "embedding" in card.capabilities and "rerank" not in card.capabilities
    lm_head = 0 if card.tie_word_embeddings or headless else card.vocab_size * hidden
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
    """`134515008` -> "135M", `8030261248` -> "8.0B", `106852251264` -> "106.9B" (Ollama's
    `parameter_size`: billions always to one decimal, as Ollama shows gpt-oss-120b's
    116,829,156,672 as "116.8B"). The dashboard writes counts the same way.

    Billions keep their decimal at 100 B and over: a whole number there ("107B" for
    GLM-4.5-Air's 106.85 B) read as a size contradicting the model's name ("106b"), where
    the decimal shows it is the counted figure the name rounds. Millions and thousands stay
    whole at 100 and over (Ollama writes two decimals: "134.52M"), as the short names
    that use them do (`smollm2:135m`).
    """
    for divisor, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= divisor:
            value = count / divisor
            whole = value >= 100 and suffix != "B"
            return f"{value:.0f}{suffix}" if whole else f"{value:.1f}{suffix}"
    return str(count)
