"""Predicted decode tok/s and time to first token of a placement, before it is placed.

A pure function of the model card, the layout (nodes in rank order and their layers) and
what the nodes measured: each node's `NodeSpeed` (`exo.node.speed_probe`) and the links'
`TopologyEdge` latency and bandwidth. A node without a measured speed (an old node, or one
still measuring) gives no prediction (None), never a guessed one.

The model (bytes from `exo.shared.models.memory` and `decode_reads`, in the engine's CPU
format: int4 decoder layers, int8 LM head, float32 KV cache; a GGUF-sourced card's layers
and head as the engine holds the types they are stored in, on a node where exo's kernels
run in their smaller block forms, `NodeSpeed.native_kernels`):

decode, seconds per token (one stream, `context` tokens in the KV cache):
    stage(s) = layer bytes(s) / int4 bytes/s + LM head bytes(s) / int8 bytes/s
               (a MoE layer's bytes: what one token reads, its attention, router, shared
               expert and the routed experts it is expected to choose on this rank,
               `decode_reads.moe_layer_read_bytes`; MXFP4 experts (gpt-oss) at their stored
               17 bytes per 32 weights, read at the int4 rate, the probe measuring no
               MXFP4 kernel; prefill's FLOPs likewise count a token's top-k and shared
               experts only)
               (a GGUF card's layer bytes on a node running exo's kernels: each kernel's
               share at its own measured rate, `NodeSpeed.int5_decode_bytes_per_second` ...)
               + ENGINE_KV_READ_FACTOR × 2 × KV bytes(s, context) / copy bytes/s
               + layers(s) × layer overhead × ENGINE_LAYER_OVERHEAD_FACTOR
    pipeline ×N:  Σ stage(s) + Σ over the N hops of a token's round (rank i → i+1, the
                  last rank's token back to rank 0) of (one-way latency + bytes / bandwidth)
    tensor ×N:    max over ranks of stage(rank) (each rank reads 1/N of every layer's
                  linears and KV heads, and its rows of the LM head) + the step header's one-way
                  latency + 2 all-reduces per layer (attention and MLP outputs), each over
                  the rank links (`worker/engines/torch/comm/tcp_mesh.py`, prefill's too):
                  one one-way latency plus (N − 1) × hidden bytes / bandwidth (all-to-all);
                  then the
                  logits' gather over the links: one one-way latency plus (N − 1) × the
                  rank's share of the vocabulary in float32 / bandwidth
time to first token for `prompt` tokens (processed in chunks of `PREFILL_CHUNK_TOKENS`):
    stage(s) = ENGINE_PREFILL_FACTOR × 2 × (linear params(s) × prompt     (projections, MLP)
                   + layers(s) × prompt² × query width) / float32 FLOP/s   (causal attention)
               + chunks × layers(s) × layer overhead × factor + LM head decode of one row
               + (where exo's kernels run and the node rounds prefill's activations
                  otherwise than the runs that fitted ENGINE_PREFILL_FACTOR, int16:
                  `NodeInfo.prefill_activations`) its integer GEMM's seconds at the node's
                  rounding − those at the fitted rounding: 2 × linear params(s) × prompt,
                  each GGUF type's share at its kernel's measured FLOP/s
                  (`NodeSpeed.int4_prefill_int8_flops` ..., `prefill_gemm_seconds`)
    combined over ranks as decode is, with the hops carrying prompt × hidden activations.
    (The engine's prefill was measured at 1-2× the probe's float32 matmul rate, far below
    its bfloat16 rate: float32 activations, norms and the int4 → bfloat16 dequantization of
    every weight per chunk come with the matmuls; so the float32 rate is the one used. Int8
    activations speed up only the integer GEMM, so only its measured time is exchanged: on
    the 2-core EPYC the probe's int4 GEMM ran 1.8x as fast (5-bit 1.6x, Q6_K 1.5x), Gemma 3
    270M's TTFT ~1.3x.)
A link's one-way latency: between nodes on one machine (a loopback address), half the
slower node's measured loopback round trip (`NodeSpeed.loopback_round_trip_seconds`; the
API's round trip on loopback measures two web servers, not the link); otherwise half the
measured round trip (`TopologyEdge.latency_ms`, an HTTP call to the peer's API, so an
upper bound for the runners' own messages).

The ENGINE_* factors are what the engine does beyond the probe's kernels (its model code's
Python, KV gathering, prefill's float32 work), measured with `bench/bench_prediction.py`
on the 2-core reference machine (see docs/cluster.md, "Predicted speed"); they change when
the engine's forward changes, so that script prints them again.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exo.shared.models.decode_reads import active_linear_params_per_layer, moe_layer_read_bytes
from exo.shared.models.kv_cache_memory import kv_cache_bytes_per_token
from exo.shared.models.memory import (
    GGUF_FLOAT_TYPES,
    GGUF_INT4_TYPES,
    GGUF_SPLIT_TYPES,
    decoder_layer_bytes,
    decoder_layer_bytes_by_kernel,
    gguf_kernel,
    output_layer_bytes,
    output_layer_rows,
)
from exo.shared.models.weight_formats import (
    DEFAULT_PREFILL_ACTIVATIONS,
    FLOAT32_BYTES,
    PrefillActivations,
)
from exo.shared.models.weight_share import WeightShare
from exo.shared.parallelism import parallelism
from exo.shared.types.common import NodeId
from exo.shared.types.instances import Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import NodeSpeed, TopologyEdge

DEFAULT_PROMPT_TOKENS = 512
# The scheduler's prompt chunk when no other request decodes
# (`scheduler.PREFILL_TOKENS_PER_IDLE_STEP`): each chunk dequantizes the int4 weights once.
PREFILL_CHUNK_TOKENS = 512
# Measured with bench/bench_prediction.py on the 2-core reference machine, one pinned core,
# 2026-11-30, while six other engineers' tests loaded it (load average 10-15): noisy, to be
# measured again on a quiet machine (the script prints them).
# The engine's decode step does more per layer than the probe's tiny layer
# (`speed_measurements.TinyLayer`): the engine's per-token time not explained by bytes, per layer,
# over the tiny layer's time. SmolLM2-135M: 3.0-6.2 (median 5.2) over six runs. On the
# AVX2 machine the tiny layer is exo's decode layer (speed probe v4) and the factor fits
# 2.3-3.0 (bench_prediction.py, one pinned core); with 5.0 `exo bench` (2 threads) predicted
# SmolLM2's decode within -1% / -15% at 128 / 512 tokens, so it stays.
ENGINE_LAYER_OVERHEAD_FACTOR = 5.0
# The engine's attention reads the KV cache slower than a plain copy moves bytes (it gathers
# the request's slots and repeats KV heads for grouped-query attention, in float32): the
# extra time per token of a 512-token context over a 32-token one, over the copy model's.
# SmolLM2-135M: 1.9 and 3.5 (2026-11-30, attention as torch operators). Since attention runs
# in exo's decode layer (AVX2 machines), `exo bench`'s 128 -> 512-token decode slowdown
# (2 threads, 2026-12-02) fits 1.88 (SmolLM2-135M: 1.94 ms per token measured, 3.10
# predicted with 3.0) and 1.64 (Gemma 3 270M: 1.39 against 2.55).
ENGINE_KV_READ_FACTOR = 1.75
# The engine's prefill time over 2 × FLOPs / the probe's float32 matmul rate. SmolLM2-135M
# and a random Llama of its size, 32-512 prompt tokens: 0.5-1.4 (median 1.0) on the
# AVX512 machine (2026-11-30); on the AVX2-only 2-core EPYC with exo's kernels (2026-12-01,
# prefill by slabs of dequantized rows) 1.44-1.45 at 128 tokens (bench_prediction.py, one
# pinned core) and 1.5-1.7 at 128-512 (`exo bench`, 2 threads). With prefill as an integer
# GEMM (2026-12-01, session 10) 1.5 over-predicted TTFT by +1% to +35% (median ~+17%) over
# SmolLM2 (2 threads and one pinned core), Gemma 3 270M, and the Qwen3-0.6B-shape model
# single and tensor x2: 1.5 / 1.2.
ENGINE_PREFILL_FACTOR = 1.25
# How the runs that fitted ENGINE_PREFILL_FACTOR rounded prefill's activations (every run
# above predates `--prefill-activations int8`): a node rounding otherwise has this
# rounding's integer-GEMM time exchanged for its own (`prefill_stage_seconds`).
ENGINE_PREFILL_FACTOR_ACTIVATIONS: PrefillActivations = "int16"
# GGUF types whose prefill GEMM keeps int16 activations under int8: Q8_0's symmetric blocks
# of 32 span -127..127, too wide for vpmaddubsw (native/prefill.cpp's `block_matmul`).
INT16_ONLY_GGUF_TYPES = frozenset({"Q8_0"})
LOOPBACK_ADDRESSES = ("127.", "::1", "localhost")


@dataclass(frozen=True, slots=True)
class SpeedPrediction:
    """Predicted single-stream decode tok/s and TTFT (seconds) for `prompt_tokens`."""

    decode_tokens_per_second: float
    ttft_seconds: float
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class _Link:
    one_way_seconds: float
    bytes_per_second: float


def _link(
    edges: Mapping[NodeId, Mapping[NodeId, TopologyEdge]],
    a: NodeId,
    b: NodeId,
    speeds: tuple[NodeSpeed, NodeSpeed],
) -> _Link | None:
    """The measured link a → b (or b → a when only that direction was measured)."""
    edge = edges.get(a, {}).get(b) or edges.get(b, {}).get(a)
    if edge is None:
        return None
    bandwidth = edge.bandwidth_mbps * 1e6 / 8
    if edge.address.startswith(LOOPBACK_ADDRESSES):
        one_way = max(speed.loopback_round_trip_seconds for speed in speeds) / 2
    else:
        one_way = edge.latency_ms / 2 / 1000
    return _Link(one_way, bandwidth if bandwidth > 0 else math.inf)


def _transfer_seconds(link: _Link, size: float) -> float:
    return link.one_way_seconds + size / link.bytes_per_second


def _linear_params(card: ModelCard, share: WeightShare) -> int:
    """Weights of the share's decoder-layer linears one prompt token is multiplied by, over
    its tensor ranks together (a MoE layer's routed top-k and shared experts only)."""
    sparse = share.sparse_layers(card)
    return (share.layers - sparse) * active_linear_params_per_layer(card, False) + (
        sparse * active_linear_params_per_layer(card, True)
    )


def _layer_overhead(speed: NodeSpeed, layers: int) -> float:
    return layers * speed.layer_overhead_seconds * ENGINE_LAYER_OVERHEAD_FACTOR


def _lm_head_seconds(card: ModelCard, speed: NodeSpeed, share: WeightShare) -> float:
    norm = card.hidden_size * FLOAT32_BYTES
    head = output_layer_bytes(card, "int4", False, speed.native_kernels) - norm
    rows = output_layer_rows(card, share)
    rate: float | None = speed.int8_decode_bytes_per_second
    stored = card.gguf_weight_types
    if speed.native_kernels and stored is not None and stored.output_type in GGUF_SPLIT_TYPES:
        # A Q8_0 / Q5_x head is held as int8 blocks (`gguf_weights.split_output_layer`).
        rate = speed.int8_block_decode_bytes_per_second or rate
    return head * rows / card.vocab_size / _kernel_rate(speed, rate)


# A kernel's figure below this fraction of the int4 one is taken for a measurement other
# work held up, and its bytes are read at the int4 rate instead: with nothing in the way,
# on the 2-core AMD EPYC, the 5-bit kernel reads 0.75x the int4 rate and the int8 kernels
# 1.1-1.2x; probed while a node's own runner converted a model they came out 0.01-0.03x
# (only the int4 figure is checked against one thread: `speed_probe.threads_contended`).
CONSISTENT_RATE_FRACTION = 0.25


def _kernel_rate(speed: NodeSpeed, rate: float | None) -> float:
    """`rate` (bytes/s) where measured and consistent with the int4 one, else the int4 rate."""
    int4 = speed.int4_decode_bytes_per_second
    return rate if rate is not None and rate >= CONSISTENT_RATE_FRACTION * int4 else int4


def _layer_read_seconds(card: ModelCard, speed: NodeSpeed, ranks: int) -> float:
    """Seconds one decoder layer's weights take to read: each kernel's bytes at its
    measured rate (`decoder_layer_bytes_by_kernel`; the int4 rate where a kernel's own was
    not measured), norms and biases at the int4 rate."""
    whole = decoder_layer_bytes(card, "int4", ranks, native_kernels=speed.native_kernels)
    rates = {
        "int5": speed.int5_decode_bytes_per_second,
        "int8_blocks": speed.int8_block_decode_bytes_per_second,
    }
    by_kernel = decoder_layer_bytes_by_kernel(card, ranks, speed.native_kernels)
    seconds = (whole - sum(by_kernel.values())) / speed.int4_decode_bytes_per_second
    for kernel, size in by_kernel.items():
        seconds += size / _kernel_rate(speed, rates.get(kernel))
    return seconds


def decode_stage_seconds(
    card: ModelCard, speed: NodeSpeed, share: WeightShare, context_tokens: int
) -> float:
    """Seconds one rank holding `share` spends on one decode step of a single stream with
    `context_tokens` in its KV cache (the module docstring's stage(s))."""
    sparse = share.sparse_layers(card)
    dense = share.layers - sparse
    seconds = dense * _layer_read_seconds(card, speed, share.tensor_parallel_ranks)
    if sparse:  # the experts a token is routed to, not every expert held
        ranks = share.tensor_parallel_ranks
        read = moe_layer_read_bytes(card, "int4", ranks, share.experts)
        seconds += sparse * read / speed.int4_decode_bytes_per_second
    if share.holds_output_layer:
        seconds += _lm_head_seconds(card, speed, share)
    kv = kv_cache_bytes_per_token(card, share) * context_tokens
    seconds += ENGINE_KV_READ_FACTOR * 2 * kv / speed.memory_copy_bytes_per_second
    return seconds + _layer_overhead(speed, share.layers)


def _prefill_gemm_shares(card: ModelCard) -> list[tuple[str, bool, float]]:
    """(kernel, whether int8 activations apply, fraction of the decoder layers' linear
    weights) for the weights prefill's integer GEMM multiplies where exo's kernels run:
    every linear as int4 for a card without `gguf_weight_types`; else each GGUF type in the
    form the engine holds it (`memory.gguf_kernel`), GGUF types held as bfloat16 left out
    (they take the dequantized float32 path, which no rounding changes)."""
    stored = card.gguf_weight_types
    if stored is None:
        return [("int4", True, 1.0)]
    total = sum(count for _, count in stored.layer_weights)
    shares: list[tuple[str, bool, float]] = []
    for kind, count in stored.layer_weights:
        kernel = gguf_kernel(kind, native_kernels=True)
        if kernel == "int4" and kind not in GGUF_INT4_TYPES | GGUF_FLOAT_TYPES:
            continue
        shares.append((kernel, kind not in INT16_ONLY_GGUF_TYPES, count / total))
    return shares


def _prefill_gemm_flops(
    speed: NodeSpeed, kernel: str, activations: PrefillActivations
) -> float | None:
    """The node's measured prefill FLOP/s for `kernel`'s weights rounded as `activations`
    (bf16 where it was not measured, i.e. does not run there: int16's, its fallback)."""
    if kernel == "int5":
        int16 = speed.int5_prefill_int16_flops
        int8, bf16 = speed.int5_prefill_int8_flops, speed.int5_prefill_bf16_flops
    elif kernel == "int8_blocks":
        int16 = speed.int8_block_prefill_int16_flops
        int8, bf16 = speed.int8_block_prefill_int8_flops, speed.int8_block_prefill_bf16_flops
    else:
        int16 = speed.int4_prefill_int16_flops
        int8, bf16 = speed.int4_prefill_int8_flops, speed.int4_prefill_bf16_flops
    if activations == "bf16":
        return bf16 if bf16 is not None else int16
    return int8 if activations == "int8" else int16


# One weight kind's prefill GEMM figures further apart than this, either way, are taken
# for a measurement other work held up, and that kind's time is not exchanged: int8
# activations double the products per instruction (vpmaddubsw against vpmaddwd), and on
# the 2-core EPYC the probe's GEMM ran 1.5-1.8x as fast with them; a node's probe caught
# by its own start-up once measured 5.1x (int16's figure 70 GFLOP/s where it reads ~200).
# bf16 on AMX tiles ran 1.7-2.3x int16's products on a 2-core Xeon (2026-12-03), so the
# bound leaves it room.
PREFILL_ROUNDING_MAX_RATIO = 3.0


def prefill_gemm_seconds(
    card: ModelCard, speed: NodeSpeed, linear_flops: float, activations: PrefillActivations
) -> tuple[float, float] | None:
    """Seconds prefill's integer GEMM (`block_matmul`) takes for `linear_flops` FLOPs of
    `card`'s decoder-layer linears, with activations rounded as `activations` and as
    ENGINE_PREFILL_FACTOR_ACTIVATIONS: each weight kind's share (`_prefill_gemm_shares`) at
    the node's measured FLOP/s for it (`NodeSpeed.int4_prefill_int16_flops` ...; Q8_0's,
    and a kind whose figures lie more than PREFILL_ROUNDING_MAX_RATIO apart, at the fitted
    rounding's for both). None where a figure was not measured (torch's kernels, an older
    node)."""
    own = fitted = 0.0
    for kernel, takes_int8, share in _prefill_gemm_shares(card):
        fitted_rate = _prefill_gemm_flops(speed, kernel, ENGINE_PREFILL_FACTOR_ACTIVATIONS)
        own_rate = (
            _prefill_gemm_flops(speed, kernel, activations)
            if takes_int8 or activations == "bf16"  # bf16 takes every block weight
            else fitted_rate
        )
        if fitted_rate is None or own_rate is None:
            return None
        ratio = own_rate / fitted_rate
        if not 1 / PREFILL_ROUNDING_MAX_RATIO <= ratio <= PREFILL_ROUNDING_MAX_RATIO:
            own_rate = fitted_rate
        own += share * linear_flops / own_rate
        fitted += share * linear_flops / fitted_rate
    return own, fitted


def prefill_stage_seconds(
    card: ModelCard,
    speed: NodeSpeed,
    share: WeightShare,
    prompt_tokens: int,
    activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
) -> float:
    """Seconds one rank holding `share` spends prefilling `prompt_tokens` (the module
    docstring's TTFT stage(s)) with its runners rounding prefill's activations as
    `activations` (`NodeInfo.prefill_activations`)."""
    ranks = share.tensor_parallel_ranks
    params = _linear_params(card, share) / ranks
    query_width = card.num_attention_heads * card.attention_head_dim / ranks
    flops = 2 * (params * prompt_tokens + share.layers * prompt_tokens**2 * query_width)
    seconds = ENGINE_PREFILL_FACTOR * flops / speed.float32_matmul_flops
    exchanged = (
        prefill_gemm_seconds(card, speed, 2 * params * prompt_tokens, activations)
        if speed.native_kernels and activations != ENGINE_PREFILL_FACTOR_ACTIVATIONS
        else None
    )
    if exchanged is not None:  # never below the node's own GEMM time
        own, fitted = exchanged
        seconds = max(seconds - fitted + own, own)
    chunks = math.ceil(prompt_tokens / PREFILL_CHUNK_TOKENS)
    seconds += chunks * _layer_overhead(speed, share.layers)
    if share.holds_output_layer:
        seconds += _lm_head_seconds(card, speed, share)
    return seconds


def _shares(
    card: ModelCard, sharding: Sharding, layer_ranges: Sequence[tuple[int, int]]
) -> list[WeightShare]:
    kind = parallelism(sharding)
    world_size = len(layer_ranges)
    return [
        kind.weight_share(card, rank, world_size, layer_range)
        for rank, layer_range in enumerate(layer_ranges)
    ]


@dataclass(frozen=True, slots=True)
class _LinkNetwork:
    """The ring of measured links (rank r to r + 1, the last to 0) as a `StepNetwork`."""

    links: Sequence[_Link]

    def hop_seconds(self, rank: int, payload_bytes: float) -> float:
        return _transfer_seconds(self.links[rank], payload_bytes)

    def latency_seconds(self) -> float:
        return max(link.one_way_seconds for link in self.links)

    def _narrowest(self) -> float:
        return min(link.bytes_per_second for link in self.links)

    def all_reduce_seconds(self, payload_bytes: float) -> float:
        # The links' all-to-all, at any size: every rank sends its part to every other.
        world_size = len(self.links)
        return self.latency_seconds() + (world_size - 1) * payload_bytes / self._narrowest()

    def all_gather_seconds(self, bytes_per_rank: float) -> float:
        world_size = len(self.links)
        return self.latency_seconds() + (world_size - 1) * bytes_per_rank / self._narrowest()


def _combine(
    card: ModelCard,
    sharding: Sharding,
    stage_seconds: list[float],
    links: list[_Link],
    activation_bytes: float,
) -> float:
    """One rank: its stage; more: as the parallelism combines stages and transfers
    (`Parallelism.step_seconds`)."""
    if len(stage_seconds) == 1:
        return stage_seconds[0]
    network = _LinkNetwork(links)
    return parallelism(sharding).step_seconds(card, stage_seconds, network, activation_bytes)


def predict_speed(
    card: ModelCard,
    sharding: Sharding,
    nodes: Sequence[NodeId],
    layer_ranges: Sequence[tuple[int, int]],
    speeds: Mapping[NodeId, NodeSpeed | None],
    edges: Mapping[NodeId, Mapping[NodeId, TopologyEdge]],
    prompt_tokens: int = DEFAULT_PROMPT_TOKENS,
    prefill_activations: Mapping[NodeId, PrefillActivations] | None = None,
) -> SpeedPrediction | None:
    """Predicted single-stream decode tok/s (with `prompt_tokens` in the KV cache) and
    TTFT (seconds) of `card` on `nodes` in rank order holding `layer_ranges`.

    Args:
        speeds: each node's measured `NodeSpeed` (None: not measured).
        edges: measured links, `edges[source][sink]` (the state's topology).
        prompt_tokens: the prompt's length, >= 1.
        prefill_activations: how each node's runners round prefill's activations
            (`NodeInfo.prefill_activations`); a node not in it: `DEFAULT_PREFILL_ACTIVATIONS`.

    Returns:
        None when a node's speed or a link between consecutive ranks (and last to first)
        is not measured.

    Raises:
        ValueError: `prompt_tokens` < 1, or `nodes` and `layer_ranges` differ in length.
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be >= 1, not {prompt_tokens}")
    if len(nodes) != len(layer_ranges) or not nodes:
        raise ValueError("one layer range per node, at least one node")
    measured = [speeds.get(node) for node in nodes]
    if any(speed is None for speed in measured):
        return None
    node_speeds = [speed for speed in measured if speed is not None]
    ring = list(zip(nodes, [*nodes[1:], nodes[0]], strict=True)) if len(nodes) > 1 else []
    speed_of = dict(zip(nodes, node_speeds, strict=True))
    links = [_link(edges, a, b, (speed_of[a], speed_of[b])) for a, b in ring]
    if any(link is None for link in links):
        return None
    measured_links = [link for link in links if link is not None]
    shares = _shares(card, sharding, layer_ranges)
    rounding = prefill_activations or {}
    decode = _combine(
        card,
        sharding,
        [
            decode_stage_seconds(card, speed, share, prompt_tokens)
            for speed, share in zip(node_speeds, shares, strict=True)
        ],
        measured_links,
        card.hidden_size * FLOAT32_BYTES,
    )
    ttft = _combine(
        card,
        sharding,
        [
            prefill_stage_seconds(
                card, speed, share, prompt_tokens, rounding.get(node, DEFAULT_PREFILL_ACTIVATIONS)
            )
            for node, speed, share in zip(nodes, node_speeds, shares, strict=True)
        ],
        measured_links,
        prompt_tokens * card.hidden_size * FLOAT32_BYTES,
    )
    return SpeedPrediction(
        decode_tokens_per_second=1 / decode, ttft_seconds=ttft, prompt_tokens=prompt_tokens
    )
