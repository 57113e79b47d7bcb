"""One `exo bench` run: for each placement asked × prompt length × generation length ×
concurrency, warm-up requests then measured runs, optionally interleaved run by run with
llama.cpp on the same GGUF and with the engine in-process; the JSON report is rewritten after
every case, so an interrupted run keeps what it measured."""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from exo.benchmark.client import ApiTarget, run_concurrent
from exo.benchmark.cluster import BenchNodes, BenchSetupError, LocalNodes, Placement
from exo.benchmark.llama_cpp_runner import LlamaCppRunner
from exo.benchmark.prompts import ModelText
from exo.benchmark.ratios import add_ratios
from exo.benchmark.stats import BenchReport, CaseResult, Print, RunResult, write_json
from exo.shared.models.weight_formats import PrefillActivations, default_prefill_activations
from exo.utils.cpu_features import cpu_model
from exo.utils.heap import freeze_long_lived_objects

# The pause before every run (exo's and each companion's): the run before it may leave
# threads spinning idle for a while (libgomp's intra-op threads in a runner or in this
# process after the in-process engine, ggml's pool after llama.cpp) on the cores the next
# run needs. Measured (2-core Intel Xeon, 2026-12-02, SmolLM2-135M, 5 runs): llama.cpp's
# TTFT at 128 tokens, run right after exo's, 754 ms without the pause and 619 ms with 0.5 s.
DEFAULT_SETTLE_SECONDS = 0.5


@dataclass
class BenchConfig:
    """What to measure (see `exo bench --help` for each field)."""

    model: str
    placements: list[Placement]
    prompt_tokens: list[int]
    generation_tokens: list[int]
    concurrency: list[int]
    runs: int = 3
    warmup: int = 1
    settle_seconds: float = DEFAULT_SETTLE_SECONDS
    api: str | None = None
    api_key: str | None = None
    nodes: int | None = None
    pin_cores: bool = False
    threads: int | None = None
    # The local nodes' and the in-process engine's (default: a node's default on this CPU).
    prefill_activations: PrefillActivations = field(default_factory=default_prefill_activations)
    compare_llama_cpp: Path | None = None
    engine_in_process: bool = False
    interleave_placements: bool = True
    model_dir: Path | None = None
    output: Path = Path("bench-results")
    name: str = "bench"
    plots: bool = True
    seed: int = 0
    settings: dict[str, Any] = field(default_factory=dict)

    def node_count(self) -> int:
        return self.nodes or max(placement.nodes for placement in self.placements)


def machine_facts() -> dict[str, Any]:
    """The machine the bench ran on (CPU, cores, load at start)."""
    load = os.getloadavg() if hasattr(os, "getloadavg") else (0.0, 0.0, 0.0)
    return {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "load_average_at_start": list(load),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
    }


def resolve_model(config: BenchConfig, say: Print) -> tuple[str, Path, bool]:
    """(model id or local path to ask for, the model's local directory, whether it is a
    local directory to add through `/models/add`).

    Raises:
        ValueError: an unknown model, or one whose files are not on this machine (a running
            cluster's model: give `--model-dir`).
    """
    from exo.download.pypi_gguf import ModelPreparationError, prepare_model
    from exo.shared.constants import models_dir
    from exo.shared.models.cards import load_builtin_cards, resolve_card

    path = Path(config.model).expanduser()
    if path.is_dir():
        return str(path.resolve()), path.resolve(), True
    card = resolve_card(config.model, load_builtin_cards())
    if config.model_dir is not None:
        return str(card.model_id), config.model_dir, False
    try:
        directory = prepare_model(
            card, models_dir(), offline=config.api is not None, on_progress=say
        )
    except ModelPreparationError as error:
        raise ValueError(
            f"{card.model_id}: its files (tokenizer, EOS ids) are not on this machine "
            f"({error}); give them with --model-dir DIR"
        ) from None
    return str(card.model_id), directory, False


def _case(
    config: BenchConfig,
    engine: str,
    placement: str,
    pinned: bool,
    prompt_tokens: int,
    generation_tokens: int,
    concurrency: int,
) -> CaseResult:
    return CaseResult(
        engine=engine,
        model=config.model,
        placement=placement,
        pinned=pinned,
        threads=config.threads,
        prompt_tokens=prompt_tokens,
        generation_tokens=generation_tokens,
        concurrency=concurrency,
        runs=[],
    )


