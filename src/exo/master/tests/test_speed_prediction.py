"""The speed model on synthetic nodes: what moves the prediction and when there is none."""

from __future__ import annotations

import pytest

from exo.master.placement import placement_previews, speed_balanced_split
from exo.master.placement_memory import pipeline_share_bytes
from exo.master.speed_prediction import (
    DEFAULT_PROMPT_TOKENS,
    ENGINE_KV_READ_FACTOR,
    ENGINE_LAYER_OVERHEAD_FACTOR,
    ENGINE_PREFILL_FACTOR_ACTIVATIONS,
    decode_stage_seconds,
    predict_speed,
)
from exo.shared.models.decode_reads import (
    active_linear_params_per_layer,
    decode_read_bytes,
    expected_experts_read,
    moe_layer_read_bytes,
)
from exo.shared.models.kv_cache_memory import kv_cache_bytes_per_token
from exo.shared.models.memory import (
    decoder_layer_bytes,
    decoder_layer_bytes_by_kernel,
    decoder_layers_bytes,
    output_layer_bytes,
)
from exo.shared.models.weight_formats import (
    DEFAULT_PREFILL_ACTIVATIONS,
    PREFILL_ACTIVATIONS,
    PrefillActivations,
    WeightFormat,
)
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.common import NodeId
from exo.shared.types.models import GgufWeightTypes, ModelCard, MoeGeometry
from exo.shared.types.nodes import NodeSpeed, TopologyEdge
from exo.testing.builders import make_card, make_node_info, make_state

A, B = NodeId("a"), NodeId("b")
# Heads and MLP divide by 2 (a tensor split is valid).
CARD = make_card(n_layers=12, supports_tensor=True).model_copy(
    update={"num_attention_heads": 8, "num_key_value_heads": 4}
)
GB = 1e9


def speed(int4_gbps: float = 10.0, overhead_us: float = 100.0, flops: float = 100e9) -> NodeSpeed:
    return NodeSpeed(
        threads=1,
        int4_decode_bytes_per_second=int4_gbps * GB,
        int8_decode_bytes_per_second=8 * GB,
        memory_copy_bytes_per_second=20 * GB,
        bf16_matmul_flops=flops,
        float32_matmul_flops=flops / 4,
        layer_overhead_seconds=overhead_us * 1e-6,
        loopback_round_trip_seconds=50e-6,
    )


def link(
    latency_ms: float = 1.0, mbps: float = 10_000.0, address: str = "10.0.0.2"
) -> dict[NodeId, dict[NodeId, TopologyEdge]]:
    """Measured links both ways between A and B (a LAN address unless told otherwise)."""

    def one(source: NodeId, sink: NodeId) -> TopologyEdge:
        return TopologyEdge(
            source=source, sink=sink, address=address, latency_ms=latency_ms, bandwidth_mbps=mbps
        )

    return {A: {B: one(A, B)}, B: {A: one(B, A)}}


def single(card: ModelCard = CARD, node: NodeSpeed | None = None, prompt: int = 512) -> float:
    prediction = predict_speed(
        card, "pipeline", [A], [(0, card.n_layers)], {A: node or speed()}, {}, prompt
    )
    assert prediction is not None
    return prediction.decode_tokens_per_second


def two(sharding: str, latency_ms: float = 1.0, speeds: dict | None = None) -> tuple[float, float]:
    ranges = [(0, 6), (6, 12)] if sharding == "pipeline" else [(0, 12), (0, 12)]
    prediction = predict_speed(
        CARD,
        "pipeline" if sharding == "pipeline" else "tensor",
        [A, B],
        ranges,
        speeds or {A: speed(), B: speed()},
        link(latency_ms),
        DEFAULT_PROMPT_TOKENS,
    )
    assert prediction is not None
    return prediction.decode_tokens_per_second, prediction.ttft_seconds


def test_faster_memory_and_less_overhead_decode_faster() -> None:
    rates = [single(node=speed(int4_gbps=g)) for g in (2, 5, 10, 40)]
    assert rates == sorted(rates) and rates[0] < rates[-1]
    by_overhead = [single(node=speed(overhead_us=us)) for us in (400, 100, 10, 0)]
    assert by_overhead == sorted(by_overhead) and by_overhead[0] < by_overhead[-1]


