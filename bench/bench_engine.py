"""Prefill and decode speed of the torch engine on the default model.

Usage: PYTHONPATH=src python bench/bench_engine.py [--runs 5] [--decode-tokens 64]
       [--prompt-tokens 32 128 512] [--models-dir DIR] [--device cpu]
       [--weight-dtype default float32 int8 int4] [--threads N]

Prefill tok/s = prompt tokens / time to the first sampled token (prefill forward only).
Decode tok/s = generated tokens after the first / time spent generating them (greedy,
EOS ignored so every run decodes the same number of tokens). Each figure is the median of
`--runs` runs, after one warm-up generation. Several `--weight-dtype`s are loaded side by
side and measured interleaved (run by run), so background load affects them alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import PipelineShardMetadata
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.quantize import WEIGHT_DTYPES, WeightDtype

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


def measure(engine: TorchEngine, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """One run: (prefill tok/s, decode tok/s) for a random prompt of `prompt_tokens`."""
    generator = torch.Generator().manual_seed(prompt_tokens)
    vocab = engine.card.vocab_size
    prompt = torch.randint(100, vocab - 100, (prompt_tokens,), generator=generator).tolist()
    session = engine._cache_pool.open(prompt_tokens + decode_tokens + 1)
    try:
        started = time.perf_counter()
        logits = session.prefill(prompt)
        token = int(torch.argmax(logits))
        prefill_seconds = time.perf_counter() - started
        started = time.perf_counter()
        for _ in range(decode_tokens):
            token = int(torch.argmax(session.decode(token)))
        decode_seconds = time.perf_counter() - started
    finally:
        session.close()
    return prompt_tokens / prefill_seconds, decode_tokens / decode_seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--weight-dtype",
        nargs="+",
        default=["default"],
        choices=["default", *WEIGHT_DTYPES],
        help="engine weight formats to compare (default: the engine's default)",
    )
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    arguments = parser.parse_args()

    card = load_builtin_cards()[DEFAULT_MODEL]
    model_dir = prepare_model(
        card,
        arguments.models_dir or default_models_dir(),
        offline=False,
        on_progress=lambda message: print(message, file=sys.stderr),
    )
    shard = PipelineShardMetadata(
        model_card=card, device_rank=0, world_size=1, start_layer=0, end_layer=card.n_layers
    )
    engines: dict[str, TorchEngine] = {}
    for name in arguments.weight_dtype:
        weight_dtype: WeightDtype | None = None if name == "default" else name
        started = time.perf_counter()
        engine = TorchEngine.load(
            model_dir, shard, device=arguments.device, weight_dtype=weight_dtype
        )
        load_seconds = time.perf_counter() - started
        if arguments.threads is not None:
            torch.set_num_threads(arguments.threads)
        started = time.perf_counter()
        engine.warmup()
        warmup_seconds = time.perf_counter() - started
        label = f"{name} ({engine.weight_dtype})" if name == "default" else name
        engines[label] = engine
        print(
            f"model {card.model_id} on {arguments.device}, weights {label}, "
            f"{torch.get_num_threads()} threads; load {load_seconds:.2f} s, "
            f"warmup {warmup_seconds:.2f} s"
        )
    print(
        f"{'weights':>18} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13}  (median of "
        f"{arguments.runs}; decode {arguments.decode_tokens} tokens)"
    )
    for prompt_tokens in arguments.prompt_tokens:
        results: dict[str, list[tuple[float, float]]] = {label: [] for label in engines}
        for _ in range(arguments.runs):
            for label, engine in engines.items():
                results[label].append(measure(engine, prompt_tokens, arguments.decode_tokens))
        for label, runs in results.items():
            prefill = statistics.median(result[0] for result in runs)
            decode = statistics.median(result[1] for result in runs)
            print(f"{label:>18} {prompt_tokens:>7} {prefill:>14.1f} {decode:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