def _describe(case: CaseResult) -> str:
    summary = case.summary
    decode = summary["aggregate_decode_tok_s" if case.concurrency > 1 else "decode_tok_s"]
    memory = ", ".join(
        f"{node[:8]} {peak / 2**20:.0f} MiB" for node, peak in case.peak_memory_bytes.items()
    )
    predicted = ""
    if case.predicted:
        predicted = "  predicted " + ", ".join(f"{k} {v:.2f}" for k, v in case.predicted.items())
    return (
        f"{case.label:<28} prompt {case.prompt_tokens:>5} gen {case.generation_tokens:>4} "
        f"x{case.concurrency:<2} prefill {summary['prefill_tok_s'].median:8.1f} tok/s  "
        f"decode {decode.median:7.1f} tok/s [{decode.min:.1f}-{decode.max:.1f}]  "
        f"TTFT {summary['ttft_s'].median * 1000:7.0f} ms"
        + (f"  peak {memory}" if memory else "")
        + predicted
    )


def run_bench(config: BenchConfig, say: Print = print) -> BenchReport:
    """Run `config` and return (and write, to `config.output / f"{config.name}.json"`) the
    report.

    Raises:
        BenchSetupError: nodes could not start or a placement could not be made ready.
        BenchRequestError / EngineRunError: a run failed or did not decode the exact count.
        LlamaCppMissingError: `compare_llama_cpp` without llama-cpp-python.
    """
    started = datetime.now(UTC).isoformat(timespec="seconds")
    report = BenchReport(
        started_at=started,
        machine=machine_facts(),
        settings={**asdict(config), **config.settings},
    )
    json_path = config.output / f"{config.name}.json"
    model_id, model_dir, local_directory = resolve_model(config, say)
    # The nodes start (tens of seconds) while this process reads the tokenizer.
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        starting = pool.submit(_connect, config, say)
        try:
            model_text = ModelText.load(model_dir)
            say(f"model {model_id}: EOS ids {sorted(model_text.eos_token_ids)} banned")
        except BaseException:
            with contextlib.suppress(Exception):
                starting.result().close()
            raise
        nodes = starting.result()
    llama: LlamaCppRunner | None = None
    try:
        if local_directory:
            model_id = nodes.add_local_model(model_dir)
        # Fresh nodes measure their speed a few seconds after they start; predictions taken
        # after this process loaded llama.cpp or the engine came out 2.5-10x slower than a
        # node alone predicts (11 and 49 tok/s where it predicted 125-133), so every
        # placement's predictions are taken first.
        predictions: dict[tuple[str, int], tuple[dict[str, float], str | None]] = {}
        for placement in config.placements:
            for length in config.prompt_tokens:
                predicted = nodes.predicted(model_id, placement, length)
                predictions[placement.label, length] = (predicted, nodes.no_prediction_reason)
        if config.compare_llama_cpp is not None:
            longest = max(config.prompt_tokens) + max(config.generation_tokens) + 16
            threads = config.threads or len(os.sched_getaffinity(0))
            llama = LlamaCppRunner(config.compare_llama_cpp, threads, longest)
            say(f"llama.cpp on {config.compare_llama_cpp.name}, {threads} threads")
        engine: Any = None
        if config.engine_in_process:
            from exo.benchmark.engine_runner import load_engine_for_bench

            say("loading the engine in this process")
            engine = load_engine_for_bench(
                model_dir, prefill_activations=config.prefill_activations
            )
        # This process's client times every chunk: a full collection over the engine's
        # objects (~170 ms) in the middle of a run would show up as a stalled stream.
        freeze_long_lived_objects()
        groups = [config.placements] if config.interleave_placements else [
            [placement] for placement in config.placements
        ]  # fmt: skip
        session = BenchSession(
            config, report, nodes, model_id, model_text, llama, engine, predictions, say,
            functools.partial(write_json, report, json_path),
        )  # fmt: skip
        for placements in groups:
            _bench_placements(session, placements)
    finally:
        nodes.close()
        if llama is not None:
            llama.close()
        report.finished_at = datetime.now(UTC).isoformat(timespec="seconds")
        report.machine["load_average_at_end"] = list(os.getloadavg())
        write_json(report, json_path)
    add_ratios(report)
    write_json(report, json_path)
    say(f"JSON: {json_path}")
    return report