def test_a_longer_prompt_decodes_slower_and_waits_longer() -> None:
    assert single(prompt=4096) < single(prompt=512) < single(prompt=16)
    ttfts = []
    for prompt in (16, 512, 4096):
        prediction = predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: speed()}, {}, prompt)
        assert prediction is not None and prediction.prompt_tokens == prompt
        ttfts.append(prediction.ttft_seconds)
    assert ttfts == sorted(ttfts) and ttfts[0] < ttfts[-1]
    faster_compute = predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: speed(flops=1e12)}, {})
    slower_compute = predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: speed(flops=1e10)}, {})
    assert faster_compute is not None and slower_compute is not None
    assert faster_compute.ttft_seconds < slower_compute.ttft_seconds


def test_pipeline_adds_the_hops_to_the_stages() -> None:
    one_node = single()
    split, _ = two("pipeline", latency_ms=0.0)
    # Two stages read what one node reads (no more), then the hops cost their latency.
    assert split <= one_node * 1.01
    slower, slower_ttft = two("pipeline", latency_ms=4.0)
    hop_seconds = 2 * 4.0 / 2 / 1000  # two one-way hops per token: half of each round trip
    assert 1 / slower - 1 / split == pytest.approx(hop_seconds, rel=1e-6)
    assert slower_ttft > two("pipeline", latency_ms=0.0)[1]


def test_tensor_divides_the_bytes_and_pays_two_all_reduces_per_layer() -> None:
    whole = decode_stage_seconds(CARD, speed(), WeightShare(layers=12), 512)
    half = decode_stage_seconds(CARD, speed(), WeightShare(layers=12, tensor_parallel_ranks=2), 512)
    layer_bytes = decoder_layer_bytes(CARD, "int4")
    half_layer_bytes = decoder_layer_bytes(CARD, "int4", 2)
    half_kv = kv_cache_bytes_per_token(CARD, WeightShare(layers=12, tensor_parallel_ranks=2))
    assert half_kv * 2 == kv_cache_bytes_per_token(CARD)
    assert half_layer_bytes < layer_bytes * 0.55  # int8 where a half does not fit int4
    # Each rank reads its half of the LM head's rows (vocabulary 49152: 24576 each).
    head = output_layer_bytes(CARD, "int4", shares_embedding=False) - CARD.hidden_size * 4
    assert whole - half == pytest.approx(
        12 * (layer_bytes - half_layer_bytes) / (10 * GB)
        + ENGINE_KV_READ_FACTOR * 2 * 512 * (kv_cache_bytes_per_token(CARD) - half_kv) / (20 * GB)
        + head / 2 / (8 * GB),
        rel=1e-6,
    )
    free_links, _ = two("tensor", latency_ms=0.0)
    assert free_links > single()
    slow_links, _ = two("tensor", latency_ms=1.0)
    # Two all-reduces per layer over the rank links, each one one-way latency of 0.5 ms
    # (both ranks send at once), plus the logits' gather and the step header's one-way
    # latencies.
    extra = 2 * CARD.n_layers * 0.5e-3 + 2 * 0.5e-3
    assert 1 / slow_links - 1 / free_links == pytest.approx(extra, rel=1e-3)


def test_a_q6_k_head_is_predicted_at_its_own_blocks_where_exo_kernels_run() -> None:
    """Where exo's kernels run a Q6_K LM head is held as its blocks (210 bytes per 256
    weights, `q6k_blocks.Q6KLinear`); elsewhere, and for placement memory, int8 per row."""
    types = GgufWeightTypes(layer_weights=(("Q4_K", 1000),), output_type="Q6_K")
    card = CARD.model_copy(update={"hidden_size": 512, "gguf_weight_types": types})
    assert card.from_gguf
    norm = 512 * 4
    held = output_layer_bytes(card, "int4", False, native_kernels=True)
    assert held == norm + card.vocab_size * 2 * 210
    int8 = output_layer_bytes(card, "int4", False)
    assert int8 == norm + card.vocab_size * (512 + 2)  # int8 and a bfloat16 scale per row
    assert held < int8
    odd = card.model_copy(update={"hidden_size": 576})  # not whole blocks: int8
    assert output_layer_bytes(odd, "int4", False, native_kernels=True) == output_layer_bytes(
        odd, "int4", False
    )


