"""The speed model on synthetic nodes, decode: what moves the prediction (memory speed,
overhead, prompt length, hops, tensor all-reduces, stored weight types, loopback links) and
when there is none. Prefill (TTFT) is `test_speed_prediction_prefill.py`, mixture-of-experts
layers `test_speed_prediction_moe.py`, the speed-balanced split
`test_speed_balanced_split.py`."""

from __future__ import annotations

import pytest

from exo.master.placement import placement_previews
from exo.master.speed_prediction import ENGINE_KV_READ_FACTOR, decode_stage_seconds, predict_speed
from exo.master.tests.speed_builders import CARD, GB, A, B, link, single, speed, two
from exo.shared.models.kv_cache_memory import kv_cache_bytes_per_token
from exo.shared.models.memory import (
    decoder_layer_bytes,
    decoder_layer_bytes_by_kernel,
    output_layer_bytes,
)
from exo.shared.models.weight_share import WeightShare
from exo.shared.types.models import GgufWeightTypes, ModelCard
from exo.testing.builders import make_node_info, make_state


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
