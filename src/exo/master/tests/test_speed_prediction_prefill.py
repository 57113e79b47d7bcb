"""The speed model on synthetic nodes, prefill: the TTFT predicted from each node's measured
prefill GEMM figures for the activation rounding it publishes (int8, int16, bf16)."""

from __future__ import annotations

import pytest

from exo.master.placement import placement_previews
from exo.master.speed_prediction import ENGINE_PREFILL_FACTOR_ACTIVATIONS, predict_speed
from exo.master.tests.speed_builders import CARD, A, speed
from exo.shared.models.weight_formats import (
    DEFAULT_PREFILL_ACTIVATIONS,
    PREFILL_ACTIVATIONS,
    PrefillActivations,
)
from exo.shared.types.models import GgufWeightTypes, ModelCard
from exo.shared.types.nodes import NodeSpeed
from exo.testing.builders import make_node_info, make_state


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
