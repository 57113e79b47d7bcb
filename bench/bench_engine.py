"""Prefill and decode speed of the torch engine on the default model.

Usage: PYTHONPATH=src python bench/bench_engine.py [--runs 5] [--decode-tokens 64]
       [--prompt-tokens 32 128 512] [--models-dir DIR] [--device cpu]

Prefill tok/s = prompt tokens / time to the first sampled token (prefill forward only).
Decode tok/s = generated tokens after the first / time spent generating them (greedy,
EOS ignored so every run decodes the same number of tokens). Each figure is the median of
`--runs` runs, after one warm-up generation.
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
    started = time.perf_counter()
    engine = TorchEngine.load(model_dir, shard, device=arguments.device)
    load_seconds = time.perf_counter() - started
    started = time.perf_counter()
    engine.warmup()
    warmup_seconds = time.perf_counter() - started
    print(
        f"model {card.model_id} on {arguments.device}, {torch.get_num_threads()} threads; "
        f"load {load_seconds:.2f} s, warmup {warmup_seconds:.2f} s"
    )
    print(
        f"{'prompt':>8} {'prefill tok/s':>14} {'decode tok/s':>13}  (median of "
        f"{arguments.runs}; decode {arguments.decode_tokens} tokens)"
    )
    for prompt_tokens in arguments.prompt_tokens:
        results = [
            measure(engine, prompt_tokens, arguments.decode_tokens) for _ in range(arguments.runs)
        ]
        prefill = statistics.median(result[0] for result in results)
        decode = statistics.median(result[1] for result in results)
        print(f"{prompt_tokens:>8} {prefill:>14.1f} {decode:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
