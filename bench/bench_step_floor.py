"""The engine's decode step time of tiny models, where bytes explain almost nothing, against
the prediction's (`speed_prediction.decode_stage_seconds`): what is left is the per-step
floor (scheduling, sampling over the vocabulary, the step's bookkeeping) and, for a
mixture-of-experts layer, its routing beyond a dense layer's overhead.

Usage: PYTHONPATH=src python bench/bench_step_floor.py [--layers 2 8] [--tokens 48]
       [--threads 2]

It measures the node (`measure_node_speed`), builds random Llama and Qwen3-MoE models of
SmolLM2's tokenizer with each layer count (hidden 64; the MoE: 8 experts, 2 a token), loads
them in int4, decodes one greedy stream of `--tokens` tokens after a 16-token prompt, and
prints per model the fastest decile's step time (the least disturbed by other work, as the
probe's figures are its fastest repetitions), the prediction without a floor, and their
difference; then the floor fitted over the layer counts (difference = floor + layers x
per-layer extra), in seconds and in units of the probe's `layer_overhead_seconds`
(`speed_prediction.ENGINE_STEP_OVERHEAD_LAYERS` and `ENGINE_MOE_LAYER_OVERHEAD_FACTOR`).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from exo.download.pypi_gguf import prepare_model
from exo.master import speed_prediction
from exo.node.speed_probe import measure_node_speed
from exo.shared.constants import models_dir
from exo.shared.models.cards import card_from_local_directory, load_builtin_cards
from exo.shared.models.weight_share import whole_model
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.engine import TorchEngine

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


def step_seconds(directory: Path, tokens: int) -> float:
    """The fastest decile's seconds per decode step of one greedy stream."""
    card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = TorchEngine.load(directory, shard, weight_dtype="int4")
    engine.eos_token_ids = frozenset({-1})
    params = TextGenerationTaskParams(
        model=ModelId("bench"), messages=(ChatMessage(role="user", content="count to ten"),),
        max_tokens=tokens, temperature=0.0, speculative=False,
    )  # fmt: skip
    gaps: list[float] = []
    for run in range(3):
        state = engine.build_request(params, None, f"r{run}")
        engine.scheduler.add(state)
        last = 0.0
        while engine.has_work:
            produced = engine.step()
            now = time.perf_counter()
            if produced and last and state.generated_ids:
                gaps.append(now - last)
            last = now
        engine.store_finished()
        engine.clear_prefix_cache()
    return sorted(gaps)[len(gaps) // 10]


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    speed = measure_node_speed(args.threads)
    overhead = speed.layer_overhead_seconds
    print(f"probe: layer overhead {overhead * 1e6:.1f} us")
    tokenizer = prepare_model(load_builtin_cards()[DEFAULT_MODEL], models_dir(), offline=True)
    floors: dict[str, list[tuple[int, float]]] = {"llama": [], "qwen3_moe": []}
    with tempfile.TemporaryDirectory() as root:
        for family in floors:
            for layers in args.layers:
                directory = save_tiny_model(
                    Path(root) / f"{family}-{layers}", family, tokenizer, n_layers=layers,
                    tie_word_embeddings=False,
                )  # fmt: skip
                card = card_from_local_directory(directory)
                predicted = speed_prediction.decode_stage_seconds(
                    card, speed, whole_model(card), 16 + args.tokens // 2
                )
                measured = step_seconds(directory, args.tokens)
                floors[family].append((layers, measured - predicted))
                print(
                    f"{family} {layers} layers: measured {measured * 1e3:.2f} ms/step, "
                    f"predicted {predicted * 1e3:.2f}, left {(measured - predicted) * 1e3:.2f}"
                )
    fits = {}
    for family, points in floors.items():
        (few, left_few), (many, left_many) = points[0], points[-1]
        per_layer = (left_many - left_few) / (many - few)
        fits[family] = (left_few - few * per_layer, per_layer)
        print(
            f"{family}: floor {fits[family][0] * 1e3:.2f} ms "
            f"({fits[family][0] / overhead:.0f} layer overheads), per layer beyond the "
            f"prediction {per_layer * 1e6:.0f} us ({per_layer / overhead:.1f} overheads)"
        )
    moe_extra = fits["qwen3_moe"][1] - fits["llama"][1]
    print(f"MoE routing per layer beyond a dense layer: {moe_extra / overhead:.1f} overheads")


if __name__ == "__main__":
    main()
