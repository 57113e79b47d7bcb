"""The lean forward against transformers' forward on the serving path, A/B in one process.

Usage: PYTHONPATH=src python bench/bench_lean.py [--prompts 32 128 512] [--decode-tokens 64]
       [--rounds 3] [--weight-dtype int4] [--model MODEL_ID] [--json PATH] [--profile-steps 32]
       [--threads N]

One request at a time through the engine's batch scheduler (`submit` / `step`, what the API
serves): a random prompt of each length, then greedy decode of `--decode-tokens` tokens (a
request that hits EOS earlier counts the tokens it made). For each round and prompt length
the lean step and transformers' step run back to back (interleaved, so a loaded machine
slows both alike); printed: median decode tok/s and ms/token of each, and their ratio.

Then a torch.profiler trace of `--profile-steps` lean decode steps splits a token's time into
quantized / dense matmuls, attention (SDPA and the KV writes), norms + rotary + elementwise,
and the rest (Python and dispatch: wall time minus the ops' own time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_concurrency import random_prompt, submit_tokens

from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.engine import TorchEngine

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"

CATEGORIES = {
    "exo's decode layers (whole layers, C++)": ("exo_native::decode_layer",),
    "matmul (int4/int8 kernels, dense linear)": (
        "exo_native::int4_gemv", "exo_native::int8_block_gemv",
        "_weight_int4pack_mm", "_weight_int8pack_mm", "aten::linear", "aten::mm", "aten::addmm",
        "aten::matmul",
    ),
    "attention (SDPA, KV writes)": ("scaled_dot_product", "_flash_attention", "index_put",
                                    "aten::_efficient_attention", "aten::bmm", "softmax"),
    "norms + rotary + elementwise": (
        "rms_norm", "aten::mul", "aten::add", "index_select", "aten::silu", "aten::gelu",
        "aten::cat", "aten::to", "aten::_to_copy", "aten::copy_", "aten::embedding",
        "aten::tanh", "aten::div", "aten::neg",
    ),
}  # fmt: skip


def load_engine(model_id: str, weight_dtype: str, models_dir: Path) -> TorchEngine:
    card = load_builtin_cards()[ModelId(model_id)]
    model_dir = prepare_model(card, models_dir, offline=False)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    engine = TorchEngine.load(model_dir, shard, weight_dtype=weight_dtype)  # type: ignore[arg-type]
    engine.warmup()
    return engine


def set_lean(engine: TorchEngine, on: bool) -> None:
    lean = engine.model.__dict__.get("_exo_lean_step")
    if lean is None:
        if on:
            raise SystemExit("this model has no lean forward (see the load log)")
        return
    lean.enabled = on


def decode_rate(engine: TorchEngine, prompt: list[int], decode_tokens: int, tag: str) -> float:
    """tok/s of one request's decode (after its first token)."""
    engine.clear_prefix_cache()
    state = submit_tokens(engine, prompt, decode_tokens, tag)
    while not state.generated_ids:
        engine.step()
    first = len(state.generated_ids)
    started = time.perf_counter()
    while engine.has_work:
        engine.step()
    seconds = time.perf_counter() - started
    return (len(state.generated_ids) - first) / seconds


def profile_split(engine: TorchEngine, steps: int) -> dict[str, float]:
    """ms per decode step by category, lean forward on."""
    set_lean(engine, True)
    engine.clear_prefix_cache()
    state = submit_tokens(engine, random_prompt(engine, 128, 99), steps + 8, "profile")
    while len(state.generated_ids) < 4:
        engine.step()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as trace:
        started = time.perf_counter()
        done = 0
        while engine.has_work and done < steps:
            engine.step()
            done += 1
        wall_ms = (time.perf_counter() - started) * 1000 / max(1, done)
    while engine.has_work:
        engine.step()
    split = dict.fromkeys(CATEGORIES, 0.0)
    other_ops = 0.0
    for event in trace.key_averages():
        own_ms = event.self_cpu_time_total / 1000 / max(1, done)
        for category, names in CATEGORIES.items():
            if any(name in event.key for name in names):
                split[category] += own_ms
                break
        else:
            other_ops += own_ms
    split["other ops"] = other_ops
    split["python + dispatch (wall - ops)"] = max(0.0, wall_ms - sum(split.values()))
    split["wall per step (profiled)"] = wall_ms
    return split


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--weight-dtype", default="int4")
    parser.add_argument("--prompts", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=32)
    parser.add_argument("--models-dir", type=Path, default=default_models_dir())
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    engine = load_engine(args.model, args.weight_dtype, args.models_dir)
    if args.threads:  # after loading: the engine sets its own count
        torch.set_num_threads(args.threads)
    rates: dict[str, dict[int, list[float]]] = {
        mode: {length: [] for length in args.prompts} for mode in ("lean", "transformers")
    }
    for round_index in range(args.rounds):
        for length in args.prompts:
            prompt = random_prompt(engine, length, seed=length + round_index)
            for mode in (
                ("lean", "transformers") if round_index % 2 == 0 else ("transformers", "lean")
            ):
                set_lean(engine, mode == "lean")
                tag = f"{mode}-{length}-{round_index}"
                rates[mode][length].append(decode_rate(engine, prompt, args.decode_tokens, tag))
    set_lean(engine, True)
    result: dict[str, Any] = {"model": args.model, "weight_dtype": args.weight_dtype,
                              "threads": torch.get_num_threads(), "decode": {}}  # fmt: skip
    print(f"{args.model} {args.weight_dtype}, {torch.get_num_threads()} threads, "
          f"{args.rounds} rounds interleaved, median decode tok/s (ms/token):")  # fmt: skip
    for length in args.prompts:
        lean = statistics.median(rates["lean"][length])
        reference = statistics.median(rates["transformers"][length])
        result["decode"][length] = {"lean_tok_s": lean, "transformers_tok_s": reference,
                                    "ratio": lean / reference}  # fmt: skip
        ratio = lean / reference
        print(f"  prompt {length:4d}: lean {lean:6.1f} ({1000 / lean:5.2f} ms)  transformers "
              f"{reference:6.1f} ({1000 / reference:5.2f} ms)  x{ratio:.2f}")  # fmt: skip
    split = profile_split(engine, args.profile_steps)
    result["profile_ms_per_step"] = split
    print(f"profile of {args.profile_steps} lean decode steps (ms per step, prompt 128):")
    for category, ms in split.items():
        print(f"  {category:40s} {ms:6.2f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