def test_a_gguf_card_is_predicted_from_the_types_its_weights_are_stored_in() -> None:
    """The engine holds Q5_0 / Q8_0 blocks at 1.25 bytes per weight (planes) and Q6_K at
    2 (bfloat16), where its own int4 takes 0.625: a GGUF stored in those types reads more
    bytes per token, and the prediction says so (Gemma 3 270M's Q4_K_M was predicted 50-62%
    too fast when every layer was sized as int4)."""

    def typed(layers: tuple[tuple[str, int], ...], head: str) -> ModelCard:
        return CARD.model_copy(
            update={"gguf_weight_types": GgufWeightTypes(layer_weights=layers, output_type=head)}
        )

    # CARD: hidden 576, 8 query heads and 4 KV heads of 72, MLP 1536.
    per_layer = 576 * 576 * 2 + 576 * 288 * 2 + 3 * 576 * 1536
    weights = 12 * per_layer
    int4 = typed((("Q4_K", weights),), "Q8_0")
    mixed = typed((("Q4_K", weights // 2), ("Q6_K", weights // 4), ("Q5_0", weights // 4)), "Q8_0")
    norms = 2 * 576 * 4
    assert decoder_layer_bytes(int4, "int4") == per_layer * 0.625 + norms
    expected = per_layer * (0.5 * 0.625 + 0.25 * 2 + 0.25 * 1.25) + norms
    assert decoder_layer_bytes(mixed, "int4") == pytest.approx(expected, rel=1e-6)
    # Where exo's AVX2 kernels run, Q6_K is held at 1.125 bytes per weight and Q5_0 at
    # 0.75 (5-bit lanes); a node that says so is predicted from those.
    native = per_layer * (0.5 * 0.625 + 0.25 * 1.125 + 0.25 * 0.75) + norms
    assert decoder_layer_bytes(mixed, "int4", native_kernels=True) == pytest.approx(
        native, rel=1e-6
    )
    share = WeightShare(layers=12)
    native_node = speed().model_copy(update={"native_kernels": True})
    assert decode_stage_seconds(mixed, speed(), share, 512) - decode_stage_seconds(
        mixed, native_node, share, 512
    ) == pytest.approx(
        12 * (expected - native) / (10 * GB)
        + CARD.vocab_size * CARD.hidden_size * (1.25 - 34 / 32) / (8 * GB),
        rel=1e-3,
    )
    # Each kernel's bytes at its own measured rate: a 5-bit kernel half as fast as the int4
    # one doubles the Q5_0 share's time (a quarter of the weights, 0.75 bytes each).
    by_kernel = decoder_layer_bytes_by_kernel(mixed, 1, native_kernels=True)
    assert set(by_kernel) == {"int4", "int5", "int8_blocks"}
    assert by_kernel["int5"] == pytest.approx(per_layer * 0.25 * 0.75, rel=1e-6)
    assert sum(by_kernel.values()) == pytest.approx(native - norms, rel=1e-6)
    slow_int5 = native_node.model_copy(update={"int5_decode_bytes_per_second": 5 * GB})
    assert decode_stage_seconds(mixed, slow_int5, share, 512) - decode_stage_seconds(
        mixed, native_node, share, 512
    ) == pytest.approx(12 * by_kernel["int5"] / (10 * GB), rel=1e-6)
    # A Q8_0 head on such a node is held as int8 blocks and read at that kernel's rate, as
    # the Q6_K layer share is (both at the int8 / int4 rates while it is not measured).
    slow_blocks = native_node.model_copy(update={"int8_block_decode_bytes_per_second": 4 * GB})
    head_bytes = CARD.vocab_size * CARD.hidden_size * 34 / 32
    assert decode_stage_seconds(mixed, slow_blocks, share, 512) - decode_stage_seconds(
        mixed, native_node, share, 512
    ) == pytest.approx(
        head_bytes * (1 / (4 * GB) - 1 / (8 * GB))
        + 12 * by_kernel["int8_blocks"] * (1 / (4 * GB) - 1 / (10 * GB)),
        rel=1e-3,
    )
    # A kernel figure far below the int4 one (held up while it was measured: 0.12 GB/s
    # beside 10) is not believed: those bytes are read at the int4 rate.
    collapsed = native_node.model_copy(update={"int5_decode_bytes_per_second": 0.12 * GB})
    assert decode_stage_seconds(mixed, collapsed, share, 512) == pytest.approx(
        decode_stage_seconds(mixed, native_node, share, 512), rel=1e-9
    )
    extra = 12 * (decoder_layer_bytes(mixed, "int4") - decoder_layer_bytes(int4, "int4"))
    assert decode_stage_seconds(mixed, speed(), share, 512) - decode_stage_seconds(
        int4, speed(), share, 512
    ) == pytest.approx(extra / (10 * GB), rel=1e-6)
    # A Q6_K head is dequantized and held in the engine's int8 (1 byte per weight and a
    # bfloat16 scale per row), a Q8_0 head as planes (1.25): the smaller one reads faster.
    q6_head = typed((("Q4_K", weights),), "Q6_K")
    head_weights = CARD.vocab_size * CARD.hidden_size
    assert decode_stage_seconds(int4, speed(), share, 512) - decode_stage_seconds(
        q6_head, speed(), share, 512
    ) == pytest.approx((head_weights * 0.25 - 2 * CARD.vocab_size) / (8 * GB), rel=1e-6)


def prefill_node(int16: float = 60e9, int8: float = 108e9) -> NodeSpeed:
    """A node running exo's kernels whose prefill GEMM reads `int16` / `int8` FLOP/s for
    every weight kind (int8 1.8x as fast, as the 2-core EPYC's int4 GEMM)."""
    return speed().model_copy(
        update={
            "native_kernels": True,
            **{f"{kind}_prefill_int16_flops": int16 for kind in ("int4", "int5", "int8_block")},
            **{f"{kind}_prefill_int8_flops": int8 for kind in ("int4", "int5", "int8_block")},
        }
    )


def ttft(card: ModelCard, node: NodeSpeed, rounding: PrefillActivations, prompt: int) -> float:
    prediction = predict_speed(
        card, "pipeline", [A], [(0, card.n_layers)], {A: node}, {}, prompt, {A: rounding}
    )
    assert prediction is not None
    return prediction.ttft_seconds


@pytest.mark.parametrize("prompt", [128, 512])
def test_int8_prefill_activations_shorten_ttft_by_the_measured_gemm_time(prompt: int) -> None:
    """A node rounding prefill's activations to int8 has the fitted (int16) integer GEMM's
    time exchanged for its own measured one: 2 × linear params × prompt at int8's FLOP/s
    instead of int16's; decode does not move."""
    node = prefill_node()
    params = CARD.n_layers * (576 * (2 * 576 + 2 * 288) + 3 * 576 * 1536)
    gemm_flops = 2 * params * prompt
    int16, int8 = ttft(CARD, node, "int16", prompt), ttft(CARD, node, "int8", prompt)
    assert int16 - int8 == pytest.approx(gemm_flops / 60e9 - gemm_flops / 108e9, rel=1e-9)
    # The fitted rounding is the model as it was (the same TTFT as a node without figures).
    unmeasured = speed().model_copy(update={"native_kernels": True})
    assert int16 == pytest.approx(ttft(CARD, unmeasured, "int16", prompt), rel=1e-12)
    assert int16 == pytest.approx(ttft(CARD, node, ENGINE_PREFILL_FACTOR_ACTIVATIONS, prompt))
    decode = [
        predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: node}, {}, prompt, {A: rounding})
        for rounding in PREFILL_ACTIVATIONS
    ]
    assert len({d.decode_tokens_per_second for d in decode if d is not None}) == 1
    # A node not in the mapping rounds as this exo's default.
    default = predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: node}, {}, prompt)
    assert default is not None
    assert default.ttft_seconds == ttft(CARD, node, DEFAULT_PREFILL_ACTIVATIONS, prompt)


