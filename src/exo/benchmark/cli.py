"""`exo bench`: measure prefill / decode tok/s, TTFT and peak memory of placements.

exo bench [--model M] [--placement single pipeline:2 tensor:2] [--prompt-tokens 128 512]
          [--generation-tokens 64] [--concurrency 1 4] [--runs 3] [--warmup 1]
          [--settle-seconds 0.5] [--sequential-placements]
          [--api URL [--api-key KEY]] [--nodes N] [--pin-cores] [--threads N]
          [--compare-llama-cpp GGUF] [--engine-in-process] [--output DIR] [--no-plots]
          [--quick] [--suite speed-targets]

Each `--help` text is one sentence of at most 120 characters; docs/benchmarks/index.md has
the details.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from loguru import logger

from exo.benchmark.client import BenchRequestError
from exo.benchmark.cluster import BenchSetupError, Placement
from exo.benchmark.engine_runner import EngineRunError
from exo.benchmark.llama_cpp_runner import LlamaCppMissingError
from exo.benchmark.plots import PlotsUnavailableError, plot_report, require_matplotlib
from exo.benchmark.ratios import print_ratios
from exo.benchmark.runner import DEFAULT_SETTLE_SECONDS, BenchConfig, run_bench
from exo.shared.models.weight_formats import PREFILL_ACTIVATIONS, default_prefill_activations

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# A pause past this is a typo (NaN fails the check too).
MAX_SETTLE_SECONDS = 60.0
QUICK = {"prompt_tokens": [16], "generation_tokens": [8], "runs": 2, "warmup": 1}
SPEED_TARGETS_SUITE = "speed-targets"
# The suite's name before it was named for what it measures; accepted until the next release.
SUITE_ALIASES = {"issue14": SPEED_TARGETS_SUITE}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="exo bench",
        description="Prefill / decode tok/s, TTFT and peak memory of exo placements, against "
        "fresh local nodes (default) or a running cluster (--api). EOS is banned so every run "
        "decodes exactly --generation-tokens tokens; each figure is the median of --runs runs "
        "after --warmup, with its min / max and quartiles in the JSON.",
    )
    parser.add_argument(
        "--suite",
        choices=[SPEED_TARGETS_SUITE, *SUITE_ALIASES],
        help="run the standard set of benches (docs/benchmarks); issue14 is a deprecated alias "
        "(default: none)",
    )
    parser.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="catalog id, short name or local Hugging Face-format directory (default %(default)s)",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        help="read the model's tokenizer from this directory when --api serves a model this "
        "machine lacks (default: none)",
    )
    parser.add_argument(
        "--placement",
        nargs="+",
        default=["single"],
        help="placements to measure: single, pipeline:N, tensor:N (default: single)",
    )
    parser.add_argument(
        "--prompt-tokens",
        type=int,
        nargs="+",
        default=[128, 512],
        help="prompt lengths in tokens (default: 128 512)",
    )
    parser.add_argument(
        "--generation-tokens",
        type=int,
        nargs="+",
        default=[64],
        help="tokens each request generates (default: 64)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1],
        help="requests submitted together per run (default: 1)",
    )
    parser.add_argument(
        "--runs", type=int, default=3, help="measured runs per case (default %(default)s)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="unmeasured runs per case first (default %(default)s)"
    )
    parser.add_argument(
        "--settle-seconds",
        type=float,
        default=DEFAULT_SETTLE_SECONDS,
        help="pause in seconds before every run, so idle threads stop spinning (default "
        f"{DEFAULT_SETTLE_SECONDS:g})",
    )
    parser.add_argument("--api", help="URL of a running node's API (default: start local nodes)")
    parser.add_argument("--api-key", help="API key for --api (default: none)")
    parser.add_argument(
        "--nodes", type=int, help="local nodes to start (default: the most any placement needs)"
    )
    parser.add_argument(
        "--pin-cores",
        action="store_true",
        help="pin local node i and its runners to CPU core i (default: no pinning)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        help="threads per node and for llama.cpp (default: the CPUs this process may use)",
    )
    parser.add_argument(
        "--prefill-activations",
        choices=PREFILL_ACTIVATIONS,
        default=None,
        help="the local nodes' and in-process engine's --prefill-activations (default: a "
        "node's default on this CPU)",
    )
    parser.add_argument(
        "--compare-llama-cpp",
        type=Path,
        metavar="GGUF",
        help="also run llama.cpp on this GGUF, interleaved with exo's single placement "
        "(default: no)",
    )
    parser.add_argument(
        "--engine-in-process",
        action="store_true",
        help="also measure the engine alone in this process (default: no)",
    )
    parser.add_argument(
        "--sequential-placements",
        action="store_true",
        help="place and measure one placement at a time (default: side by side, runs interleaved)",
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path("bench-results"),
        help="directory for the JSON and PNG (default: bench-results/)",
    )
    parser.add_argument(
        "--name", default="bench", help="file name stem of the JSON and PNG (default: bench)"
    )
    parser.add_argument(
        "--no-plots", action="store_true", help="write only the JSON (default: JSON and PNG)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny sizes, for a smoke run (default: off)"
    )
    return parser


def api_url(text: str) -> str:
    """`--api`'s base URL: `HOST:PORT` (no scheme) means `http://HOST:PORT`; a trailing
    slash is dropped.

    Raises:
        ValueError: not an http(s) URL with a host, or a port that is not a number.
    """
    url = text.strip().rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    parts = urlsplit(url)
    try:
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        raise ValueError(
            f"--api {text!r}: the port is not a number (use http://HOST:PORT)"
        ) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--api {text!r}: use http://HOST:PORT (or https://)")
    return url


def config_from_arguments(arguments: argparse.Namespace) -> BenchConfig:
    """The bench's config from parsed arguments (`--quick` sets the sizes the command line
    did not: `arguments.given`, the destinations given explicitly, see `parse_arguments`).

    Raises:
        ValueError: a placement or a number out of range.
    """
    placements = [Placement.parse(text) for text in arguments.placement]
    config = BenchConfig(
        model=arguments.model,
        placements=placements,
        prompt_tokens=arguments.prompt_tokens,
        generation_tokens=arguments.generation_tokens,
        concurrency=arguments.concurrency,
        runs=arguments.runs,
        warmup=arguments.warmup,
        settle_seconds=arguments.settle_seconds,
        api=api_url(arguments.api) if arguments.api else None,
        api_key=arguments.api_key,
        nodes=arguments.nodes,
        pin_cores=arguments.pin_cores,
        threads=arguments.threads,
        prefill_activations=arguments.prefill_activations or default_prefill_activations(),
        compare_llama_cpp=arguments.compare_llama_cpp,
        engine_in_process=arguments.engine_in_process,
        interleave_placements=not arguments.sequential_placements,
        model_dir=arguments.model_dir,
        output=arguments.output,
        name=arguments.name,
        plots=not arguments.no_plots,
    )
    if arguments.quick:  # smaller sizes for what the command line did not set itself
        given = set(getattr(arguments, "given", ()))
        for name, value in QUICK.items():
            if name not in given:
                setattr(config, name, value)
    numbers = (*config.prompt_tokens, *config.generation_tokens, *config.concurrency)
    if min(numbers) < 1 or config.runs < 1 or config.warmup < 0:
        raise ValueError("token counts, concurrency and --runs must be >= 1, --warmup >= 0")
    if config.generation_tokens and min(config.generation_tokens) < 2:
        raise ValueError("--generation-tokens must be >= 2 (decode is timed after the first)")
    if not 0 <= config.settle_seconds <= MAX_SETTLE_SECONDS:
        raise ValueError(f"--settle-seconds must be within 0 .. {MAX_SETTLE_SECONDS:g}")
    if config.api is not None and config.pin_cores:
        raise ValueError("--pin-cores applies to local nodes only (not with --api)")
    if config.api is not None and arguments.prefill_activations is not None:
        raise ValueError(
            "--prefill-activations applies to the nodes the bench starts (with --api, give "
            "it to the cluster's nodes when they start)"
        )
    if config.compare_llama_cpp is not None and not config.compare_llama_cpp.is_file():
        raise ValueError(f"--compare-llama-cpp: no file {config.compare_llama_cpp}")
    return config


def run_config(config: BenchConfig, title: str) -> int:
    """Run one bench, print its figures and ratios, write the JSON (always) and the PNG."""
    report = run_bench(config)
    print_ratios(report)
    if config.plots:
        path = plot_report(report, config.output / f"{config.name}.png", title)
        print(f"plot: {path}")
    return 0


def parse_arguments(argv: list[str]) -> argparse.Namespace:
    """`argv` parsed, plus `given`: the destinations the command line set explicitly (so
    `--quick` changes only the others)."""
    arguments = build_parser().parse_args(argv)
    explicit = build_parser()
    for action in explicit._actions:
        action.default = argparse.SUPPRESS
    arguments.given = sorted(vars(explicit.parse_args(argv)))
    return arguments


def main(argv: list[str]) -> int:
    """`exo bench ...`; returns the exit status (2: bad arguments or a missing package,
    1: the bench failed)."""
    arguments = parse_arguments(argv)
    # The engine in-process logs its loading at DEBUG; the bench prints its own lines.
    logger.remove()
    logger.add(sys.stderr, level="WARNING")
    try:
        if arguments.suite is not None:
            from exo.benchmark.suite import run_speed_targets

            if arguments.suite in SUITE_ALIASES:
                print(
                    f"exo bench: --suite {arguments.suite} is now --suite "
                    f"{SUITE_ALIASES[arguments.suite]} (the old name goes in the next release)",
                    file=sys.stderr,
                )
            if not arguments.no_plots:
                require_matplotlib()
            return run_speed_targets(
                arguments.output, quick=arguments.quick, plots=not arguments.no_plots
            )
        config = config_from_arguments(arguments)
        if config.plots:
            require_matplotlib()
        return run_config(config, f"exo bench: {config.model}")
    except (ValueError, PlotsUnavailableError, LlamaCppMissingError) as error:
        print(f"exo bench: {error}", file=sys.stderr)
        return 2
    except (BenchSetupError, BenchRequestError, EngineRunError) as error:
        print(f"exo bench failed: {error}", file=sys.stderr)
        return 1
    except httpx.HTTPError as error:
        where = f" ({error.request.url})" if _has_request(error) else ""
        print(f"exo bench failed: the API did not answer{where}: {error}", file=sys.stderr)
        return 1


def _has_request(error: httpx.HTTPError) -> bool:
    try:
        error.request  # noqa: B018 (raises RuntimeError when the error has none)
    except RuntimeError:
        return False
    return True
