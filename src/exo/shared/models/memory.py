"""How many bytes of memory the engine's weights take, computed from a card's shapes.

The engine holds weights in one of three formats (`WeightFormat`); on CPU it uses int4
(`ENGINE_CPU_WEIGHT_FORMAT`): every decoder-layer linear in int4 with one bfloat16 (scale,
zero) pair per group of `INT4_GROUP_SIZE` inputs (int8 where the shape does not fit the
packed layout), the LM head in int8 with one bfloat16 scale per output row, and the input
embedding, norms and biases in float32. Loading quantizes layer by layer, so the peak while
loading is the resident size plus the one tensor group being converted (`loading_peak_bytes`);
that peak, not the float32 size, is what placement reserves, with the KV-cache budget
(`serving_peak_bytes`) and the runner process's own memory (`RUNNER_PROCESS_OVERHEAD_BYTES`).

A mixture-of-experts card (`ModelCard.moe`) counts every expert of its sparse layers in
memory (each expert's gate, up and down linears in the layer's format, the router in
float32 as the engine holds it), whatever share of them a token reads.

An encoder card (`architectures.is_encoder_architecture`: BERT-style encoders, EmbeddingGemma)
is held whole on one node in float32 (`encoder_models.load_encoder_model` reads it so, in every
format) and has no KV cache: its weight bytes are its parameters times 4 and its KV bytes per
token 0, so an embedding-only card reserves no chat KV budget.

A card with the "vision" capability adds its vision tower and projector
(`ModelCard.vision_parameter_count` weights, float32 as the engine holds them:
`vision_tower_bytes`, ~1.7 GB for Gemma 3's 0.4B tower) on the one rank that runs them
(`WeightShare.holds_vision_tower`: a single node, or rank 0 of a split instance). The tower
loads after the text model and, while it loads, holds about twice its float32 bytes
(`VISION_TOWER_LOADING_EXTRA_COPIES`, `loading_peak_bytes`).

Pure functions of a `ModelCard`; the engine's `quantize.py` uses the same constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from exo.shared.models.architectures import is_encoder_architecture
from exo.shared.models.parameter_count import decoder_parameter_count, has_qk_norms
from exo.shared.types.models import (
    GgufFileSource,
    LatentAttention,
    ModelCard,
    MoeGeometry,
    PypiGgufPartsSource,
    PypiGgufSource,
)
from exo.utils.cpu_features import AMX_BF16_FLAGS, cpu_flags

WeightFormat = Literal["float32", "int8", "int4"]
WEIGHT_FORMATS: tuple[WeightFormat, ...] = ("float32", "int8", "int4")
# How prefill rounds activations for exo's block weights (int4, 5-bit, GGUF's int8 blocks)
# on AVX2 CPUs (`--prefill-activations`): "int16" per block of 32 (the decode kernels'
# rounding, exact integer sums), "int8" per block of 32 (llama.cpp's; faster, less exact), or
# "bf16" (the weight dequantized to bfloat16 too, multiplied by AMX tiles: CPUs with
# AMX-BF16 only, elsewhere int16; native/prefill_bf16.cpp).
PrefillActivations = Literal["int16", "int8", "bf16"]
PREFILL_ACTIVATIONS: tuple[PrefillActivations, ...] = ("int16", "int8", "bf16")
# The engine's default (a node's is bf16 on AMX-BF16 CPUs, else this:
# `default_prefill_activations` below). Not int8: on SmolLM2-135M (int4)
# int8 prefill turns the greedy answer to "What is the capital of France?" from "The
# capital of France is Paris." into "L'Étoile, la Marseillaise, la femme, ..." (llama.cpp
# on the same Q4_1 GGUF answers that same text word for word); rounding the prompt's last
# row to int16 does not bring Paris back.
DEFAULT_PREFILL_ACTIVATIONS: PrefillActivations = "int16"
# How int4 weights' decode products round activations (`--decode-activations`): "int16" per
# block of 32 (the default: below float16's precision), or "int8" per block of 32
# (llama.cpp's precision, native/int4_decode_int8.cpp: 1.2-1.6x the int4 decode products on
# AVX2 CPUs without VNNI, for the KL docs/engine.md's "Decode activations" gives). With
# int8, every row of an int4 product takes int8, prompt rows too, so a stream's tokens do
# not depend on which kernel its step's row count picks.
DecodeActivations = Literal["int16", "int8"]
DECODE_ACTIVATIONS: tuple[DecodeActivations, ...] = ("int16", "int8")
DEFAULT_DECODE_ACTIVATIONS: DecodeActivations = "int16"
ENGINE_CPU_WEIGHT_FORMAT: WeightFormat = "int4"


def default_prefill_activations(flags: frozenset[str] | None = None) -> PrefillActivations:
    """`--prefill-activations`' default on a CPU with `flags` (default: this one's): "bf16"
    where AMX-BF16 runs prefill (`AMX_BF16_FLAGS`), else "int16". bf16 multiplied Gemma 3
    270M's and SmolLM2-135M's 128-512-row int4 products ~2x as fast as int16 on a 2-core
    Xeon with AMX, for a KL of ~2e-4 from int16's next-token distributions (docs/engine.md,
    "Prefill activations")."""
    return "bf16" if (cpu_flags() if flags is None else flags) >= AMX_BF16_FLAGS else "int16"


INT4_GROUP_SIZE = 32  # inputs sharing one (scale, zero) pair
INT4_BLOCK_OUTPUTS = 64  # output channels per block of the CPU int4 packed layout
FLOAT32_BYTES = 4
BFLOAT16_BYTES = 2


@dataclass(frozen=True, slots=True)
class WeightShare:
    """The part of a model one node holds.

    Attributes:
        layers: decoder layers held.
        tensor_parallel_ranks: ranks each decoder-layer linear is split over (1: whole).
        holds_embedding: the input embedding is here (first pipeline rank, or every
            tensor-parallel rank).
        holds_output_layer: the final norm and LM head are here (last pipeline rank, or
            every tensor-parallel rank).
        first_layer: the index of the first layer held, where known: a MoE card's layers
            differ (sparse or dense), so a share of known layers is sized exactly; None
            sizes the share's layers as the card's sparse ones first (an upper bound).
        experts: the routed experts held per MoE layer (an expert-parallel rank's share;
            None: every one).
        holds_vision_tower: the vision tower and projector are here (a vision card's
            single node, or rank 0 of a split instance: `Parallelism.runs_vision_tower`);
            sized by `vision_tower_bytes`, 0 for a card without the "vision" capability.
        output_layer_ranks: ranks the LM head's rows (its vocabulary) are split over, each
            holding `vocab_share` of them; None: the tensor-parallel ranks. An
            expert-parallel rank keeps its layers whole but its share of the head.
    """

    layers: int
    tensor_parallel_ranks: int = 1
    holds_embedding: bool = True
    holds_output_layer: bool = True
    first_layer: int | None = None
    experts: int | None = None
    holds_vision_tower: bool = True
    output_layer_ranks: int | None = None

    @property
    def head_ranks(self) -> int:
        """Ranks the LM head's vocabulary is split over (`output_layer_ranks`)."""
        return self.output_layer_ranks or self.tensor_parallel_ranks

    def sparse_layers(self, card: ModelCard) -> int:
        """How many of the share's layers are MoE layers of `card` (0 for a dense card)."""
        if card.moe is None:
            return 0
        if self.first_layer is None:
            return min(self.layers, card.moe.sparse_layers(card.n_layers))
        dense = set(card.moe.dense_layers)
        held = range(self.first_layer, self.first_layer + self.layers)
        return sum(1 for layer in held if layer not in dense)

    def kv_heads(self, card: ModelCard) -> int:
        """KV heads per layer this share caches: tensor ranks hold their part of the
        card's KV heads (rounded up; placement only splits where they divide)."""
        return kv_heads_per_rank(card.num_key_value_heads, self.tensor_parallel_ranks)