def test_the_rounding_changes_nothing_where_it_cannot_be_priced() -> None:
    """No exchange without both figures (torch's kernels, an older node), with figures a
    held-up measurement left too far apart, or for weights the rounding does not reach:
    Q8_0's blocks keep int16, types held as bfloat16 take the float32 path."""
    unmeasured = speed().model_copy(update={"native_kernels": True})
    held_up_int16 = prefill_node(int16=70e9, int8=361e9)  # a node's start-up held it
    held_up_int8 = prefill_node(int8=15e9)
    for node in (speed(), unmeasured, held_up_int16, held_up_int8):
        assert ttft(CARD, node, "int8", 512) == ttft(CARD, node, "int16", 512)

    def stored_as(*layers: tuple[str, int]) -> ModelCard:
        types = GgufWeightTypes(layer_weights=layers, output_type="Q8_0")
        return CARD.model_copy(update={"gguf_weight_types": types})

    untouched = stored_as(("Q8_0", 1000), ("Q3_K", 1000))
    assert ttft(untouched, prefill_node(), "int8", 512) == ttft(
        untouched, prefill_node(), "int16", 512
    )
    # Half the weights Q4_K (int8 applies), half Q8_0 (int16 kept): half the int4 saving.
    half = stored_as(("Q4_K", 1000), ("Q8_0", 1000))
    assert ttft(half, prefill_node(), "int16", 512) - ttft(
        half, prefill_node(), "int8", 512
    ) == pytest.approx(
        (ttft(CARD, prefill_node(), "int16", 512) - ttft(CARD, prefill_node(), "int8", 512)) / 2,
        rel=1e-9,
    )
    # Each kind at its own figures: a 5-bit GEMM that int8 does not speed up saves nothing.
    q5 = stored_as(("Q5_0", 1000))
    flat_int5 = prefill_node().model_copy(update={"int5_prefill_int8_flops": 60e9})
    assert ttft(q5, flat_int5, "int8", 512) == pytest.approx(ttft(q5, flat_int5, "int16", 512))
    assert ttft(q5, prefill_node(), "int8", 512) < ttft(q5, prefill_node(), "int16", 512)


