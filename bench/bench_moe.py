"""MoE decode and prefill: exo's engine against llama.cpp on the same GGUF, random weights at
the layer shapes of Qwen3-30B-A3B (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
width 768, top 8, vocabulary 151,936; 48 layers) and gpt-oss-20b (hidden 2880, 64 query /
8 KV heads of 64, 32 experts of width 2880, top 4, even layers sliding (window 128) and odd
ones full, attention sinks, vocabulary 201,088; 24 layers), as many layers of each as fit
beside llama.cpp in `--memory-budget-gib` and in the memory free now (at most `--layers`);
then expert ×2 on two pinned 1-core nodes against one pinned node (`bench_moe_expert.py`).

Usage: PYTHONPATH=src python bench/bench_moe.py [--models qwen3-30b-a3b gpt-oss-20b]
       [--layers 48] [--memory-budget-gib 10] [--threads 2] [--prompt-lengths 128 512]
       [--decode-tokens 32] [--rounds 2] [--expert-streams 4] [--no-expert-case]
       [--cache-dir DIR] [--json OUT.json]

Each model's GGUF is written once under `--cache-dir` and converted once for exo
(`exo.download.gguf_repack.convert_gguf`); both are reused by later runs (the largest cached
one that fits, if it has at least 80 % of the layers that fit). Qwen3-30B-A3B's
(`exo.testing.random_moe_gguf`): Q4_K random blocks, F32 router and norms, a Q6_K LM head,
as llama.cpp's Q4_K_M of the model; exo repacks each expert's Q4_K blocks as int4 groups.
gpt-oss-20b's
(`exo.testing.random_gptoss_gguf.write_random_block_gptoss_gguf`, llama.cpp's `gpt-oss`
layout): MXFP4 experts (GGML type 39) with F32 biases, Q8_0 attention, embedding and head,
F32 norms, sinks and biased router; exo holds the experts as the MXFP4 blocks they are and
the Q8_0 linears as int8 blocks. Each round runs, for each prompt length, one request in
exo's engine (in-process `submit` / `step`, `exo.benchmark.engine_runner`) and one in
llama.cpp (llama-cpp-python, `exo.benchmark.llama_cpp_runner`), alternating which goes
first, with the same thread count: prefill tok/s (prompt tokens / time to the first token)
and decode tok/s (tokens after the first / time from the first to the last), the median and
the best over the rounds (on a shared machine the best is the least disturbed). Then the
bytes a decoded token reads (every layer's attention, router and norms, its top-k experts,
the LM head and one embedding row; exo's as the engine holds them, the GGUF's for
llama.cpp) and the tok/s the measured memory bandwidth allows (copy bandwidth, bytes read
plus written, `exo.node.speed_measurements.memory_copy_bytes_per_second`, the faster of a
measurement before loading and one after the runs). Each model's engines are closed before
the next model loads; the expert case runs last, on the last model of `--models`.
Without llama-cpp-python, exo's side runs and the report says llama.cpp is missing.
The load average before and after is printed: other work on the machine slows both sides.
Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

GIB = 1 << 30
BANDWIDTH_BYTES = 512 * 1024 * 1024
# Beside the weights: Python, torch, the tokenizer, llama.cpp's compute buffers and both
# engines' KV caches of `CONTEXT_TOKENS`.
RUNTIME_BYTES = 1 * GIB
# Left to the rest of the machine out of the memory available when the layers are chosen.
MACHINE_MARGIN_BYTES = 1 * GIB
CONTEXT_TOKENS = 2048
# The least share of the layers that fit now with which a cached GGUF is reused.
CACHED_LAYERS_KEPT = 0.8


@dataclasses.dataclass(frozen=True)
class BenchModel:
    """One model's shape and its random GGUF: `layer_bytes` (GGUF bytes, exo's held bytes)
    of one decoder layer; `fixed_bytes` the same for the embedding and LM head (exo holds
    the embedding in float32 and the head in int8 blocks); layers are chosen in multiples
    of `layer_step` (gpt-oss's sliding / full pairs); `write(path, shape, progress)`
    writes the GGUF."""

    name: str
    slug: str
    suffix: str
    shape: Any
    layer_bytes: tuple[int, int]
    fixed_bytes: tuple[int, int]
    layer_step: int
    write: Callable[[Path, Any, Callable[[int, int], None]], object]

    def cache_name(self, layers: int) -> str:
        return f"{self.slug}-{layers}L-{self.suffix}.gguf"

    def cached_layers(self, cache_dir: Path) -> list[int]:
        pattern = re.compile(rf"{re.escape(self.slug)}-(\d+)L-{re.escape(self.suffix)}\.gguf")
        found = (pattern.fullmatch(path.name) for path in cache_dir.glob("*.gguf"))
        return sorted(int(match.group(1)) for match in found if match)


def _int8_block_bytes(weights: int, zero: bool = False) -> int:
    """exo's int8 blocks: the values and a bfloat16 scale per 32 (LM heads), and a
    bfloat16 zero beside it (`zero`: the decoder layers' Q8_0 linears)."""
    return weights + weights // 32 * (4 if zero else 2)


def _attention_weights(shape: Any) -> int:
    heads = 2 * shape.num_attention_heads + 2 * shape.num_key_value_heads
    return shape.hidden_size * shape.head_dim * heads


def qwen3_30b_a3b() -> BenchModel:
    """Qwen3-30B-A3B in Q4_K: 144 bytes per 256 weights (Q6_K head: 210); exo's int4 groups
    0.5 byte per weight plus a bfloat16 scale and zero per 32."""
    from exo.testing.random_moe_gguf import QWEN3_30B_A3B, write_random_moe_gguf

    shape = QWEN3_30B_A3B
    weights = _attention_weights(shape) + (
        3 * shape.experts * shape.expert_intermediate_size * shape.hidden_size
    )
    vocabulary = shape.vocab_size * shape.hidden_size
    return BenchModel(
        name="Qwen3-30B-A3B", slug="qwen3-30b-a3b-shapes", suffix="q4_k", shape=shape,
        layer_bytes=(weights * 144 // 256, weights * 5 // 8),
        fixed_bytes=(vocabulary * (144 + 210) // 256,
                     vocabulary * 4 + _int8_block_bytes(vocabulary)),
        layer_step=1,
        write=lambda path, shape, progress: write_random_moe_gguf(
            path, shape, "Q4_K", seed=0, on_tensor=progress
        ),
    )  # fmt: skip


def gpt_oss_20b() -> BenchModel:
    """gpt-oss-20b: MXFP4 17 bytes per 32 weights in both engines, the experts' biases
    float32; Q8_0 34 bytes per 32 in the GGUF, int8 blocks in exo."""
    from exo.testing.random_gptoss_gguf import GPT_OSS_20B, write_random_block_gptoss_gguf

    shape = GPT_OSS_20B
    hidden, width, experts = shape.hidden_size, shape.intermediate_size, shape.experts
    attention = _attention_weights(shape)
    expert_bytes = 3 * experts * width * hidden * 17 // 32 + experts * (2 * width + hidden) * 4
    vocabulary = shape.vocab_size * hidden
    return BenchModel(
        name="gpt-oss-20b", slug="gpt-oss-20b-shapes", suffix="mxfp4", shape=shape,
        layer_bytes=(attention * 34 // 32 + expert_bytes,
                     _int8_block_bytes(attention, zero=True) + expert_bytes),
        fixed_bytes=(vocabulary * 2 * 34 // 32,
                     vocabulary * 4 + _int8_block_bytes(vocabulary)),
        layer_step=2,
        write=lambda path, shape, progress: write_random_block_gptoss_gguf(
            path, shape, seed=0, on_tensor=progress
        ),
    )  # fmt: skip


MODELS: dict[str, Callable[[], BenchModel]] = {
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "gpt-oss-20b": gpt_oss_20b,
}


def choose_layers(model: BenchModel, most: int, budget_bytes: int) -> int:
    """The most layers (≤ `most`, a multiple of the model's `layer_step`, at least one
    step) whose GGUF (llama.cpp maps it) and exo's copy, with both embeddings and heads and
    `RUNTIME_BYTES`, fit in `budget_bytes` and in the memory available now less
    `MACHINE_MARGIN_BYTES`."""
    import psutil

    available = psutil.virtual_memory().available - MACHINE_MARGIN_BYTES
    room = min(budget_bytes, available) - sum(model.fixed_bytes) - RUNTIME_BYTES
    layers = min(most, max(0, room) // sum(model.layer_bytes))
    return max(model.layer_step, layers - layers % model.layer_step)


def _cached_gguf(cache_dir: Path, model: BenchModel, shape: Any) -> Path:
    path = cache_dir / model.cache_name(shape.n_layers)
    if path.is_file():
        return path
    partial = path.with_name(path.name + ".partial.gguf")
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done % 50 == 0 or done == total:
            print(f"  writing the GGUF: {done}/{total} tensors", flush=True)

    model.write(partial, shape, progress)
    partial.rename(path)
    seconds = time.perf_counter() - started
    print(f"wrote {path} ({path.stat().st_size / GIB:.2f} GiB) in {seconds:.0f} s")
    return path


def _cached_conversion(gguf_path: Path) -> Path:
    from exo.download.gguf_repack import convert_gguf

    target = gguf_path.with_suffix(".exo")
    if (target / "config.json").is_file():
        return target
    partial = gguf_path.with_suffix(".exo.partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    conversion = convert_gguf(gguf_path, partial)
    partial.rename(target)
    size = conversion.bytes_on_disk / GIB
    print(f"converted for exo in {conversion.seconds:.0f} s ({size:.2f} GiB)")
    return target


def _module_bytes(module: Any) -> int:
    tensors = [*module.parameters(), *module.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def exo_bytes_per_token(model: Any, experts_per_token: int) -> int:
    """Bytes one decoded token reads in exo's engine: each layer but its experts, `k /
    experts` of its experts' bytes, the LM head and one (float32) embedding row."""
    total = 0
    for layer in model.model.layers:
        experts = layer.mlp.experts
        expert_bytes = _module_bytes(experts)
        total += _module_bytes(layer) - expert_bytes
        total += expert_bytes * experts_per_token // experts.total
    embedding = model.model.embed_tokens.weight
    return total + _module_bytes(model.lm_head) + embedding.shape[1] * embedding.element_size()


def gguf_bytes_per_token(gguf_path: Path, experts: int, experts_per_token: int) -> int:
    """Bytes one decoded token reads from the GGUF in llama.cpp: every tensor but the
    embedding, `k / experts` of each stacked expert tensor, and one embedding row."""
    from exo.download.gguf_tensors import read_gguf_model

    total = 0
    for tensor in read_gguf_model(gguf_path).tensors:
        if tensor.name == "token_embd.weight":
            total += tensor.data.nbytes // tensor.shape[1]
        elif "_exps." in tensor.name:
            total += tensor.data.nbytes * experts_per_token // experts
        else:
            total += tensor.data.nbytes
    return total


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def exo_names(args: argparse.Namespace) -> dict[str, str]:
    """The exo cases' names (as the table prints them) → their `--decode-activations`:
    "exo" alone where one value was asked for, else "exo int16", "exo int8"."""
    values: list[str] = args.decode_activations
    if len(values) == 1:
        return {"exo": values[0]}
    return {f"exo {value}": value for value in values}


def _run_rounds(engine: Any, llama: Any, model_text: Any, args: argparse.Namespace) -> dict:
    """Both engines, interleaved: engine name → prompt length → prefill / decode tok/s."""
    from exo.benchmark.engine_runner import run_engine
    from exo.worker.engines.torch.quant.native_kernels import set_decode_activations

    def exo_run(activations: str, prompt: str) -> Any:
        set_decode_activations(activations)  # type: ignore[arg-type]
        return run_engine(engine, [prompt], args.decode_tokens, model_text)

    names = exo_names(args)
    results: dict[str, dict[int, dict[str, list[float]]]] = {name: {} for name in names}
    results["llama.cpp"] = {}
    for round_index in range(args.rounds):
        for length in args.prompt_lengths:
            seed = 1000 * round_index + length
            prompt = model_text.random_prompt(length, seed)[0]
            prompt_ids = model_text.random_token_ids(length, seed)
            # Each exo case its own prompt: the same one would hit the first's prefix cache.
            prompts = [prompt] + [
                model_text.random_prompt(length, seed + 500_000 * index)[0]
                for index in range(1, len(names))
            ]
            runs: list[tuple[str, Any]] = [
                (name, functools.partial(exo_run, activations, case_prompt))
                for (name, activations), case_prompt in zip(names.items(), prompts, strict=True)
            ]
            if llama is not None:
                runs.append(
                    ("llama.cpp", functools.partial(llama.run, prompt_ids, args.decode_tokens))
                )
            if round_index % 2:
                runs.reverse()
            for name, run in runs:
                try:
                    result = run()
                except RuntimeError as error:  # llama.cpp's "llama_decode returned -1"
                    print(f"  round {round_index + 1} prompt {length:4d} {name}: failed: {error}")
                    continue
                figures = results[name].setdefault(length, {"prefill": [], "decode": []})
                figures["prefill"].append(result.prefill_tok_s)
                figures["decode"].append(result.decode_tok_s)
                print(
                    f"  round {round_index + 1} prompt {length:4d} {name:9s}: prefill "
                    f"{result.prefill_tok_s:7.1f} tok/s, decode {result.decode_tok_s:6.2f} tok/s",
                    flush=True,
                )
    return results


def _print_table(
    results: dict, lengths: list[int], bytes_per_token: dict[str, int], bandwidth: float
) -> list[dict[str, Any]]:
    """The median and best of each case, their share of the bandwidth bound, and exo's
    ratios to llama.cpp; returns the cases for the JSON summary."""
    cases: list[dict[str, Any]] = []
    print("median and best (fastest run: the least disturbed by other work) over the rounds")
    header = f"{'prompt':>6} {'engine':9} {'prefill tok/s':>15} {'decode tok/s':>15}"
    print(f"{header} {'of bound (best)':>15}")
    for length in lengths:
        for name, read in bytes_per_token.items():
            measured = results[name].get(length)
            if measured is None:
                continue
            prefill, decode = _median(measured["prefill"]), _median(measured["decode"])
            best_prefill, best_decode = max(measured["prefill"]), max(measured["decode"])
            share = best_decode * read / bandwidth
            print(
                f"{length:6d} {name:9} {prefill:7.1f} {best_prefill:7.1f} {decode:7.2f} "
                f"{best_decode:7.2f} {share:15.0%}"
            )
            cases.append(
                {"engine": name, "prompt_tokens": length, "prefill_tok_s": prefill,
                 "decode_tok_s": decode, "best_prefill_tok_s": best_prefill,
                 "best_decode_tok_s": best_decode, "best_bound_share": share,
                 "runs": measured}
            )  # fmt: skip
        for name in bytes_per_token:
            if name == "llama.cpp" or not (
                results["llama.cpp"].get(length) and results[name].get(length)
            ):
                continue
            ours, theirs = results[name][length], results["llama.cpp"][length]
            print(
                f"{'':6} {name} / llama.cpp, median (best): prefill "
                f"{_median(ours['prefill']) / _median(theirs['prefill']):.2f}x "
                f"({max(ours['prefill']) / max(theirs['prefill']):.2f}x), decode "
                f"{_median(ours['decode']) / _median(theirs['decode']):.2f}x "
                f"({max(ours['decode']) / max(theirs['decode']):.2f}x)"
            )
    return cases


def bench_model(model: BenchModel, args: argparse.Namespace) -> tuple[dict[str, Any], Path]:
    """Write (or reuse) the model's GGUF and exo's conversion, run both engines interleaved
    and print the figures; returns the JSON summary and exo's model directory."""
    from exo.benchmark.llama_cpp_runner import LlamaCppMissingError, LlamaCppRunner
    from exo.benchmark.prompts import ModelText
    from exo.node.speed_measurements import memory_copy_bytes_per_second
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine import TorchEngine

    print(f"\n== {model.name} ==\nload average before: {os.getloadavg()}", flush=True)
    bandwidths = [memory_copy_bytes_per_second(BANDWIDTH_BYTES)]
    most = min(args.layers, model.shape.n_layers)
    fitting = choose_layers(model, most, int(args.memory_budget_gib * GIB))
    # A cached GGUF is reused when it has at least CACHED_LAYERS_KEPT of the layers that fit
    # (the memory free moves a little between runs; each new size writes GiBs), else the
    # size that fits is written: a small cached one must not stand in for `--layers 18`.
    cached = [
        count
        for count in model.cached_layers(args.cache_dir)
        if CACHED_LAYERS_KEPT * fitting <= count <= fitting
    ]
    layers = max(cached, default=fitting)
    shape = dataclasses.replace(model.shape, n_layers=layers)
    gguf_layer, exo_layer = model.layer_bytes
    planned = (sum(model.fixed_bytes) + layers * (gguf_layer + exo_layer)) / GIB
    print(
        f"{layers} of {model.name}'s {model.shape.n_layers} layers (fit now: {fitting}; "
        f"--layers {args.layers}; GGUF + exo weights {planned:.1f} GiB, budget "
        f"{args.memory_budget_gib} GiB)"
    )
    gguf_path = _cached_gguf(args.cache_dir, model, shape)
    model_dir = _cached_conversion(gguf_path)

    # llama.cpp first: it loads in seconds, or says at once why not.
    llama: LlamaCppRunner | None = None
    llama_missing = ""
    try:
        started = time.perf_counter()
        llama = LlamaCppRunner(gguf_path, args.threads, CONTEXT_TOKENS)
        print(f"llama.cpp loaded in {time.perf_counter() - started:.0f} s")
    except LlamaCppMissingError as error:
        llama_missing = str(error)
        print(f"llama.cpp is missing: {error}")
    except ValueError as error:  # the binding's "Failed to load model"
        llama_missing = f"llama.cpp could not load {gguf_path}: {error}"
        print(llama_missing)
    card = card_from_local_directory(model_dir)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1,
        start_layer=0, end_layer=card.n_layers,
    )  # fmt: skip
    started = time.perf_counter()
    engine = TorchEngine.load(
        model_dir, shard, weight_dtype="int4", kv_cache_tokens=CONTEXT_TOKENS,
        prefill_activations=args.prefill_activations,
    )  # fmt: skip
    engine.warmup()
    print(f"exo loaded in {time.perf_counter() - started:.0f} s", flush=True)
    results = _run_rounds(engine, llama, ModelText.load(model_dir), args)

    bandwidths.append(memory_copy_bytes_per_second(BANDWIDTH_BYTES))
    bandwidth = max(bandwidths)  # the least disturbed of the two
    exo_bytes = exo_bytes_per_token(engine.model, shape.experts_per_token)
    gguf_bytes = gguf_bytes_per_token(gguf_path, shape.experts, shape.experts_per_token)
    load_after = os.getloadavg()
    print(f"\n{model.name}: layers {layers}, threads {args.threads}, decode tokens "
          f"{args.decode_tokens}")  # fmt: skip
    print(
        "memory copy bandwidth (read + write), before and after: "
        + ", ".join(f"{value / 1e9:.2f}" for value in bandwidths)
        + f" GB/s; the bound uses {bandwidth / 1e9:.2f}"
    )
    print(
        f"bytes per decoded token: exo {exo_bytes / 1e6:.1f} MB (bound "
        f"{bandwidth / exo_bytes:.2f} tok/s), llama.cpp {gguf_bytes / 1e6:.1f} MB (bound "
        f"{bandwidth / gguf_bytes:.2f} tok/s)"
    )
    read = {name: exo_bytes for name in exo_names(args)} | {"llama.cpp": gguf_bytes}
    cases = _print_table(results, args.prompt_lengths, read, bandwidth)
    if llama_missing:
        print(f"llama.cpp: missing ({llama_missing})")
    print(f"load average after: {load_after}", flush=True)
    if llama is not None:
        llama.close()
    del engine
    gc.collect()
    summary = {
        "model": model.name, "layers": layers, "threads": args.threads,
        "prefill_activations": args.prefill_activations,
        "decode_activations": args.decode_activations,
        "decode_tokens": args.decode_tokens, "rounds": args.rounds,
        "bandwidth_bytes_per_s": bandwidths, "exo_bytes_per_token": exo_bytes,
        "gguf_bytes_per_token": gguf_bytes, "llama_cpp_missing": llama_missing or None,
        "load_average_after": load_after, "cases": cases,
    }  # fmt: skip
    return summary, model_dir


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument(
        "--models",
        nargs="+",
        choices=tuple(MODELS),
        default=list(MODELS),
        help="the model shapes to measure, in this order (default: both)",
    )
    parser.add_argument("--layers", type=int, default=48, help="at most this many layers")
    parser.add_argument(
        "--memory-budget-gib",
        type=float,
        default=10.0,
        help="exo and llama.cpp together, weights and runtime",
    )
    parser.add_argument(
        "--threads", type=int, default=2, help="CPU threads of exo's engine and of llama.cpp alike"
    )
    parser.add_argument(
        "--prompt-lengths",
        type=int,
        nargs="+",
        default=[128, 512],
        help="prompt lengths in tokens; one request of each per round",
    )
    parser.add_argument(
        "--decode-tokens", type=int, default=32, help="tokens generated per request"
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="rounds of exo / llama.cpp pairs, the order alternating",
    )
    parser.add_argument(
        "--expert-streams",
        type=int,
        default=4,
        help="concurrent requests of the expert x2 against one node case",
    )
    parser.add_argument(
        "--no-expert-case",
        action="store_true",
        help="skip the expert x2 on two pinned 1-core nodes case",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path.home() / ".cache" / "exo-bench-moe",
        help="where the random GGUFs and their conversions are kept and reused",
    )
    parser.add_argument(
        "--prefill-activations",
        choices=("int16", "int8", "bf16"),
        default="int16",
        help="how exo rounds a prompt's activations for its integer products (the node's "
        "--prefill-activations; int16 is the default, int8 multiplies as llama.cpp does)",
    )
    parser.add_argument(
        "--decode-activations",
        nargs="+",
        choices=("int16", "int8"),
        default=["int16"],
        help="how exo rounds int4 products' activations (the node's --decode-activations); "
        "several values: each an exo case of its own, interleaved in every round on one "
        "loaded engine (the setting changes no weight)",
    )
    parser.add_argument("--json", type=Path,
                        help="also write the figures as JSON to this file")  # fmt: skip
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    torch.set_num_threads(args.threads)
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    print(
        f"CPUs: {os.cpu_count()}, threads: {args.threads}, "
        f"exo prefill activations: {args.prefill_activations}, decode activations: "
        f"{' '.join(args.decode_activations)}"
    )
    summaries = []
    model_dir: Path | None = None
    for key in args.models:
        summary, model_dir = bench_model(MODELS[key](), args)
        summaries.append(summary)
    expert: dict[str, Any] | None = None
    if not args.no_expert_case and model_dir is not None:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_moe_expert import run_pinned_expert_case

        print()
        expert = run_pinned_expert_case(
            model_dir,
            {"streams": args.expert_streams, "prompt_tokens": min(args.prompt_lengths),
             "decode_tokens": args.decode_tokens, "rounds": args.rounds},
        )  # fmt: skip
        print(f"load average after: {os.getloadavg()}")
    if args.json is not None:
        args.json.write_text(json.dumps({"models": summaries, "expert_x2": expert}, indent=2))


if __name__ == "__main__":
    main()
