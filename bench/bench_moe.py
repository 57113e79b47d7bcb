"""MoE decode and prefill: exo's engine against llama.cpp on the same GGUF, random weights at
Qwen3-30B-A3B's layer shapes (hidden 2048, 32 query / 4 KV heads of 128, 128 experts of
width 768, top 8, vocabulary 151,936), as many of its 48 layers as fit in this machine's
free memory beside llama.cpp (at most `--layers`).

Usage: PYTHONPATH=src python bench/bench_moe.py [--layers 25] [--threads 2]
       [--prompt-lengths 128 512] [--decode-tokens 32] [--rounds 2] [--cache-dir DIR]
       [--json OUT.json]

The GGUF (`exo.testing.random_moe_gguf`: Q4_K random blocks, F32 router and norms, Q6_K LM
head, as llama.cpp's Q4_K_M of the model) is written once under `--cache-dir` and converted
once for exo (`exo.download.gguf_repack.convert_gguf`: each expert's Q4_K blocks as int4
groups); both are reused by later runs. Each round runs, for each prompt length, one request
in exo's engine (in-process `submit` / `step`, `exo.benchmark.engine_runner`) and one in
llama.cpp (llama-cpp-python, `exo.benchmark.llama_cpp_runner`), alternating which goes first,
with the same thread count: prefill tok/s (prompt tokens / time to the first token) and
decode tok/s (tokens after the first / time from the first to the last), the median and the
best over the rounds (on a shared machine the best is the least disturbed). Then the bytes
a decoded token reads (every layer's attention, router and norms, its top-k experts, the LM
head and one embedding row; exo's as the engine holds them, the GGUF's for llama.cpp) and
the tok/s the measured memory bandwidth allows (copy bandwidth, bytes read plus written,
`exo.node.speed_measurements.memory_copy_bytes_per_second`, the faster of a measurement
before loading and one after the runs).
Without llama-cpp-python, exo's side runs and the report says llama.cpp is missing.
The load average before and after is printed: other work on the machine slows both sides.
Numbers only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

GIB = 1 << 30
MAX_LAYERS = 48
# Beside the layers: exo's float32 embedding and int8 LM head, llama.cpp's embedding and
# head, Python, torch and the tokenizer, plus room for the rest of the machine.
FIXED_BYTES = 6 * GIB
BANDWIDTH_BYTES = 512 * 1024 * 1024


def _layer_bytes(shape: Any) -> tuple[int, int]:
    """(GGUF Q4_K bytes, exo int4 bytes) of one decoder layer: Q4_K is 144 bytes per 256
    weights; exo's int4 groups 0.5 byte per weight plus a bfloat16 scale and zero per 32."""
    hidden, width = shape.hidden_size, shape.expert_intermediate_size
    attention = (
        hidden * shape.head_dim * (2 * shape.num_attention_heads + 2 * shape.num_key_value_heads)
    )
    weights = attention + 3 * shape.experts * width * hidden
    return weights * 144 // 256, weights * 5 // 8