def test_bf16_prefill_activations_take_every_block_weight_at_their_own_figure() -> None:
    """A node rounding to bf16 has its measured bf16 FLOP/s for every GGUF block type, Q8_0
    included (the AMX path dequantizes any of them); a node that measured none (no
    AMX-BF16: its runners fall back to int16) is priced as int16."""
    node = prefill_node().model_copy(
        update={f"{kind}_prefill_bf16_flops": 120e9 for kind in ("int4", "int5", "int8_block")}
    )
    params = CARD.n_layers * (576 * (2 * 576 + 2 * 288) + 3 * 576 * 1536)
    gemm_flops = 2 * params * 512
    saved = ttft(CARD, node, "int16", 512) - ttft(CARD, node, "bf16", 512)
    assert saved == pytest.approx(gemm_flops / 60e9 - gemm_flops / 120e9, rel=1e-9)
    assert ttft(CARD, prefill_node(), "bf16", 512) == ttft(CARD, prefill_node(), "int16", 512)
    q8 = CARD.model_copy(
        update={
            "gguf_weight_types": GgufWeightTypes(
                layer_weights=(("Q8_0", 1000),), output_type="Q8_0"
            )
        }
    )
    assert ttft(q8, node, "bf16", 512) < ttft(q8, node, "int16", 512)


def test_previews_read_each_nodes_published_prefill_activations() -> None:
    """The master predicts from the rounding each node publishes with its info."""
    ttfts = {}
    for rounding in PREFILL_ACTIVATIONS:
        info = make_node_info(4096).model_copy(
            update={"speed": prefill_node(), "prefill_activations": rounding}
        )
        previews = placement_previews(CARD, make_state(nodes={A: info}), 256)
        alone = next(p for p in previews if (p.sharding, p.node_count) == ("pipeline", 1))
        assert alone.predicted_ttft_seconds is not None
        ttfts[rounding] = alone.predicted_ttft_seconds
        assert alone.predicted_ttft_seconds == ttft(CARD, prefill_node(), rounding, 256)
    assert ttfts["int8"] < ttfts["int16"]


def test_the_slowest_tensor_rank_sets_the_pace() -> None:
    even, _ = two("tensor", speeds={A: speed(), B: speed()})
    uneven, _ = two("tensor", speeds={A: speed(), B: speed(int4_gbps=1)})
    assert uneven < even


def test_no_prediction_without_a_measured_speed_or_link() -> None:
    assert predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: None}, {}) is None
    assert predict_speed(CARD, "pipeline", [A], [(0, 12)], {}, {}) is None
    ranges = [(0, 6), (6, 12)]
    assert predict_speed(CARD, "pipeline", [A, B], ranges, {A: speed(), B: None}, link()) is None
    assert predict_speed(CARD, "pipeline", [A, B], ranges, {A: speed(), B: speed()}, {}) is None
    with pytest.raises(ValueError, match="prompt_tokens"):
        predict_speed(CARD, "pipeline", [A], [(0, 12)], {A: speed()}, {}, 0)


