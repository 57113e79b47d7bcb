"""How many bytes of a model's weights one decode step reads, and how many weights one
token is multiplied by: every dense layer whole, a mixture-of-experts layer only the
experts its rows are expected to be routed to.

Apart from `memory` (what a node holds) because this is what a step reads, the input of
speed prediction (`exo.master.speed_prediction`) and of the benchmarks' bandwidth bound;
it sizes layers with `memory.decoder_layer_bytes`.
"""

from __future__ import annotations

from exo.shared.models.memory import decoder_layer_bytes
from exo.shared.models.weight_formats import WeightFormat
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.models import ModelCard, MoeGeometry


def expected_experts_read(moe: MoeGeometry, held: int, streams: int = 1) -> float:
    """Expected routed experts of one MoE layer that one decode step reads on a rank holding
    `held` of the layer's experts, for `streams` rows each routed to `experts_per_token`
    experts: `held × (1 − (1 − k / E)^streams)` — every expert is chosen by one row with
    probability k / E and read once however many rows chose it (`model/moe.py` groups a
    step's rows by expert). Routing is taken as uniform and independent between rows, what
    the load-balancing losses MoE routers are trained with aim for (Switch Transformer,
    arXiv 2101.03961; DeepSeek-V3's bias-based balancing, arXiv 2412.19437): one stream
    reads `k × held / E` experts here on average."""
    if streams < 1:
        raise ValueError(f"streams must be >= 1, not {streams}")
    chosen = moe.experts_per_token / moe.experts
    return held * (1 - (1 - chosen) ** streams)


def moe_layer_read_bytes(
    card: ModelCard,
    weight_format: WeightFormat,
    tensor_parallel_ranks: int = 1,
    experts: int | None = None,
    streams: int = 1,
) -> float:
    """Bytes of one MoE layer of `card` (a card with `moe`) a decode step of `streams` rows
    reads on a rank holding `experts` of its routed experts (None: all): everything but the
    routed experts (attention, router, shared expert) and the experts the rows are expected
    to be routed to (`expected_experts_read`)."""
    assert card.moe is not None
    held = card.moe.experts if experts is None else experts
    ranks = tensor_parallel_ranks
    whole = decoder_layer_bytes(card, weight_format, ranks, sparse=True, experts=held)
    without = decoder_layer_bytes(card, weight_format, ranks, sparse=True, experts=0)
    per_expert = (whole - without) / held if held else 0.0
    return without + per_expert * expected_experts_read(card.moe, held, streams)


def decode_read_bytes(
    card: ModelCard, weight_format: WeightFormat, share: WeightShare, streams: int = 1
) -> float:
    """Bytes of the share's decoder layers one decode step reads for `streams` rows: every
    dense layer whole, each MoE layer as `moe_layer_read_bytes`. Equals
    `decoder_layers_bytes` for a dense card."""
    ranks = share.tensor_parallel_ranks
    sparse = share.sparse_layers(card)
    total = float((share.layers - sparse) * decoder_layer_bytes(card, weight_format, ranks))
    if sparse:
        read = moe_layer_read_bytes(card, weight_format, ranks, share.experts, streams)
        total += sparse * read
    return total


def active_linear_params_per_layer(card: ModelCard, sparse: bool) -> int:
    """Weights of one decoder layer's linears one token is multiplied by (whole layer, one
    tensor rank's share is this over the ranks): attention and the dense MLP, or in a MoE
    layer its `experts_per_token` routed experts and shared expert."""
    hidden = card.hidden_size
    query = card.num_attention_heads * card.attention_head_dim
    key_value = card.num_key_value_heads * card.attention_head_dim
    attention = hidden * (2 * query + 2 * key_value)
    if sparse and card.moe is not None:
        moe = card.moe
        width = moe.experts_per_token * moe.expert_intermediate_size
        return attention + 3 * hidden * (width + moe.shared_expert_intermediate_size)
    return attention + 3 * hidden * card.intermediate_size
