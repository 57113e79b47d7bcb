"""Prefill and decode speed of the torch engine on the default model, in-process through
`submit` / `step` (the path a runner serves requests by).

Usage: PYTHONPATH=src python bench/bench_engine.py [--runs 5] [--decode-tokens 64]
       [--prompt-tokens 32 128 512] [--concurrency 1] [--models-dir DIR] [--device cpu]
       [--weight-dtype default float32 int8 int4] [--threads N] [--json PATH]
       [--prefill-activations int16|int8|bf16]

Each run submits `--concurrency` random raw prompts of `--prompt-tokens` tokens (a fresh
prompt per run, so the prefix cache never hits) with the model's EOS ids banned (logit bias
-100), so every request decodes exactly `--decode-tokens` tokens. Prefill tok/s = prompt
tokens / time from submission to the step that streamed the first token; decode tok/s =
tokens after the first / time from the first token to the last (per stream; the median over
streams). Each figure is the median of `--runs` runs after one warm-up run, with min-max.
Several `--weight-dtype`s are loaded side by side and measured interleaved (run by run), so
background load affects them alike. The same measurement, through a node's API and against
llama.cpp: `exo bench --engine-in-process --compare-llama-cpp GGUF`.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from exo.benchmark.engine_runner import run_engine
from exo.benchmark.prompts import ModelText
from exo.benchmark.stats import BenchReport, CaseResult, write_json
from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.models.weight_formats import PREFILL_ACTIVATIONS, default_prefill_activations
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.quant.quantize import WEIGHT_DTYPES, WeightDtype

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[32, 128, 512])
    parser.add_argument("--concurrency", type=int, default=1, help="requests per run")
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
    parser.add_argument(
        "--prefill-activations",
        choices=PREFILL_ACTIVATIONS,
        default=default_prefill_activations(),
        help="prefill's rounding (default: a node's on this CPU)",
    )
    parser.add_argument("--json", type=Path, default=None, help="also write the runs here")
    arguments = parser.parse_args()

    card = load_builtin_cards()[DEFAULT_MODEL]
    model_dir = prepare_model(
        card,
        arguments.models_dir or default_models_dir(),
        offline=False,
        on_progress=lambda message: print(message, file=sys.stderr),
    )
    model_text = ModelText.load(model_dir)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    engines: dict[str, TorchEngine] = {}
    for name in arguments.weight_dtype:
        weight_dtype: WeightDtype | None = None if name == "default" else name
        started = time.perf_counter()
        engine = TorchEngine.load(
            model_dir,
            shard,
            device=arguments.device,
            weight_dtype=weight_dtype,
            prefill_activations=arguments.prefill_activations,
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
        f"{'weights':>18} {'prompt':>7} {'prefill tok/s':>14} {'decode tok/s':>13} "
        f"{'(min-max)':>13}  (median of {arguments.runs}; {arguments.concurrency} "
        f"request(s) per run, {arguments.decode_tokens} tokens each)"
    )
    report = BenchReport(
        started_at=time.strftime("%Y-%m-%dT%H:%M:%S"),
        machine={"threads": torch.get_num_threads()},
        settings=vars(arguments) | {"json": str(arguments.json)},
    )
    seed = 0
    for prompt_tokens in arguments.prompt_tokens:
        cases = {
            label: CaseResult(
                engine="exo-engine",
                model=str(card.model_id),
                placement=f"single {label}",
                pinned=False,
                threads=torch.get_num_threads(),
                prompt_tokens=prompt_tokens,
                generation_tokens=arguments.decode_tokens,
                concurrency=arguments.concurrency,
                runs=[],
            )
            for label in engines
        }
        for index in range(1 + arguments.runs):
            seed += 1
            prompts = [
                model_text.random_prompt(prompt_tokens, seed * 100 + number)[0]
                for number in range(arguments.concurrency)
            ]
            for label, engine in engines.items():
                run = run_engine(engine, prompts, arguments.decode_tokens, model_text)
                if index > 0:  # the first is the warm-up
                    cases[label].runs.append(run)
        for label, case in cases.items():
            summary = case.summarise()
            report.cases.append(summary)
            prefill = summary.summary["prefill_tok_s"].median
            decode = summary.summary["decode_tok_s"]
            spread = f"{decode.min:.1f}-{decode.max:.1f}"
            print(
                f"{label:>18} {prompt_tokens:>7} {prefill:>14.1f} {decode.median:>13.1f} "
                f"{spread:>13}"
            )
    if arguments.json is not None:
        write_json(report, arguments.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