def _connect(config: BenchConfig, say: Print) -> BenchNodes:
    """The running cluster of `config.api`, or fresh local nodes."""
    if config.api is not None:
        nodes = BenchNodes(ApiTarget(config.api, config.api_key), [])
        view = nodes.get("/cluster")
        nodes.node_ids = [view["node_id"], *view["peers"]]
        return nodes
    from exo.shared.constants import models_dir

    pinned = ", pinned one core each" if config.pin_cores else ""
    rounding = f", --prefill-activations {config.prefill_activations}"
    say(f"starting {config.node_count()} local node(s){pinned}{rounding}")
    extra_args = ("--prefill-activations", config.prefill_activations)
    return LocalNodes(
        config.node_count(), models_dir(), config.pin_cores, config.threads, extra_args
    )


def _prompts(model_text: ModelText, length: int, count: int, seed: int) -> list[str]:
    return [model_text.random_prompt(length, seed * 1000 + index)[0] for index in range(count)]


def _llama_run(
    llama: LlamaCppRunner, model_text: ModelText, length: int, count: int, seed: int
) -> RunResult:
    return llama.run(model_text.random_token_ids(length, seed), count)


def _engine_run(
    engine: Any, model_text: ModelText, length: int, count: int, streams: int, seed: int
) -> RunResult:
    from exo.benchmark.engine_runner import run_engine

    return run_engine(
        engine, _prompts(model_text, length, streams, seed + 50_000), count, model_text
    )


@dataclass
class _Measured:
    """One placement's case while the cases of a group are measured run by run."""

    case: CaseResult
    target: ApiTarget
    others: set[int]
    """Processes of the group's other instances (left out of this case's peak memory)."""
    companions: list[tuple[CaseResult, Callable[[int], RunResult]]]


@dataclass
class BenchSession:
    """What every placement group of one `run_bench` shares: the config, the report being
    filled, the nodes, the model, the runners measured beside exo's single placement
    (llama.cpp, the in-process engine; None where not asked), the cluster's predictions
    (and why there is none) per (placement label, prompt length), taken before anything
    ran, where messages go, and `checkpoint`, run after every case (the report rewritten)."""

    config: BenchConfig
    report: BenchReport
    nodes: BenchNodes
    model_id: str
    model_text: ModelText
    llama: LlamaCppRunner | None
    engine: Any
    predictions: dict[tuple[str, int], tuple[dict[str, float], str | None]]
    say: Print
    checkpoint: Callable[[], None] = lambda: None


def _bench_placements(session: BenchSession, placements: list[Placement]) -> None:
    """Place every placement of `placements` side by side (each its own instance), measure
    every case with their runs interleaved run by run (each request pinned to its instance
    with the API's `INSTANCE_HEADER`), delete them. The machine's speed moves between
    minutes (2x on the 2-core VMs: tensor x2 on two pinned nodes decoded 33.9 and 17.8
    tok/s in the same command ten minutes apart), so placements measured one after the
    other compare badly. When a later placement has no room beside the earlier ones, each
    is measured alone, one after the other (with a note).

    Raises:
        BenchSetupError: the first placement could not be made ready.
    """
    report, nodes, say = session.report, session.nodes, session.say
    placed: list[tuple[Placement, str]] = []
    try:
        for placement in placements:
            try:
                placed.append((placement, _place(session, placement)))
            except BenchSetupError as error:
                if not placed:
                    raise
                note = (
                    f"{placement.label} could not be placed beside "
                    f"{', '.join(p.label for p, _ in placed)} ({error}): each placement "
                    "measured alone, one after the other"
                )
                say(f"  {note}")
                report.notes.append(note)
                break
        else:
            _measure(session, placed)
            return
    finally:
        for _, instance_id in placed:
            nodes.delete(instance_id)
    for placement in placements:
        _bench_placements(session, [placement])


def _place(session: BenchSession, placement: Placement) -> str:
    """Place `placement` and wait until it is ready; returns its instance id."""
    report, nodes, model_id, say = session.report, session.nodes, session.model_id, session.say
    say(f"placing {model_id} {placement.label}")
    started = time.monotonic()
    instance_id = nodes.place(model_id, placement)
    say(f"  ready in {time.monotonic() - started:.0f} s")
    if isinstance(nodes, LocalNodes) and nodes.pinned:
        report.notes.append(f"{placement.label} CPU affinity (node, runners): {nodes.affinities()}")
    # What each node measured (the predictions' inputs; the probe's figures move run to run).
    measured = {
        node_id[:8]: info.get("speed")
        for node_id, info in nodes.get("/state").get("node_info", {}).items()
    }
    report.notes.append(f"{placement.label} speed figures each node measured: {measured}")
    return instance_id