def test_previews_carry_the_prediction_for_the_prompt_asked() -> None:
    measured = make_node_info(4096).model_copy(update={"speed": speed()})
    state = make_state(nodes={A: measured, B: make_node_info(4096)})
    state = state.model_copy(update={"topology": link()})
    previews = {(p.sharding, p.node_count): p for p in placement_previews(CARD, state, 128)}
    alone = previews[("pipeline", 1)]
    assert alone.node_ids == (A,) or alone.node_ids == (B,)
    assert all(p.prediction_prompt_tokens == 128 for p in previews.values())
    # B never measured: every placement using it has no prediction, not a guess.
    assert previews[("pipeline", 2)].error is None
    assert previews[("pipeline", 2)].predicted_decode_tokens_per_second is None
    assert previews[("tensor", 2)].predicted_ttft_seconds is None
    both = state.model_copy(
        update={"node_info": {A: measured, B: measured.model_copy(update={"friendly_name": "b"})}}
    )
    for preview in placement_previews(CARD, both, 128):
        if preview.sharding == "expert":
            assert preview.error is not None  # a dense model: no experts to split
            continue
        assert preview.error is None
        expected = predict_speed(
            CARD, preview.sharding, preview.node_ids, preview.layer_ranges,
            {A: speed(), B: speed()}, link(), 128,
        )  # fmt: skip
        assert expected is not None
        assert preview.predicted_decode_tokens_per_second == expected.decode_tokens_per_second
        assert preview.predicted_ttft_seconds == expected.ttft_seconds


def test_a_loopback_link_costs_the_nodes_measured_loopback_round_trip() -> None:
    """Two nodes on one machine: the API's round trip (two web servers) is not the link's
    cost; half the slower node's measured loopback round trip is."""
    slow_loop = speed().model_copy(update={"loopback_round_trip_seconds": 400e-6})
    ranges = [(0, 6), (6, 12)]
    rates = {}
    for name, speeds in (("fast", {A: speed(), B: speed()}), ("slow", {A: speed(), B: slow_loop})):
        prediction = predict_speed(
            CARD, "pipeline", [A, B], ranges, speeds, link(50.0, address="127.0.0.1")
        )
        assert prediction is not None
        rates[name] = prediction.decode_tokens_per_second
    # Two hops a token, each half the slower round trip: 2 × 200 µs against 2 × 25 µs.
    assert 1 / rates["slow"] - 1 / rates["fast"] == pytest.approx(2 * (200e-6 - 25e-6), rel=1e-6)
    lan = predict_speed(CARD, "pipeline", [A, B], ranges, {A: speed(), B: speed()}, link(50.0))
    assert lan is not None and lan.decode_tokens_per_second < rates["slow"]


# --- the speed-balanced pipeline split ------------------------------------------------------

ROOMY = 10**12  # bytes: memory never binds


def stage_times(card: ModelCard, speeds: list[NodeSpeed], counts: list[int]) -> list[float]:
    last = len(counts) - 1
    return [
        decode_stage_seconds(
            card, node, WeightShare(layers=n, holds_embedding=r == 0, holds_output_layer=r == last),
            DEFAULT_PROMPT_TOKENS,
        )
        for r, (node, n) in enumerate(zip(speeds, counts, strict=True))
    ]  # fmt: skip


def brute_force_bottleneck(card: ModelCard, speeds: list[NodeSpeed], room: list[int]) -> float:
    """The smallest slowest-stage time over every split (compositions of the layers)."""
    best = float("inf")

    def splits(layers: int, parts: int) -> list[list[int]]:
        if parts == 1:
            return [[layers]]
        return [[first, *rest] for first in range(1, layers - parts + 2)
                for rest in splits(layers - first, parts - 1)]  # fmt: skip

    for counts in splits(card.n_layers, len(speeds)):
        last = len(counts) - 1
        if all(
            pipeline_share_bytes(card, n, r == 0, r == last) <= room[r]
            for r, n in enumerate(counts)
        ):
            best = min(best, max(stage_times(card, speeds, counts)))
    return best


@pytest.mark.parametrize(
    ("gbps", "room"),
    [
        ((10.0, 10.0), (ROOMY, ROOMY)),
        ((10.0, 3.0), (ROOMY, ROOMY)),
        ((2.0, 10.0, 5.0), (ROOMY, ROOMY, ROOMY)),
        ((10.0, 10.0), (ROOMY, 0)),  # B holds no layer within its memory: no split
    ],
)
def test_the_speed_balanced_split_minimizes_the_slowest_stage(
    gbps: tuple[float, ...], room: tuple[int, ...]
) -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})  # an LM head worth a few layers
    speeds = [speed(int4_gbps=g) for g in gbps]
    counts = speed_balanced_split(card, speeds, list(room))
    best = brute_force_bottleneck(card, speeds, list(room))
    if best == float("inf"):
        assert counts is None
        return
    assert counts is not None and sum(counts) == card.n_layers and min(counts) >= 1
    assert max(stage_times(card, speeds, counts)) == pytest.approx(best)


