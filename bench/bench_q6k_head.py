"""The LM head product alone at Qwen3-30B-A3B's shape (151,936 x 2,048): the engine's int8
head (`Int8Linear`, one scale per output row, 311 MB) against the same head held as GGUF
Q6_K blocks (`Q6KLinear`, 255 MB), interleaved in one process.

Usage: PYTHONPATH=src python bench/bench_q6k_head.py [--vocab 151936] [--hidden 2048]
       [--rows 1 8] [--calls 20] [--rounds 5] [--threads 2]
       [--engine MODEL_DIR [--prompt-length 128] [--decode-tokens 32]]

The Q6_K head is random blocks (every value and scale pattern, fp16 `d` of Gaussian-sized
weights); the int8 head is `Int8Linear` of the same weights dequantized by `gguf`. Both
are far larger than any cache, so each call reads its head from memory as a decode step
does. A measurement is `--calls` products of one form at one row count (wall time, torch's
intra-op threads: `--threads`); the forms alternate measurement by measurement (the first
alternating too) for `--rounds` pairs. Prints per form and row count the median ms per
call with the spread (min-max), the median of the per-pair ratios Q6_K / int8, the bytes
each reads per call and the rate that makes, and how far each form's output is from the
float64 product (largest difference over the largest |output|, 1 row). The load average
before and after is printed: other work on the machine slows both forms. Numbers only;
nothing is asserted.

With `--engine` (a GGUF converted for exo whose head is Q6_K, e.g. `bench_moe.py`'s
`~/.cache/exo-bench-moe/qwen3-30b-a3b-shapes-10L-q4_k.exo`): the whole engine loaded once
(int4, as `bench_moe.py` loads it: the head as Q6_K blocks), then per round one greedy
request (a random prompt of `--prompt-length` tokens, `--decode-tokens` tokens) with each
head, the order alternating: the Q6_K blocks, and the int8 head the engine held before
(`Int8Linear` of the same weights dequantized), swapped in the lean forward's head; decode
tok/s (tokens after the first / time from the first to the last) per head, median and
spread.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any


def measure(head: Any, x: Any, calls: int) -> float:
    """Wall ms per call of `calls` products."""
    started = time.perf_counter()
    for _ in range(calls):
        head.matmul(x)
    return (time.perf_counter() - started) * 1000.0 / calls


def main() -> None:
    parser = argparse.ArgumentParser(
        description=" ".join(__doc__.split("\n\n")[0].split()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", type=str, default=None)
    parser.add_argument("--prompt-length", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=32)
    arguments = parser.parse_args()
    if arguments.engine is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(arguments.threads))
        engine_ab(arguments)
        return

    import numpy as np
    import torch

    from exo.testing.random_gguf import random_q6_k
    from exo.worker.engines.torch.quant.int8_channels import Int8Linear
    from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
    from exo.worker.engines.torch.quant.q6k_blocks import Q6KLinear, q6k_dequantized

    torch.set_num_threads(arguments.threads)
    if built_int4_kernel() is None:
        raise SystemExit("exo's native kernels cannot be built here")
    print(f"load average before: {os.getloadavg()}")
    vocab, hidden = arguments.vocab, arguments.hidden
    raw = random_q6_k((vocab, hidden), np.random.default_rng(0), 1.5e-5)
    q6k = Q6KLinear(torch.from_numpy(raw), None)
    dense = torch.nn.Linear(hidden, vocab, bias=False, device="meta")
    dense.weight = torch.nn.Parameter(torch.from_numpy(q6k_dequantized(raw)), requires_grad=False)
    int8 = Int8Linear(dense)
    weight = dense.weight.double()
    del dense
    forms = {"int8": int8, "q6k": q6k}
    sizes = {
        "int8": int8.weight.numel() + 2 * int8.scales.numel(),
        "q6k": q6k.blocks.numel(),
    }
    print(f"bits: {torch.ops.exo_native.int4_decode_bits()}, threads {torch.get_num_threads()}")
    x1 = torch.randn(1, hidden)
    exact = (x1.double() @ weight.T).float()
    for name, head in forms.items():
        error = (head.matmul(x1) - exact).abs().max() / exact.abs().max()
        print(f"{name}: {sizes[name] / 1e6:.1f} MB, largest error / largest |output| {error:.2e}")
    del weight, exact
    for rows in arguments.rows:
        x = torch.randn(rows, hidden)
        for head in forms.values():
            head.matmul(x)  # warm-up: buffers sized
        times: dict[str, list[float]] = {name: [] for name in forms}
        for round_index in range(arguments.rounds):
            order = list(forms) if round_index % 2 == 0 else list(reversed(forms))
            for name in order:
                times[name].append(measure(forms[name], x, arguments.calls))
        ratios = [q / i for q, i in zip(times["q6k"], times["int8"], strict=True)]
        for name, spread in times.items():
            median = statistics.median(spread)
            rate = sizes[name] / median / 1e6
            print(
                f"rows {rows} {name}: {median:.2f} ms ({min(spread):.2f}-{max(spread):.2f}), "
                f"{rate:.1f} GB/s"
            )
        print(f"rows {rows} q6k / int8: {statistics.median(ratios):.3f}")
    print(f"load average after: {os.getloadavg()}")


def engine_ab(arguments: argparse.Namespace) -> None:
    """The `--engine` case (see the module docstring)."""
    from pathlib import Path

    import torch

    from exo.benchmark.engine_runner import run_engine
    from exo.benchmark.prompts import ModelText
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.batching.batch_attention import lean_step_of
    from exo.worker.engines.torch.engine import TorchEngine
    from exo.worker.engines.torch.model.direct_forward_parts import Projection
    from exo.worker.engines.torch.quant.int8_channels import Int8Linear
    from exo.worker.engines.torch.quant.q6k_blocks import Q6KLinear

    torch.set_num_threads(arguments.threads)
    print(f"load average before: {os.getloadavg()}")
    model_dir = Path(arguments.engine).expanduser()
    card = card_from_local_directory(model_dir)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1,
        start_layer=0, end_layer=card.n_layers,
    )  # fmt: skip
    started = time.perf_counter()
    engine = TorchEngine.load(model_dir, shard, weight_dtype="int4", kv_cache_tokens=4096)
    engine.warmup()
    print(f"loaded in {time.perf_counter() - started:.0f} s", flush=True)
    head = engine.model.lm_head
    if not isinstance(head, Q6KLinear):
        raise SystemExit(f"the head is {type(head).__name__}, not Q6_K blocks")
    lean: Any = lean_step_of(engine.model)
    dense = torch.nn.Linear(head.in_features, head.out_features, bias=False, device="meta")
    dense.weight = torch.nn.Parameter(head.dequantize_float(), requires_grad=False)
    heads = {
        "q6k": Projection([head], lean.bf16),
        "int8": Projection([Int8Linear(dense)], lean.bf16),
    }
    del dense
    text = ModelText.load(model_dir)
    decode: dict[str, list[float]] = {name: [] for name in heads}
    for round_index in range(arguments.rounds):
        order = list(heads) if round_index % 2 == 0 else list(reversed(heads))
        for offset, name in enumerate(order):
            lean._head = heads[name]
            seed = 1000 * round_index + offset
            prompt = text.random_prompt(arguments.prompt_length, seed)[0]
            result = run_engine(engine, [prompt], arguments.decode_tokens, text)
            decode[name].append(result.decode_tok_s)
            print(f"round {round_index + 1} {name}: decode {result.decode_tok_s:.2f} tok/s",
                  flush=True)  # fmt: skip
    for name, spread in decode.items():
        print(f"{name}: decode {statistics.median(spread):.2f} tok/s median "
              f"({min(spread):.2f}-{max(spread):.2f})")  # fmt: skip
    ratios = [q / i for q, i in zip(decode["q6k"], decode["int8"], strict=True)]
    print(f"q6k / int8 decode, median of the rounds: {statistics.median(ratios):.3f}")
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
