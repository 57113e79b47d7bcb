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

Pure functions of a `ModelCard`; the formats and their constants are in `weight_formats`
(the engine's `quantize.py` uses the same), the share in `weight_share`, the KV cache's bytes
in `kv_cache_memory` and what a decode step reads in `decode_reads`.
"""

from __future__ import annotations

import math

from exo.shared.models.architectures import is_encoder_architecture
from exo.shared.models.kv_cache_memory import kv_cache_budget_bytes
from exo.shared.models.parameter_count import decoder_parameter_count, has_qk_norms
from exo.shared.models.weight_formats import (
    BFLOAT16_BYTES,
    FLOAT32_BYTES,
    INT4_BLOCK_OUTPUTS,
    INT4_GROUP_SIZE,
    WeightFormat,
)
from exo.shared.models.weight_share import WeightShare, whole_model
from exo.shared.types.models import (
    LatentAttention,
    ModelCard,
)


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
# A Q6_K LM head where exo's kernels run is held as its blocks: 210 bytes per 256 weights.
Q6K_BLOCK_WEIGHTS, Q6K_BLOCK_BYTES = 256, 210
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
    with a bfloat16 scale per 32 (1.0625), Q5_x as int8 blocks with a pair per 32 (1.125),
    Q6_K as its own blocks (`q6k_blocks.Q6KLinear`: 210 bytes per 256 weights; a node
    started with `EXO_Q6K_HEAD=0` holds int8 instead, which this does not know)."""
    norm = card.hidden_size * FLOAT32_BYTES
    if weight_format == "float32":
        if shares_embedding:
            return norm
        return norm + card.vocab_size * card.hidden_size * FLOAT32_BYTES
    int8 = linear_weight_bytes(card.hidden_size, card.vocab_size, "int8")
    stored = card.gguf_weight_types
    weights = card.vocab_size * card.hidden_size
    if (
        native_kernels
        and card.from_gguf
        and stored is not None
        and stored.output_type == "Q6_K"
        and card.hidden_size % Q6K_BLOCK_WEIGHTS == 0
    ):
        return norm + weights // Q6K_BLOCK_WEIGHTS * Q6K_BLOCK_BYTES  # its own blocks
    split_head = stored is None or stored.output_type in GGUF_SPLIT_TYPES
    if not card.from_gguf or not split_head or not int4_fits(card.hidden_size, card.vocab_size):
        return norm + int8
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


def vocab_rows(vocab: int, rank: int, ranks: int) -> int:
    """Rows of the LM head rank `rank` of `ranks` holds (`sharding.split_head_by_vocab`):
    `vocab_share` each, the last rank what is left; the whole vocabulary where it is not
    split (`vocab_share` gives all of it)."""
    share = vocab_share(vocab, ranks)
    if share >= vocab:
        return vocab
    return max(0, min(vocab, (rank + 1) * share) - rank * share)


def output_layer_rows(card: ModelCard, share: WeightShare) -> int:
    """Rows of `card`'s LM head `share` holds: its `output_layer_rows`, else a tensor
    rank's `vocab_share` (the most any tensor rank holds: an upper bound for the last)."""
    if share.output_layer_rows is not None:
        return share.output_layer_rows
    return vocab_share(card.vocab_size, share.tensor_parallel_ranks)


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
        rows = output_layer_rows(card, share)
        if rows < card.vocab_size and not (weight_format == "float32" and tied_here):
            # A tensor or expert rank keeps its share of the head's rows (the final norm whole).
            norm = card.hidden_size * FLOAT32_BYTES
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