def test_equal_nodes_give_the_lm_heads_rank_fewer_layers_and_a_faster_node_more() -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})
    even = speed_balanced_split(card, [speed(), speed()], [ROOMY, ROOMY])
    assert even is not None and even[0] > even[1]  # the last rank also runs the LM head
    fast_first = speed_balanced_split(card, [speed(20.0), speed(5.0)], [ROOMY, ROOMY])
    assert fast_first is not None and fast_first[0] > even[0]
    # Memory still binds: rank 0 holds at most what fits (5 layers here, fewer than the
    # unbounded split gives it).
    tight = pipeline_share_bytes(card, 5, True, False)
    capped = speed_balanced_split(card, [speed(20.0), speed(5.0)], [tight, ROOMY])
    assert fast_first[0] > 5 and capped == [5, 7]


def test_placement_balances_measured_nodes_and_splits_unmeasured_ones_by_memory() -> None:
    card = CARD.model_copy(update={"vocab_size": 32768})
    fast = make_node_info(4096).model_copy(update={"speed": speed(20.0)})
    slow = make_node_info(4096, name="b").model_copy(update={"speed": speed(5.0)})
    state = make_state(nodes={A: fast, B: slow}).model_copy(update={"topology": link()})
    previews = {(p.sharding, p.node_count): p for p in placement_previews(card, state, 128)}
    expected = speed_balanced_split(card, [speed(20.0), speed(5.0)], [ROOMY, ROOMY])
    pipeline = previews[("pipeline", 2)]
    assert expected is not None and pipeline.node_ids == (A, B)
    assert [end - start for start, end in pipeline.layer_ranges] == expected
    unmeasured = state.model_copy(
        update={"node_info": {A: fast, B: slow.model_copy(update={"speed": None})}}
    )
    previews = {(p.sharding, p.node_count): p for p in placement_previews(card, unmeasured, 128)}
    assert [end - start for start, end in previews[("pipeline", 2)].layer_ranges] == [6, 6]


# A MoE card: 12 layers, layer 0 dense, the others 16 experts of width 128, top 2, and a
# shared expert of width 128 (every width divides by 2 and fits int4).
MOE_CARD = CARD.model_copy(
    update={
        "moe": MoeGeometry(
            experts=16,
            experts_per_token=2,
            expert_intermediate_size=128,
            dense_layers=(0,),
            shared_expert_intermediate_size=128,
        )
    }
)


def test_expected_experts_read_is_the_union_of_the_rows_choices() -> None:
    moe = MOE_CARD.moe
    assert moe is not None
    assert expected_experts_read(moe, 16) == pytest.approx(2.0)  # one row: its top 2
    assert expected_experts_read(moe, 8) == pytest.approx(1.0)  # an expert rank's half
    assert expected_experts_read(moe, 16, streams=4) == pytest.approx(16 * (1 - (7 / 8) ** 4))
    assert 15.9 < expected_experts_read(moe, 16, streams=64) <= 16  # nearly every expert
    with pytest.raises(ValueError, match="streams"):
        expected_experts_read(moe, 16, streams=0)


def test_a_moe_layer_decodes_at_the_bytes_of_the_experts_a_token_reads() -> None:
    share = WeightShare(layers=12, first_layer=0)
    seconds = decode_stage_seconds(MOE_CARD, speed(), share, 512)
    dense = decoder_layer_bytes(MOE_CARD, "int4")
    held = decoder_layer_bytes(MOE_CARD, "int4", sparse=True)
    without = decoder_layer_bytes(MOE_CARD, "int4", sparse=True, experts=0)
    read = without + 2 * (held - without) / 16  # top 2 of 16 experts
    assert moe_layer_read_bytes(MOE_CARD, "int4") == pytest.approx(read)
    kv = ENGINE_KV_READ_FACTOR * 2 * 512 * kv_cache_bytes_per_token(MOE_CARD) / (20 * GB)
    norm = MOE_CARD.hidden_size * 4
    head = (output_layer_bytes(MOE_CARD, "int4", shares_embedding=False) - norm) / (8 * GB)
    overhead = 12 * 100e-6 * ENGINE_LAYER_OVERHEAD_FACTOR
    expected = (dense + 11 * read) / (10 * GB) + kv + head + overhead
    assert seconds == pytest.approx(expected, rel=1e-9)
    # Memory counts every expert; the step reads an eighth of the routed ones.
    assert decode_read_bytes(MOE_CARD, "int4", share) < 0.5 * decoder_layers_bytes(
        MOE_CARD, "int4", share
    )
    # An expert-parallel rank holding half the experts reads half as many routed ones.
    half = moe_layer_read_bytes(MOE_CARD, "int4", experts=8)
    assert half == pytest.approx(without + (held - without) / 16)