def whole_model(card: ModelCard) -> WeightShare:
    """Every layer, the embedding and the LM head on one node."""
    return WeightShare(layers=card.n_layers)


def int4_fits(in_features: int, out_features: int) -> bool:
    """Whether a `[out, in]` weight fits the CPU int4 packed layout."""
    return out_features % INT4_BLOCK_OUTPUTS == 0 and in_features % INT4_GROUP_SIZE == 0


def linear_weight_bytes(in_features: int, out_features: int, weight_format: WeightFormat) -> int:
    """Bytes of one linear's weight (bias excluded) held in `weight_format`.

    int8: one byte per weight plus a bfloat16 scale per output row; int4: half a byte per
    weight plus a bfloat16 (scale, zero) pair per group, int8 where the shape does not fit.
    """
    weights = in_features * out_features
    match weight_format:
        case "float32":
            return weights * FLOAT32_BYTES
        case "int8":
            return weights + out_features * BFLOAT16_BYTES
        case "int4":
            if not int4_fits(in_features, out_features):
                return linear_weight_bytes(in_features, out_features, "int8")
            groups = in_features // INT4_GROUP_SIZE
            return weights // 2 + groups * out_features * 2 * BFLOAT16_BYTES


# GGUF block types the engine repacks into its int4 groups (`gguf_weights.py`).
GGUF_INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q4_K"})
# GGUF 8- and 5-bit block types the engine holds exactly: two int4 planes (1.25 bytes per
# weight) or, with exo's AVX2 kernels, int8 blocks (1.125 bytes per weight; Q5_0 as 5-bit
# lanes, ~0.75).
GGUF_SPLIT_TYPES = frozenset({"Q8_0", "Q5_0", "Q5_1"})
# Unquantized GGUF types: the engine quantizes them as it does any checkpoint's weights.
GGUF_FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
# Bytes per weight exo's AVX2 kernels hold a GGUF type in (`native_kernels`): Q5_0 as 5-bit
# lanes (`int5_blocks.py`: 64 bytes per 96 weights, a row's last group padded, + a bfloat16
# scale per 32: 0.729 for rows that are whole groups, 0.7625 for rows of 640; 0.75 here),
# Q8_0 / Q5_1 as int8 blocks with a (scale, zero) pair per 32 (`quant/int4_planes.py`), Q6_K as
# int8 blocks with a scale per 16 (`int8_blocks.py`).
_NATIVE_BYTES_PER_WEIGHT = {"Q5_0": 24 / 32, "Q8_0": 36 / 32, "Q5_1": 36 / 32, "Q6_K": 18 / 16}
# GGUF MXFP4 (gpt-oss's experts) is held as stored (`quant/mxfp4.py`): 16 bytes of nibbles
# and one e8m0 scale byte per 32 weights, on every node.
GGUF_MXFP4_BYTES_PER_WEIGHT = 17 / 32
# The GGUF type names of MXFP4 (GGML's type 39; Ollama's first gpt-oss blobs' type 4).
GGUF_MXFP4_TYPES = frozenset({"MXFP4", "OLLAMA_MXFP4"})


