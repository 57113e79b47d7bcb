"""What the speed model's tests build: synthetic node speeds, measured links between two
nodes, a 12-layer card a tensor split divides, and the decode rate and TTFT predicted for
one node or a two-node pipeline or tensor split."""

from __future__ import annotations

from exo.master.speed_prediction import DEFAULT_PROMPT_TOKENS, predict_speed
from exo.shared.types.common import NodeId
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import NodeSpeed, TopologyEdge
from exo.testing.builders import make_card

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