def test_moe_prefill_counts_a_tokens_top_k_and_shared_experts() -> None:
    hidden, head = MOE_CARD.hidden_size, MOE_CARD.attention_head_dim
    attention = hidden * (2 * 8 * head + 2 * 4 * head)  # 8 query and 4 KV heads
    assert active_linear_params_per_layer(MOE_CARD, sparse=True) == attention + 3 * hidden * (
        2 * 128 + 128
    )
    assert active_linear_params_per_layer(MOE_CARD, sparse=False) == attention + 3 * hidden * (
        MOE_CARD.intermediate_size
    )


def test_mxfp4_experts_are_sized_and_read_at_17_bytes_per_32_weights() -> None:
    """The engine holds MXFP4 experts (gpt-oss) as stored, 17 bytes per 32 weights, in every
    weight format, not as its int4 groups (20 per 32): memory and the bytes a decode step
    reads count them so, for a card whose geometry says so and for a GGUF storing MXFP4
    (whose other types are then averaged without it), and the rest of the layer as before."""
    assert MOE_CARD.moe is not None
    mxfp4 = MOE_CARD.model_copy(
        update={"moe": MOE_CARD.moe.model_copy(update={"mxfp4_experts": True})}
    )
    expert = 3 * MOE_CARD.hidden_size * 128  # one expert's gate, up and down weights
    int4, stored = expert * 0.625, expert * 17 / 32

    def experts_bytes(card: ModelCard, weight_format: WeightFormat = "int4") -> float:
        whole = decoder_layer_bytes(card, weight_format, sparse=True)
        return whole - decoder_layer_bytes(card, weight_format, sparse=True, experts=0)

    assert experts_bytes(MOE_CARD) == pytest.approx(16 * int4)
    assert experts_bytes(mxfp4) == pytest.approx(16 * stored, abs=1)
    assert experts_bytes(mxfp4, "float32") == pytest.approx(16 * stored, abs=1)
    without = decoder_layer_bytes(mxfp4, "int4", sparse=True, experts=0)
    assert without == decoder_layer_bytes(MOE_CARD, "int4", sparse=True, experts=0)
    assert moe_layer_read_bytes(mxfp4, "int4") == pytest.approx(without + 2 * stored, abs=1)
    share = WeightShare(layers=12, first_layer=0)
    saved = decode_stage_seconds(MOE_CARD, speed(), share, 512) - decode_stage_seconds(
        mxfp4, speed(), share, 512
    )
    assert saved == pytest.approx(11 * 2 * (int4 - stored) / (10 * GB), rel=1e-6)
    # A GGUF with Q8_0 attention and shared expert and MXFP4 experts (its geometry silent):
    # the experts at 17 / 32, the Q8_0 weights at two int4 planes' 1.25, not all at an average.
    hidden, head = MOE_CARD.hidden_size, MOE_CARD.attention_head_dim
    other = hidden * (2 * 8 * head + 2 * 4 * head) + 3 * hidden * 128  # attention, shared
    gguf = MOE_CARD.model_copy(
        update={
            "gguf_weight_types": GgufWeightTypes(
                layer_weights=(("Q8_0", 12 * other), ("MXFP4", 11 * 16 * expert)),
                output_type="Q8_0",
            )
        }
    )
    assert experts_bytes(gguf) == pytest.approx(16 * stored, abs=1)
    assert decoder_layer_bytes(gguf, "int4", sparse=True, experts=0) - decoder_layer_bytes(
        MOE_CARD, "int4", sparse=True, experts=0
    ) == pytest.approx(other * (1.25 - 0.625), abs=1)