def gguf_kernel(gguf_type: str, native_kernels: bool) -> str:
    """Which of the engine's decode kernels reads a GGUF type's weights: "int5" (Q5_0) or
    "int8_blocks" (Q8_0 / Q5_1 / Q6_K) where exo's kernels run, else "int4" (the int4
    groups, two int4 planes, and bfloat16 weights, read at about the int4 kernel's rate)."""
    if native_kernels and gguf_type == "Q5_0":
        return "int5"
    if native_kernels and gguf_type in _NATIVE_BYTES_PER_WEIGHT:
        return "int8_blocks"
    return "int4"


def _latent_attention_linears(
    latent: LatentAttention, card: ModelCard, ranks: int
) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """(in, out) of an MLA layer's linears before the heads' output (the low-rank ones
    whole on every tensor rank, those producing heads split), and of `o_proj`."""
    hidden, heads = card.hidden_size, card.num_attention_heads
    query = heads * (latent.qk_nope_head_dim + latent.qk_rope_head_dim) // ranks
    rank = latent.q_lora_rank
    linears = [(hidden, rank), (rank, query)] if rank else [(hidden, query)]
    linears.append((hidden, latent.kv_lora_rank + latent.qk_rope_head_dim))
    linears.append(
        (latent.kv_lora_rank, heads * (latent.qk_nope_head_dim + latent.v_head_dim) // ranks)
    )
    return linears, (heads * latent.v_head_dim // ranks, hidden)


def decoder_layer_bytes_by_kernel(
    card: ModelCard, tensor_parallel_ranks: int = 1, native_kernels: bool = False
) -> dict[str, int]:
    """The linears' bytes of one decoder layer (int4 format) by the kernel that reads
    them (`gguf_kernel`; everything "int4" for a card without `gguf_weight_types`), on
    one tensor rank: the GGUF's types in proportion over the layer's weights, as
    `decoder_layer_bytes` sizes them. Norms, biases and MLA's float32 absorbed copies are
    not included."""
    stored = card.gguf_weight_types
    linears = decoder_layer_bytes(card, "int4", tensor_parallel_ranks, native_kernels)
    linears -= 2 * card.hidden_size * FLOAT32_BYTES
    linears -= _latent_attention_extra_bytes(card, tensor_parallel_ranks)
    if has_qk_norms(card):
        linears -= 2 * card.attention_head_dim * FLOAT32_BYTES
    if card.attention_bias:
        query = card.num_attention_heads * card.attention_head_dim
        key_value = card.num_key_value_heads * card.attention_head_dim
        linears -= (query + 2 * key_value) // tensor_parallel_ranks * FLOAT32_BYTES
    if stored is None:
        return {"int4": linears}
    held = {
        kind: gguf_weight_bytes(kind, count, native_kernels) for kind, count in stored.layer_weights
    }
    total = sum(held.values())
    by_kernel: dict[str, int] = {}
    for kind, size in held.items():
        kernel = gguf_kernel(kind, native_kernels)
        by_kernel[kernel] = by_kernel.get(kernel, 0) + round(linears * size / total)
    return by_kernel


def gguf_weight_bytes(gguf_type: str, weights: int, native_kernels: bool = False) -> int:
    """Bytes the engine holds (int4 format) for `weights` decoder-layer weights stored as
    GGUF `gguf_type` (`worker/engines/torch/quant/gguf_weights.py` routes each type): Q4_0 / Q4_1 /
    Q4_K and float types as int4 groups (half a byte plus a bfloat16 pair per 32); with
    `native_kernels` (a node where exo's AVX2 kernels run) Q5_0 / Q8_0 / Q5_1 / Q6_K in their
    smaller block forms (`_NATIVE_BYTES_PER_WEIGHT`); else Q8_0 / Q5_0 / Q5_1 as two int4
    planes (1.25 bytes) and any other quantized type as bfloat16 (2 bytes). The second is
    never smaller: placement's memory uses it (a node's kernels are not known there).
    MXFP4 (gpt-oss's experts) as stored, 17 bytes per 32 weights."""
    if gguf_type in GGUF_MXFP4_TYPES:
        return math.ceil(weights * GGUF_MXFP4_BYTES_PER_WEIGHT)
    if gguf_type in GGUF_INT4_TYPES or gguf_type in GGUF_FLOAT_TYPES:
        return weights // 2 + weights // INT4_GROUP_SIZE * 2 * BFLOAT16_BYTES
    if native_kernels and gguf_type in _NATIVE_BYTES_PER_WEIGHT:
        return math.ceil(weights * _NATIVE_BYTES_PER_WEIGHT[gguf_type])
    if gguf_type in GGUF_SPLIT_TYPES:
        return weights + weights // INT4_GROUP_SIZE * 2 * 2 * BFLOAT16_BYTES
    return weights * BFLOAT16_BYTES


def _mlp_linears(
    card: ModelCard, ranks: int, sparse: bool, experts: int | None = None
) -> list[tuple[int, int]]:
    """(in, out) of one layer's MLP linears on one tensor rank: the dense gated MLP, or in
    a sparse layer of a MoE card every expert's (or `experts` experts') gate, up and down,
    and its shared expert's."""
    hidden = card.hidden_size
    if sparse and card.moe is not None:
        width = card.moe.expert_intermediate_size // ranks
        held = card.moe.experts if experts is None else experts
        shared = card.moe.shared_expert_intermediate_size // ranks  # on every expert rank
        shared_linears = [(hidden, shared), (hidden, shared), (shared, hidden)] if shared else []
        return [(hidden, width), (hidden, width), (width, hidden)] * held + shared_linears
    width = card.intermediate_size // ranks
    return [(hidden, width), (hidden, width), (width, hidden)]


def mxfp4_experts(card: ModelCard) -> bool:
    """Whether the engine holds `card`'s routed experts as MXFP4 (17 bytes per 32 weights
    in every weight format): its MoE geometry says so (`MoeGeometry.mxfp4_experts`), or it
    is a GGUF whose layers store MXFP4 weights (only experts are: `gguf_gptoss`)."""
    if card.moe is None:
        return False
    stored = card.gguf_weight_types
    return card.moe.mxfp4_experts or (
        stored is not None and any(kind in GGUF_MXFP4_TYPES for kind, _ in stored.layer_weights)
    )


def _latent_attention_extra_bytes(card: ModelCard, ranks: int) -> int:
    """Bytes an MLA layer holds beyond its linears, on one tensor rank (0 for other
    attention): the lean forward's absorbed attention holds kv_b_proj's rows again as
    float32 (`direct_forward_mla.LatentAttention`'s key_up / value_up: [heads, nope + v,
    kv_lora_rank], ~67 MB a layer for DeepSeek-V3's 128 heads), read every decode step,
    and the float32 norms of the low-rank projections."""
    latent = card.latent_attention
    if latent is None:
        return 0
    heads = card.num_attention_heads // ranks
    absorbed = heads * (latent.qk_nope_head_dim + latent.v_head_dim) * latent.kv_lora_rank
    return (absorbed + latent.kv_lora_rank + (latent.q_lora_rank or 0)) * FLOAT32_BYTES


def decoder_layer_bytes(
    card: ModelCard,
    weight_format: WeightFormat,
    tensor_parallel_ranks: int = 1,
    native_kernels: bool = False,
    sparse: bool = False,
    experts: int | None = None,
) -> int:
    """Bytes of one decoder layer on one tensor rank: the attention and gated-MLP linears
    (column-parallel ones split by rows, row-parallel by columns), their biases and the
    norms (float32; per-head q/k norms where the architecture has them). Fused projections
    (Phi-3's `qkv_proj`) hold the same weights; they
    are sized part by part, exact when each part fits int4 (as in every catalog model).
    In int4, a card with `gguf_weight_types` sizes its linears by the types they are
    stored in: the bytes per weight `gguf_weight_bytes` gives them, averaged over all the
    GGUF's layer weights (a GGUF may store some layers' linears in other types than the
    rest's; `native_kernels`: as a node where exo's AVX2 kernels run holds them).
    `sparse`: a MoE layer of a card with `moe` (every expert, or `experts` of them on an
    expert-parallel rank; each split like the dense MLP on tensor ranks; and the router,
    float32 and whole on every rank). Routed experts held as MXFP4 (`mxfp4_experts`) are
    17 bytes per 32 weights in every format, and a GGUF's other types are averaged without
    them."""
    ranks = tensor_parallel_ranks
    hidden = card.hidden_size
    query = card.num_attention_heads * card.attention_head_dim
    key_value = card.num_key_value_heads * card.attention_head_dim
    column = [(hidden, query // ranks), (hidden, key_value // ranks), (hidden, key_value // ranks)]
    mlp = _mlp_linears(card, ranks, sparse, experts)
    mxfp4_weights = 0
    mxfp4 = sparse and card.moe is not None and mxfp4_experts(card)
    if mxfp4 and card.moe is not None:
        routed = 3 * (card.moe.experts if experts is None else experts)  # before the shared
        mxfp4_weights = sum(i * o for i, o in mlp[:routed])
        mlp = mlp[routed:]
    row = [(query // ranks, hidden), *mlp]
    if card.latent_attention is not None:
        column, output = _latent_attention_linears(card.latent_attention, card, ranks)
        row = [output, *mlp]
    stored = card.gguf_weight_types
    other_kinds = [
        (kind, count)
        for kind, count in (stored.layer_weights if stored is not None else ())
        if not (mxfp4 and kind in GGUF_MXFP4_TYPES)
    ]
    if weight_format == "int4" and other_kinds:
        held = sum(gguf_weight_bytes(kind, count, native_kernels) for kind, count in other_kinds)
        weights = sum(count for _, count in other_kinds)
        total = math.ceil(sum(i * o for i, o in (*column, *row)) * held / weights)
    else:
        total = sum(linear_weight_bytes(i, o, weight_format) for i, o in (*column, *row))
    total += math.ceil(mxfp4_weights * GGUF_MXFP4_BYTES_PER_WEIGHT)
    if card.attention_bias:
        total += (query + 2 * key_value) // ranks * FLOAT32_BYTES
    total += _latent_attention_extra_bytes(card, ranks)
    if sparse and card.moe is not None:
        total += card.moe.experts * hidden * FLOAT32_BYTES  # the router
        if card.moe.correction_bias:  # its [experts] e_score_correction_bias
            total += card.moe.experts * FLOAT32_BYTES
    if has_qk_norms(card):
        total += 2 * card.attention_head_dim * FLOAT32_BYTES
    return total + 2 * hidden * FLOAT32_BYTES


def decoder_layers_bytes(card: ModelCard, weight_format: WeightFormat, share: WeightShare) -> int:
    """Bytes of the share's decoder layers (`decoder_layer_bytes` of each, sparse or dense
    as `WeightShare.sparse_layers` counts them)."""
    ranks = share.tensor_parallel_ranks
    sparse = share.sparse_layers(card)
    total = (share.layers - sparse) * decoder_layer_bytes(card, weight_format, ranks)
    if sparse:
        layer = decoder_layer_bytes(card, weight_format, ranks, sparse=True, experts=share.experts)
        total += sparse * layer
    return total


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


def output_layer_bytes(
    card: ModelCard,
    weight_format: WeightFormat,
    shares_embedding: bool,
    native_kernels: bool = False,
) -> int:
    """Bytes of the final norm and LM head: float32 (no extra copy when it is tied to an
    embedding held on the same node), else int8 (the engine keeps the LM head in int8
    under int4 too: an int4 head changed greedy answers) or, for a model converted from
    GGUF whose head is (or, when the card does not say, may be) Q8_0 / Q5_x blocks, the
    larger of that and two int4 planes (`int4_planes`: 1.25 bytes per weight); with
    `native_kernels` (and a known type) as exo's AVX2 kernels hold it: Q8_0 as int8 blocks
    with a bfloat16 scale per 32 (1.0625), Q5_x as int8 blocks with a pair per 32 (1.125)."""
    norm = card.hidden_size * FLOAT32_BYTES
    if weight_format == "float32":
        if shares_embedding:
            return norm
        return norm + card.vocab_size * card.hidden_size * FLOAT32_BYTES
    int8 = linear_weight_bytes(card.hidden_size, card.vocab_size, "int8")
    from_gguf = isinstance(card.source, PypiGgufSource | PypiGgufPartsSource | GgufFileSource)
    stored = card.gguf_weight_types
    split_head = stored is None or stored.output_type in GGUF_SPLIT_TYPES
    if not from_gguf or not split_head or not int4_fits(card.hidden_size, card.vocab_size):
        return norm + int8
    weights = card.vocab_size * card.hidden_size
    if native_kernels and stored is not None:
        per_block = 34 if stored.output_type == "Q8_0" else 36
        return norm + weights // INT4_GROUP_SIZE * per_block
    split_planes = linear_weight_bytes(2 * card.hidden_size, card.vocab_size, "int4")
    return norm + max(int8, split_planes)


def embedding_bytes(card: ModelCard) -> int:
    """The input embedding, float32 in every format (one row is read per token)."""
    return card.vocab_size * card.hidden_size * FLOAT32_BYTES


# Float32 copies of a vision tower beyond the tower itself at the peak of loading it: the
# engine builds the tower's modules from the config without initializing them, then copies
# each checkpoint tensor into its module as it reads it from the memory-mapped bfloat16
# file (whose pages, ~0.5x, count while they are mapped; `vision_parts.load_vision_tensors`).
# Measured 1.69x (a 204M-parameter SigLIP tower) and 2.08x (65M, the modeling code imported
# during the load included), against 2.7x and 3.1x for the earlier loader
# (docs/benchmarks/2026-12-06-vision-tower-loading.md, `bench/bench_tower_loading.py`).
# 1 extra copy: 2x in all.
VISION_TOWER_LOADING_EXTRA_COPIES = 1


def vision_tower_bytes(card: ModelCard) -> int:
    """A vision card's tower and projector as the engine holds them: its
    `vision_parameter_count` weights in float32 (`vision_parts.load_vision_tensors` widens
    the published bfloat16 ones; towers run once per image, so they are not quantized), in
    every weight format. 0 for a card without the "vision" capability (the engine loads no
    tower for it, whatever its checkpoint holds)."""
    if "vision" not in card.capabilities:
        return 0
    return card.vision_parameter_count * FLOAT32_BYTES


def vision_tower_loading_bytes(card: ModelCard) -> int:
    """A vision card's tower at the peak of loading it: `vision_tower_bytes` and its
    `VISION_TOWER_LOADING_EXTRA_COPIES` (0 without the "vision" capability)."""
    return (1 + VISION_TOWER_LOADING_EXTRA_COPIES) * vision_tower_bytes(card)


def encoder_weight_bytes(card: ModelCard) -> int:
    """An encoder card's weights as the encoder engine holds them: every parameter (the
    card's `parameter_count`, else computed from its shapes) in float32."""
    return (card.parameter_count or decoder_parameter_count(card)) * FLOAT32_BYTES


def vocab_share(vocab: int, ranks: int) -> int:
    """Rows of the LM head a tensor rank holds (`sharding.split_head_by_vocab`): the
    vocabulary split evenly, rounded up to a multiple of 64 (the int4 layouts pack outputs
    in 64s); the last rank may hold fewer. The whole vocabulary (no split) where a rank
    would hold none: 64 ids over 2 ranks, 200 over 3."""
    if ranks <= 1:
        return vocab
    per_rank = -(-vocab // ranks)
    share = -(-per_rank // 64) * 64
    return vocab if (ranks - 1) * share >= vocab else share


def resident_weight_bytes(
    card: ModelCard, weight_format: WeightFormat, share: WeightShare | None = None
) -> int:
    """Bytes of the weights a node holds after loading `share` (default: the whole model)
    in `weight_format`, the vision tower's where the share holds it (`vision_tower_bytes`).
    Activations and the KV cache are not included. An encoder card: `encoder_weight_bytes`
    in every format."""
    if is_encoder_architecture(card.architecture):
        return encoder_weight_bytes(card)
    share = share or whole_model(card)
    total = decoder_layers_bytes(card, weight_format, share)
    if share.holds_vision_tower:
        total += vision_tower_bytes(card)
    if share.holds_embedding:
        total += embedding_bytes(card)
    if share.holds_output_layer:
        tied_here = card.tie_word_embeddings and share.holds_embedding
        head = output_layer_bytes(card, weight_format, tied_here)
        if share.head_ranks > 1 and not (weight_format == "float32" and tied_here):
            # A tensor or expert rank keeps its share of the head's rows (the final norm whole).
            norm = card.hidden_size * FLOAT32_BYTES
            rows = vocab_share(card.vocab_size, share.head_ranks)
            head = norm + (head - norm) // card.vocab_size * rows
        total += head
    return total


def loading_peak_bytes(
    card: ModelCard, weight_format: WeightFormat, share: WeightShare | None = None
) -> int:
    """Peak bytes of weights while loading `share`: the resident size plus the largest
    tensor group held in float32 before it is quantized: one decoder layer (of a MoE layer,
    all but its experts and one expert; and the scratch copies of quantizing its largest
    linear), or an LM head
    read from the checkpoint (untied, or tied to an embedding this node does not keep); a
    tied head quantized from the embedding it shares is converted in small row blocks.
    Float32 loading (and an encoder card, read in float32) has no such transient.

    A share holding a vision tower loads it after the text model, and that phase peaks at
    the resident size plus `VISION_TOWER_LOADING_EXTRA_COPIES` x `vision_tower_bytes`
    (the text phase, before the tower exists, at the resident size less the tower plus
    its own transient); the larger of the two."""
    share = share or whole_model(card)
    resident = resident_weight_bytes(card, weight_format, share)
    tower = vision_tower_bytes(card) if share.holds_vision_tower else 0
    tower_loading = VISION_TOWER_LOADING_EXTRA_COPIES * tower
    if is_encoder_architecture(card.architecture):
        return resident
    if weight_format == "float32":
        return resident + tower_loading
    ranks = share.tensor_parallel_ranks
    sparse = share.sparse_layers(card) > 0
    dense = share.sparse_layers(card) < share.layers
    # Quantizing one linear needs a float32 and an int32 scratch copy of its weight.
    widths = [card.num_attention_heads * card.attention_head_dim // ranks]
    if dense:
        widths.append(card.intermediate_size // ranks)
    if sparse and card.moe is not None:
        widths.append(card.moe.expert_intermediate_size // ranks)
    scratch = 2 * card.hidden_size * max(widths) * FLOAT32_BYTES
    # A layer's tensors are read in float32, then quantized; a MoE layer's experts are
    # quantized one by one as they are read (`loading.py`): one expert in float32 at a time.
    largest_layer = max(
        (
            decoder_layer_bytes(card, "float32", ranks, sparse=kind, experts=1)
            for kind, present in ((False, dense), (True, sparse))
            if present
        ),
        default=0,
    )
    transient = scratch + largest_layer
    head_read_in_float32 = not (card.tie_word_embeddings and share.holds_embedding)
    if share.holds_output_layer and head_read_in_float32:
        transient = max(transient, card.vocab_size * card.hidden_size * FLOAT32_BYTES)
    return resident + max(transient - tower, tower_loading)


# How a runner stores keys and values (`--kv-cache-dtype`): bfloat16 by default on CPU (half
# the bytes per token of float32; products and sums stay float32, only the stored values are
# rounded: the cost, teacher-forced against float32 KV, is in
# docs/benchmarks/2026-12-05-kv-bf16.md), float32 where a test or the user asks; on other
# devices the model's dtype (`kv_cache_torch_dtype`).
KVCacheDtype = Literal["bfloat16", "float32"]
KV_CACHE_DTYPES: tuple[KVCacheDtype, ...] = ("bfloat16", "float32")
DEFAULT_KV_CACHE_DTYPE: KVCacheDtype = "bfloat16"
KV_CACHE_DTYPE_BYTES: dict[KVCacheDtype, int] = {"bfloat16": 2, "float32": FLOAT32_BYTES}
# Bytes of one stored key or value placement sizes the KV cache with (the default dtype's;
# a node storing float32 keeps to the same bytes with half the tokens:
# `kv_cache_tokens_for_dtype`).
KV_CACHE_VALUE_BYTES = KV_CACHE_DTYPE_BYTES[DEFAULT_KV_CACHE_DTYPE]


def kv_cache_tokens_for_dtype(tokens: int, dtype: KVCacheDtype | None) -> int:
    """The tokens a KV budget of `tokens` at `KV_CACHE_VALUE_BYTES` per value (what placement
    reserved) holds in `dtype`'s bytes (None: the default dtype): the same memory, fewer
    tokens for a wider dtype (at least 1)."""
    if dtype is None:
        return tokens
    return max(1, tokens * KV_CACHE_VALUE_BYTES // KV_CACHE_DTYPE_BYTES[dtype])


# Tokens of KV cache placement checks a node can hold for a runner (running requests and
# the prefix cache together): eight concurrent requests of 1,024 tokens, or one of 8,192.
# A node's `--kv-cache-tokens` replaces it (`NodeInfo.kv_cache_tokens`); without one,
# placement gives each runner this plus a fraction of the node's memory left
# (`exo.master.placement_memory.memory_sized_kv_cache_tokens`), in `Instance.kv_cache_tokens`.
DEFAULT_KV_CACHE_TOKENS = 8_192
# The smallest budget a node accepts: one request of a few hundred tokens.
MIN_KV_CACHE_TOKENS = 256


@dataclass(frozen=True, slots=True)
class KVGeometry:
    """The KV cache of one rank: `layers` decoder layers, each holding `kv_heads` key and
    value heads of `head_dim` values per token. The one place KV sizes are computed:
    placement and speed prediction build it from the card (`kv_geometry`), the engine from
    the loaded model's config (`kv_geometry_of_config`)."""

    layers: int
    kv_heads: int
    head_dim: int
    latent_values: int = 0
    value_bytes: int = KV_CACHE_VALUE_BYTES

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes: layers × KV heads × head dim × 2 (a key and a value) ×
        `value_bytes` (default `KV_CACHE_VALUE_BYTES`); with multi-head latent attention
        (`latent_values` > 0: the values are the first `latent_values` of each key) the key
        alone."""
        kinds = 1 if self.latent_values else 2
        return self.layers * self.kv_heads * self.head_dim * kinds * self.value_bytes


def latent_kv_geometry(text_config: Any, layers: int) -> KVGeometry | None:
    """The KV geometry of multi-head latent attention (a config with `kv_lora_rank`:
    DeepSeek-V2/V3, Kimi-K2), duck-typed over a transformers config: per layer and token one
    compressed "head" of `kv_lora_rank + qk_rope_head_dim` values (the normed latent, the
    rotated rope key), whose first `kv_lora_rank` values serve as the values; the same on
    every tensor rank (all heads share the latent). None for other attention. Source:
    DeepSeek-V2 paper (arXiv:2405.04434), section 2.1."""
    rank = getattr(text_config, "kv_lora_rank", None)
    if not rank:
        return None
    rope = int(getattr(text_config, "qk_rope_head_dim", 0) or 0)
    return KVGeometry(layers, 1, int(rank) + rope, latent_values=int(rank))


def kv_heads_per_rank(kv_heads: int, tensor_parallel_ranks: int) -> int:
    """KV heads one tensor rank holds (rounded up; tensor placement checks divisibility)."""
    return -(-kv_heads // tensor_parallel_ranks)


def kv_geometry(card: ModelCard, share: WeightShare | None = None) -> KVGeometry:
    """The KV geometry of a node holding `share` of `card`'s model (the whole model when
    None): its layers, its part of the KV heads (multi-head latent attention: one latent
    head, whole on every tensor rank; `latent_kv_geometry`)."""
    share = share or whole_model(card)
    latent = card.latent_attention
    if latent is not None:  # MLA: one latent + rope key per layer, on every tensor rank
        width = latent.kv_lora_rank + latent.qk_rope_head_dim
        return KVGeometry(share.layers, 1, width, latent_values=latent.kv_lora_rank)
    return KVGeometry(
        layers=share.layers,
        kv_heads=share.kv_heads(card),
        head_dim=card.attention_head_dim,
    )


def kv_geometry_of_config(
    text_config: Any, layers: int, tensor_parallel_ranks: int = 1
) -> KVGeometry:
    """The KV geometry of a loaded model from its (text) transformers config, duck-typed so
    this module stays free of transformers: `num_key_value_heads` (else the attention
    heads), `head_dim` (else hidden size / heads).

    Args:
        text_config: the model's text config.
        layers: decoder layers this rank holds.
        tensor_parallel_ranks: ranks the KV heads are split over.
    """
    latent = latent_kv_geometry(text_config, layers)
    if latent is not None:
        return latent
    heads = int(text_config.num_attention_heads)
    kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text_config, "head_dim", None) or text_config.hidden_size // heads)
    return KVGeometry(layers, kv_heads_per_rank(kv_heads, tensor_parallel_ranks), head_dim)


def kv_cache_bytes_per_token(card: ModelCard, share: WeightShare | None = None) -> int:
    """Bytes of KV cache one token takes on a node holding `share` (`KVGeometry`); 0 for
    an encoder card (no KV cache: every input is one bidirectional forward)."""
    if is_encoder_architecture(card.architecture):
        return 0
    return kv_geometry(card, share).bytes_per_token


# A sliding-window layer keeps, beyond its window, up to this many positions of a sequence
# (the engine releases the ones its window no longer sees `SLIDING_WINDOW_TRIM_CHUNK` at a
# time, `SLIDING_WINDOW_TRIM_SLACK` behind the window: worker/engines/torch/batching/
# kv_footprint.py, which says why).
SLIDING_WINDOW_TRIM_SLACK = 128
SLIDING_WINDOW_TRIM_CHUNK = 64
SLIDING_WINDOW_EXTRA_POSITIONS = SLIDING_WINDOW_TRIM_SLACK + SLIDING_WINDOW_TRIM_CHUNK - 1


def kv_budget_tokens_of_length(card: ModelCard, length: int) -> int:
    """KV budget tokens (tokens of every layer: `kv_cache_bytes_per_token` bytes each) one
    sequence of `length` tokens holds: `ceil((F x length + S x min(length, window +
    SLIDING_WINDOW_EXTRA_POSITIONS)) / layers)` with `S` the card's sliding-window layers
    and `F` the others; `length` for a card without them."""
    sliding = card.sliding_window
    if sliding is None:
        return length
    layers = card.n_layers
    kept = min(length, sliding.window + SLIDING_WINDOW_EXTRA_POSITIONS)
    return -(-((layers - sliding.layers) * length + sliding.layers * kept) // layers)


def longest_length_in_kv_budget(card: ModelCard, budget_tokens: int) -> int:
    """The longest sequence whose `kv_budget_tokens_of_length` fits `budget_tokens`
    (`budget_tokens` itself for a card without sliding-window layers; a card whose every
    layer slides fits any length past its window: `budget_tokens x layers` then)."""
    sliding = card.sliding_window
    kept = 0 if sliding is None else sliding.window + SLIDING_WINDOW_EXTRA_POSITIONS
    if sliding is None or budget_tokens <= kept:
        return max(0, budget_tokens)
    full = card.n_layers - sliding.layers
    if full <= 0:
        return budget_tokens * card.n_layers
    return (card.n_layers * budget_tokens - sliding.layers * kept) // full


def kv_cache_budget_bytes(
    card: ModelCard, share: WeightShare | None = None, tokens: int | None = None
) -> int:
    """The KV cache memory a runner holding `share` may use: `tokens` (default
    `DEFAULT_KV_CACHE_TOKENS`) times `kv_cache_bytes_per_token`."""
    budget_tokens = DEFAULT_KV_CACHE_TOKENS if tokens is None else tokens
    return budget_tokens * kv_cache_bytes_per_token(card, share)


# Memory a runner process holds besides its model: the interpreter with torch, transformers
# and the engine imported, the tiny model's weights and warm-up included. Measured with
# `bench/bench_runner_memory.py` (a runner spawned as the supervisor spawns one, importing
# the runner module, loading and warming up a 2-layer hidden-size-64 Llama, psutil after each
# stage; Linux x86-64 CPU, torch 2.13.0, 2026-12-01): USS 296 MiB once the runner module is
# imported, 299 MiB warmed up (RSS 417 MiB, ~100 MiB of it shared library code that further
# runners share). Rounded up to 320 MiB for allocator variation between machines.
RUNNER_PROCESS_OVERHEAD_BYTES = 320 * 2**20


def serving_peak_bytes(
    card: ModelCard,
    weight_format: WeightFormat,
    share: WeightShare | None = None,
    kv_cache_tokens: int | None = None,
) -> int:
    """Peak bytes of a runner holding `share`: the loading peak, or the resident weights
    plus the whole KV-cache budget of `kv_cache_tokens` (`kv_cache_budget_bytes`; None:
    `DEFAULT_KV_CACHE_TOKENS`) once it serves, whichever is larger (the KV cache fills only
    after loading)."""
    share = share or whole_model(card)
    kv_cache = kv_cache_budget_bytes(card, share, kv_cache_tokens)
    serving = resident_weight_bytes(card, weight_format, share) + kv_cache
    return max(loading_peak_bytes(card, weight_format, share), serving)