def _measure(session: BenchSession, placed: list[tuple[Placement, str]]) -> None:
    """Measure every case on the placed instances, run by run in turn (each run's prompts
    the same for every placement). On a single placement the llama.cpp runner (one stream)
    and the in-process engine (when given) each run right after its exo run, on the same
    prompts' length, so background load affects them alike."""
    from exo.shared.constants import INSTANCE_HEADER

    config, report, nodes, say = session.config, session.report, session.nodes, session.say
    model_text, taken, checkpoint = session.model_text, session.predictions, session.checkpoint

    for placement, _ in placed:
        for length in config.prompt_tokens:
            _, reason = taken[placement.label, length]
            if reason is not None:
                note = f"{placement.label} prompt {length}: no prediction: {reason}"
                say(f"  {note}")
                report.notes.append(note)
    processes = {instance_id: nodes.instance_processes(instance_id) for _, instance_id in placed}
    seed = config.seed
    for prompt_tokens in config.prompt_tokens:
        for generation_tokens in config.generation_tokens:
            for concurrency in config.concurrency:
                group: list[_Measured] = []
                for placement, instance_id in placed:
                    case = _case(
                        config, "exo", placement.label, nodes.pinned, prompt_tokens,
                        generation_tokens, concurrency,
                    )  # fmt: skip
                    case.predicted = taken[placement.label, prompt_tokens][0]
                    headers = {**nodes.target.headers, INSTANCE_HEADER: instance_id}
                    others = set().union(*(p for i, p in processes.items() if i != instance_id))
                    companions = _companions(
                        config, placement, session.llama, session.engine, model_text,
                        prompt_tokens, generation_tokens, concurrency,
                    )  # fmt: skip
                    target = replace(nodes.target, headers=headers)
                    group.append(_Measured(case, target, others, companions))
                for index in range(config.warmup + config.runs):
                    seed += 1
                    prompts = _prompts(model_text, prompt_tokens, concurrency, seed)
                    measured = index >= config.warmup
                    for entry in group:
                        time.sleep(config.settle_seconds)
                        if measured:
                            nodes.memory.start(entry.others)
                        run = run_concurrent(
                            entry.target, session.model_id, prompts, generation_tokens,
                            model_text.logit_bias(),
                        )  # fmt: skip
                        if measured:
                            for node, peak in nodes.memory.stop().items():
                                peaks = entry.case.peak_memory_bytes
                                peaks[node] = max(peaks.get(node, 0), peak)
                            entry.case.runs.append(run)
                        for companion, run_companion in entry.companions:
                            time.sleep(config.settle_seconds)
                            companion_run = run_companion(seed)
                            if measured:
                                companion.runs.append(companion_run)
                for entry in group:
                    for finished in (entry.case, *(other for other, _ in entry.companions)):
                        finished = finished.summarise()
                        report.cases.append(finished)
                        say(_describe(finished))
                checkpoint()


def _companions(
    config: BenchConfig,
    placement: Placement,
    llama: LlamaCppRunner | None,
    engine: Any,
    model_text: ModelText,
    prompt_tokens: int,
    generation_tokens: int,
    concurrency: int,
) -> list[tuple[CaseResult, Callable[[int], RunResult]]]:
    """The runs that follow each of `placement`'s exo runs: llama.cpp (one stream) and the
    in-process engine, for a single placement."""
    companions: list[tuple[CaseResult, Callable[[int], RunResult]]] = []
    if llama is not None and placement.nodes == 1 and concurrency == 1:
        other = _case(config, "llama.cpp", "single", False, prompt_tokens, generation_tokens, 1)
        companions.append((other, functools.partial(
            _llama_run, llama, model_text, prompt_tokens, generation_tokens
        )))  # fmt: skip
    if engine is not None and placement.nodes == 1:
        other = _case(config, "exo-engine", "single", False, prompt_tokens, generation_tokens,
                      concurrency)  # fmt: skip
        companions.append((other, functools.partial(
            _engine_run, engine, model_text, prompt_tokens, generation_tokens, concurrency,
        )))  # fmt: skip
    return companions