def choose_layers(shape: Any, most: int) -> int:
    """The most layers (≤ `most`) whose GGUF (llama.cpp maps it) and exo's int4 copy fit in
    the memory available now, less `FIXED_BYTES`."""
    import psutil

    available = psutil.virtual_memory().available - FIXED_BYTES
    gguf_bytes, exo_bytes = _layer_bytes(shape)
    return max(1, min(most, available // (gguf_bytes + exo_bytes)))


def _cached_gguf(cache_dir: Path, shape: Any) -> Path:
    from exo.testing.random_moe_gguf import write_random_moe_gguf

    path = cache_dir / f"qwen3-30b-a3b-shapes-{shape.n_layers}L-q4_k.gguf"
    if path.is_file():
        return path
    partial = path.with_name(path.name + ".partial.gguf")
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if done % 50 == 0 or done == total:
            print(f"  writing the GGUF: {done}/{total} tensors", flush=True)

    write_random_moe_gguf(partial, shape, "Q4_K", seed=0, on_tensor=progress)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=25, help="at most this many layers")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-lengths", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "exo-bench-moe")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    import torch

    torch.set_num_threads(args.threads)
    from exo.benchmark.engine_runner import run_engine
    from exo.benchmark.llama_cpp_runner import LlamaCppMissingError, LlamaCppRunner
    from exo.benchmark.prompts import ModelText
    from exo.node.speed_measurements import memory_copy_bytes_per_second
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.testing.random_moe_gguf import QWEN3_30B_A3B
    from exo.worker.engines.torch.engine import TorchEngine

    print(
        f"load average before: {os.getloadavg()}, CPUs: {os.cpu_count()}, threads: {args.threads}"
    )
    bandwidths = [memory_copy_bytes_per_second(BANDWIDTH_BYTES)]
    cache_files = sorted(args.cache_dir.glob("qwen3-30b-a3b-shapes-*L-q4_k.gguf"))
    cached = [int(path.name.split("-")[4].removesuffix("L")) for path in cache_files]
    fitting = choose_layers(QWEN3_30B_A3B, min(args.layers, MAX_LAYERS))
    layers = max([count for count in cached if count <= fitting], default=fitting)
    shape = dataclasses.replace(QWEN3_30B_A3B, n_layers=layers)
    print(f"{layers} of Qwen3-30B-A3B's 48 layers (fit now: {fitting}; --layers {args.layers})")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    gguf_path = _cached_gguf(args.cache_dir, shape)
    model_dir = _cached_conversion(gguf_path)

    # llama.cpp first: it loads in seconds, or says at once why not.
    llama: LlamaCppRunner | None = None
    llama_missing = ""
    try:
        started = time.perf_counter()
        llama = LlamaCppRunner(gguf_path, args.threads, 2048)
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
    engine = TorchEngine.load(model_dir, shard, weight_dtype="int4", kv_cache_tokens=2048)
    engine.warmup()
    print(f"exo loaded in {time.perf_counter() - started:.0f} s")
    model_text = ModelText.load(model_dir)

    results: dict[str, dict[int, dict[str, list[float]]]] = {"exo": {}, "llama.cpp": {}}
    for round_index in range(args.rounds):
        for length in args.prompt_lengths:
            seed = 1000 * round_index + length
            prompt = model_text.random_prompt(length, seed)[0]
            prompt_ids = model_text.random_token_ids(length, seed)
            runs: list[tuple[str, Any]] = [
                ("exo", functools.partial(
                    run_engine, engine, [prompt], args.decode_tokens, model_text
                )),
            ]  # fmt: skip
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

    bandwidths.append(memory_copy_bytes_per_second(BANDWIDTH_BYTES))
    bandwidth = max(bandwidths)  # the least disturbed of the two
    model: Any = engine.model
    exo_bytes = exo_bytes_per_token(model, shape.experts_per_token)
    gguf_bytes = gguf_bytes_per_token(gguf_path, shape.experts, shape.experts_per_token)
    load_after = os.getloadavg()
    print()
    print(f"layers {layers}, threads {args.threads}, decode tokens {args.decode_tokens}")
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
    summary: dict[str, Any] = {
        "layers": layers, "threads": args.threads, "decode_tokens": args.decode_tokens,
        "rounds": args.rounds, "bandwidth_bytes_per_s": bandwidths,
        "exo_bytes_per_token": exo_bytes, "gguf_bytes_per_token": gguf_bytes,
        "llama_cpp_missing": llama_missing or None, "load_average_after": load_after,
        "cases": [],
    }  # fmt: skip
    print("median and best (fastest run: the least disturbed by other work) over the rounds")
    header = f"{'prompt':>6} {'engine':9} {'prefill tok/s':>15} {'decode tok/s':>15}"
    print(f"{header} {'of bound (best)':>15}")
    for length in args.prompt_lengths:
        for name, bytes_per_token in (("exo", exo_bytes), ("llama.cpp", gguf_bytes)):
            measured = results[name].get(length)
            if measured is None:
                continue
            prefill, decode = _median(measured["prefill"]), _median(measured["decode"])
            best_prefill, best_decode = max(measured["prefill"]), max(measured["decode"])
            share = best_decode * bytes_per_token / bandwidth
            print(
                f"{length:6d} {name:9} {prefill:7.1f} {best_prefill:7.1f} {decode:7.2f} "
                f"{best_decode:7.2f} {share:15.0%}"
            )
            summary["cases"].append(
                {"engine": name, "prompt_tokens": length, "prefill_tok_s": prefill,
                 "decode_tok_s": decode, "best_prefill_tok_s": best_prefill,
                 "best_decode_tok_s": best_decode, "best_bound_share": share,
                 "runs": measured}
            )  # fmt: skip
        if results["llama.cpp"].get(length) and results["exo"].get(length):
            ours, theirs = results["exo"][length], results["llama.cpp"][length]
            print(
                f"{'':6} exo / llama.cpp, median (best): prefill "
                f"{_median(ours['prefill']) / _median(theirs['prefill']):.2f}x "
                f"({max(ours['prefill']) / max(theirs['prefill']):.2f}x), decode "
                f"{_median(ours['decode']) / _median(theirs['decode']):.2f}x "
                f"({max(ours['decode']) / max(theirs['decode']):.2f}x)"
            )
    if llama_missing:
        print(f"llama.cpp: missing ({llama_missing})")
    print(f"load average after: {load_after}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2))
    if llama is not None:
        llama.close()


if __name__ == "__main__":
    main()
