"""Many requests at once: continuous batching, chunked prefill and the prefix cache.

Usage: PYTHONPATH=src python bench/bench_concurrency.py [--json PATH] [--decode-tokens 64]
       [--concurrency 1 2 4 8] [--models-dir DIR] [--fixed-chunk N]
       [--engine-parts aggregate gap second-turn]

Engine section (the default model in this process, the engine's default weights):
- aggregate decode tok/s with 1, 2, 4, 8 requests decoding together (greedy, EOS ignored,
  32-token prompts): tokens generated after every request's first / time spent on them;
  and the same steps' thread CPU time: ms per step, split into the decoder layers, the LM
  head and the rest, and tokens per CPU second (with `OMP_NUM_THREADS=1` the step's whole
  work, which other processes on a shared machine move far less than the wall clock);
- the inter-token gap of a running stream while a 2,000-token prompt is admitted (chunked
  prefill) against its idle gap (medians and the worst gap, ms);
- time to first token of a conversation's second turn (1,500 shared tokens + 32 new) with
  and without the prefix cache.
Targets on the 2-core reference machine: 8 requests >= 4x the aggregate tok/s of one; gap
during the long prefill <= 3x idle; second turn TTFT with the cache <= 20% of cold.

API section (a node started on loopback with the default model, or `--api URL`): for 1, 2,
4, 8 streaming Chat Completions sent together (greedy, a counting prompt that runs to
`--decode-tokens`), `--api-rounds` times each:
- per-stream tok/s: a stream's (completion tokens - 1) / (its last content chunk - its
  first), median over the streams;
- aggregate tok/s: all streams' completion tokens / wall clock from sending them to the
  last one's end (prefill included), median over the rounds;
- TTFT p50 / p95: request sent -> first content chunk, over every stream of every round
  (nearest-rank percentiles).
`--sections api` measures the API alone (`--sections engine` the engine alone).

A/B runs (engine section): `--fixed-chunk N` prefills N prompt tokens per step beside
decodes instead of the measured chunk size (`batching/chunk_sizer.py`; 8 was the fixed size
before it); `EXO_NATIVE_AVX512=0` in the environment takes the 256-bit int4 and int8-block
decode tiles where the 512-bit ones are built; `--engine-parts` picks among the aggregate
tok/s, the gap during a long prefill and the second turn's TTFT (all by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import torch

from exo.chat_protocol.prompt import RenderedPrompt
from exo.download.pypi_gguf import prepare_model
from exo.shared.constants import models_dir as default_models_dir
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from exo.worker.engines.torch.batching.batch_attention import lean_step_of
from exo.worker.engines.torch.batching.chunk_sizer import FixedChunkSizer
from exo.worker.engines.torch.batching.request_state import RequestState
from exo.worker.engines.torch.engine import TorchEngine

DEFAULT_MODEL = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")
ENGINE_PARTS = ("aggregate", "gap", "second-turn")


def random_prompt(engine: TorchEngine, tokens: int, seed: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.card.vocab_size
    return torch.randint(100, vocab - 100, (tokens,), generator=generator).tolist()


def submit_tokens(
    engine: TorchEngine, prompt_ids: list[int], max_tokens: int, request_id: str
) -> RequestState:
    """Queue a greedy request for exactly these prompt tokens; returns its state."""
    params = TextGenerationTaskParams(
        model=ModelId(engine.card.model_id),
        messages=(ChatMessage(role="user", content="-"),),
        max_tokens=max_tokens,
        temperature=0.0,
    )
    rendered = RenderedPrompt(
        token_ids=prompt_ids, text="", tool_call_format="generic", thinking_open=False,
        tools_in_template=False,
    )  # fmt: skip
    state = engine.build_request(params, rendered, request_id)
    engine.scheduler.add(state)
    return state


def run_until_done(engine: TorchEngine, limit_s: float = 600.0) -> None:
    deadline = time.monotonic() + limit_s
    while engine.has_work:
        if time.monotonic() > deadline:
            raise TimeoutError("the engine did not finish in time")
        engine.step()


class StepParts:
    """Thread CPU time of a lean engine's decode steps split into its decoder layers (the
    native decode layers, or the per-layer path), its LM head and the rest (Python, the
    embedding, sampling, scheduling), by wrapping the lean step's `_decode_layers` and
    `_head` while it is entered. CPU time, not wall time: on a machine shared with other work
    (other processes take the cores, not this thread's CPU time) it moves far less than the
    wall clock; with one torch thread (`OMP_NUM_THREADS=1`) it is the step's whole work.
    With several threads only the calling thread's share is counted, so use it with one."""

    def __init__(self, engine: TorchEngine) -> None:
        self.lean: Any = lean_step_of(engine.model)
        self.seconds = {"decode_layers": 0.0, "lm_head": 0.0}

    def __enter__(self) -> StepParts:
        if self.lean is None or self.lean._head is None:
            return self
        lean, seconds = self.lean, self.seconds
        layers, head = lean._decode_layers, lean._head

        def timed_layers(*arguments: Any) -> None:
            started = time.thread_time()
            try:
                layers(*arguments)
            finally:
                seconds["decode_layers"] += time.thread_time() - started

        class TimedHead:
            in_dtype = head.in_dtype

            def __call__(self, rows: torch.Tensor) -> torch.Tensor:
                started = time.thread_time()
                try:
                    return head(rows)
                finally:
                    seconds["lm_head"] += time.thread_time() - started

        lean._decode_layers, lean._head = timed_layers, TimedHead()
        self._restore = (head,)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.lean is not None and hasattr(self, "_restore"):
            del self.lean._decode_layers  # the instance attribute: the method again
            self.lean._head = self._restore[0]

    @property
    def available(self) -> bool:
        return hasattr(self, "_restore")


def engine_aggregate_decode(
    engine: TorchEngine, concurrency: int, decode_tokens: int
) -> dict[str, float]:
    """Aggregate decode tok/s of `concurrency` requests decoding together, and the decode
    steps' thread CPU time: ms per step (whole, decoder layers, LM head, rest) and tokens
    per CPU second (`StepParts`)."""
    engine.clear_prefix_cache()
    states = [
        submit_tokens(engine, random_prompt(engine, 32, seed), decode_tokens, f"agg-{seed}")
        for seed in range(concurrency)
    ]
    while not all(state.generated_ids for state in states):  # prefill, first tokens
        engine.step()
    counted = sum(len(state.generated_ids) for state in states)
    steps = 0
    with StepParts(engine) as parts:
        started, cpu_started = time.perf_counter(), time.thread_time()
        deadline = time.monotonic() + 600.0
        while engine.has_work:
            if time.monotonic() > deadline:
                raise TimeoutError("the engine did not finish in time")
            engine.step()
            steps += 1
        seconds = time.perf_counter() - started
        cpu_seconds = time.thread_time() - cpu_started
    generated = sum(len(state.generated_ids) for state in states) - counted
    row: dict[str, float] = {
        "concurrency": concurrency,
        "aggregate_tok_s": generated / seconds,
        "steps": steps,
        "cpu_ms_per_step": cpu_seconds * 1000 / max(steps, 1),
        "tok_per_cpu_s": generated / cpu_seconds if cpu_seconds > 0 else 0.0,
    }
    if parts.available:
        layers_ms = parts.seconds["decode_layers"] * 1000 / max(steps, 1)
        head_ms = parts.seconds["lm_head"] * 1000 / max(steps, 1)
        row |= {
            "cpu_ms_decode_layers": layers_ms,
            "cpu_ms_lm_head": head_ms,
            "cpu_ms_rest": row["cpu_ms_per_step"] - layers_ms - head_ms,
        }
    return row


def engine_gap_during_long_prefill(
    engine: TorchEngine, prompt_tokens: int = 2_000, idle_steps: int = 24
) -> dict[str, float]:
    """Inter-token gaps of one running stream, idle and while a long prompt is prefilled."""
    engine.clear_prefix_cache()
    stream = submit_tokens(engine, random_prompt(engine, 32, 1), 10_000, "stream")
    while not stream.generated_ids:
        engine.step()

    def gaps_while(condition: Any, limit: int) -> list[float]:
        gaps: list[float] = []
        last = time.perf_counter()
        seen = len(stream.generated_ids)
        while condition() and len(gaps) < limit:
            engine.step()
            if len(stream.generated_ids) > seen:
                now = time.perf_counter()
                gaps.append(now - last)
                last, seen = now, len(stream.generated_ids)
        return gaps

    idle = gaps_while(lambda: True, idle_steps)
    started = time.perf_counter()
    long_request = submit_tokens(engine, random_prompt(engine, prompt_tokens, 2), 1, "long")
    during = gaps_while(lambda: not long_request.generated_ids, 100_000)
    long_ttft = time.perf_counter() - started
    engine.cancel("stream")
    run_until_done(engine)
    return {
        "idle_gap_ms_median": statistics.median(idle) * 1000,
        "gap_during_prefill_ms_median": statistics.median(during) * 1000,
        "gap_during_prefill_ms_max": max(during) * 1000,
        "gap_ratio_median": statistics.median(during) / statistics.median(idle),
        "long_prompt_ttft_s": long_ttft,
        "prefill_steps": len(during),
    }


def engine_second_turn_ttft(
    engine: TorchEngine, shared_tokens: int = 1_500, new_tokens: int = 32, runs: int = 3
) -> dict[str, float]:
    """TTFT of a second turn sharing `shared_tokens` with the first, cold and cached."""
    first = random_prompt(engine, shared_tokens - 16, 3)
    colds: list[float] = []
    warms: list[float] = []
    cached = 0
    for run in range(runs):
        engine.clear_prefix_cache()
        turn = submit_tokens(engine, first, 16, f"first-{run}")
        run_until_done(engine)
        second = turn.prompt_ids + turn.generated_ids + random_prompt(engine, new_tokens, 4)
        for label, times in (("warm", warms), ("cold", colds)):
            if label == "cold":
                engine.clear_prefix_cache()
            started = time.perf_counter()
            state = submit_tokens(engine, second, 1, f"second-{label}-{run}")
            while not state.generated_ids:
                engine.step()
            times.append(time.perf_counter() - started)
            run_until_done(engine)
            if label == "warm":
                cached = state.cached_tokens
    cold, warm = statistics.median(colds), statistics.median(warms)
    return {
        "second_turn_prompt_tokens": shared_tokens + new_tokens,
        "cached_tokens": cached,
        "ttft_cold_s": cold,
        "ttft_cached_s": warm,
        "cached_over_cold": warm / cold,
    }


def engine_section(
    engine: TorchEngine, concurrency: list[int], decode_tokens: int,
    fixed_chunk: int | None = None, parts: tuple[str, ...] = ENGINE_PARTS,
) -> dict:  # fmt: skip
    """Every engine measurement, printed as it completes."""
    engine.eos_token_ids = frozenset({-1})  # every request decodes its whole budget
    if fixed_chunk is not None:
        engine.scheduler.chunk_sizer = FixedChunkSizer(fixed_chunk)
    results: dict[str, Any] = {"aggregate": []}
    for count in concurrency if "aggregate" in parts else []:
        row = engine_aggregate_decode(engine, count, decode_tokens)
        results["aggregate"].append(row)
        split = (
            f" (decoder layers {row['cpu_ms_decode_layers']:.2f}, LM head "
            f"{row['cpu_ms_lm_head']:.2f}, rest {row['cpu_ms_rest']:.2f})"
            if "cpu_ms_lm_head" in row
            else ""
        )
        print(
            f"engine: {count} concurrent: {row['aggregate_tok_s']:.1f} tok/s aggregate; "
            f"thread CPU {row['cpu_ms_per_step']:.2f} ms per step{split}, "
            f"{row['tok_per_cpu_s']:.1f} tok per CPU second"
        )
    for row in results["aggregate"]:
        first = results["aggregate"][0]
        row["speedup_over_one"] = row["aggregate_tok_s"] / first["aggregate_tok_s"]
        row["cpu_speedup_over_one"] = row["tok_per_cpu_s"] / first["tok_per_cpu_s"]
    if results["aggregate"]:
        print(
            "engine: aggregate over one: "
            + ", ".join(
                f"{row['concurrency']}: {row['speedup_over_one']:.2f}x"
                for row in results["aggregate"]
            )
            + "; per CPU second (one thread: the work's own ratio): "
            + ", ".join(
                f"{row['concurrency']}: {row['cpu_speedup_over_one']:.2f}x"
                for row in results["aggregate"]
            )
        )
    if "gap" not in parts:
        return results
    gap = engine_gap_during_long_prefill(engine)
    results["gap_during_long_prefill"] = gap
    print(
        f"engine: gap idle {gap['idle_gap_ms_median']:.1f} ms, during a 2,000-token prefill "
        f"{gap['gap_during_prefill_ms_median']:.1f} ms median "
        f"({gap['gap_ratio_median']:.2f}x), {gap['gap_during_prefill_ms_max']:.1f} ms max; "
        f"long prompt TTFT {gap['long_prompt_ttft_s']:.2f} s in {gap['prefill_steps']} steps"
    )
    if "second-turn" not in parts:
        return results
    turn = engine_second_turn_ttft(engine)
    results["second_turn"] = turn
    print(
        f"engine: second turn TTFT cold {turn['ttft_cold_s'] * 1000:.0f} ms, with the prefix "
        f"cache {turn['ttft_cached_s'] * 1000:.0f} ms ({turn['cached_over_cold']:.1%}; "
        f"{turn['cached_tokens']} tokens cached)"
    )
    return results


# ---------------------------------------------------------------- API section

API_PROMPT = "Count from 1 to 500 in digits, separated by commas: 1, 2, 3,"
API_TIMEOUT_SECONDS = 600.0


def api_stream(url: str, max_tokens: int, start: threading.Barrier) -> dict[str, float]:
    """One greedy streaming chat request, sent when every stream of its round is ready:
    its send and end times, TTFT, completion tokens and decode tok/s."""
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": [{"role": "user", "content": API_PROMPT}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start.wait(timeout=API_TIMEOUT_SECONDS)
    sent = time.perf_counter()
    first = last = 0.0
    completion_tokens = 0
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json=body, timeout=API_TIMEOUT_SECONDS
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line.removeprefix("data: "))
            if event.get("usage"):
                completion_tokens = event["usage"]["completion_tokens"]
            if any(choice["delta"].get("content") for choice in event.get("choices", [])):
                last = time.perf_counter()
                first = first or last
    ended = time.perf_counter()
    decoding = last - first
    return {
        "sent": sent,
        "ended": ended,
        "ttft_s": first - sent,
        "completion_tokens": completion_tokens,
        "stream_tok_s": (completion_tokens - 1) / decoding if decoding > 0 else 0.0,
    }


def api_round(url: str, concurrency: int, max_tokens: int) -> list[dict[str, float]]:
    """`concurrency` streams sent together; each one's figures."""
    start = threading.Barrier(concurrency)
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        futures = [pool.submit(api_stream, url, max_tokens, start) for _ in range(concurrency)]
        return [future.result(timeout=API_TIMEOUT_SECONDS) for future in futures]


def nearest_rank(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile: the smallest value with at least `fraction` of the
    values at or below it."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def api_concurrency(url: str, concurrency: int, max_tokens: int, rounds: int) -> dict[str, Any]:
    """The API figures for `concurrency` streams at once, over `rounds` rounds."""
    streams: list[dict[str, float]] = []
    aggregates: list[float] = []
    for _ in range(rounds):
        measured = api_round(url, concurrency, max_tokens)
        wall = max(row["ended"] for row in measured) - min(row["sent"] for row in measured)
        aggregates.append(sum(row["completion_tokens"] for row in measured) / wall)
        streams.extend(measured)
    ttfts = [row["ttft_s"] for row in streams]
    return {
        "concurrency": concurrency,
        "streams": len(streams),
        "completion_tokens_median": statistics.median(row["completion_tokens"] for row in streams),
        "stream_tok_s_median": statistics.median(row["stream_tok_s"] for row in streams),
        "aggregate_tok_s": statistics.median(aggregates),
        "ttft_p50_s": nearest_rank(ttfts, 0.50),
        "ttft_p95_s": nearest_rank(ttfts, 0.95),
    }


@contextlib.contextmanager
def api_node(models_dir: Path | None, decode_activations: str = "int16") -> Iterator[str]:
    """A node on loopback serving the default model (placed at start), its runners rounding
    int4 products' activations as `decode_activations` says; its URL."""
    with tempfile.TemporaryDirectory(prefix="exo-bench-concurrency-") as home:
        options = ("-q", "--decode-activations", decode_activations)
        node = ExoNode(Path(home), models_dir or default_models_dir(), options)
        node.start()
        try:
            node.wait_ready()
            yield node.url
        finally:
            node.stop()


def api_section(url: str, concurrency: list[int], max_tokens: int, rounds: int) -> dict:
    """Every API measurement against the node at `url`, printed as it completes."""
    api_round(url, 1, 8)  # warm-up: the first request after loading is slower
    rows = []
    for count in concurrency:
        row = api_concurrency(url, count, max_tokens, rounds)
        rows.append(row)
        print(
            f"api: {count} concurrent streams: {row['stream_tok_s_median']:.1f} tok/s per "
            f"stream, {row['aggregate_tok_s']:.1f} tok/s aggregate, TTFT p50 "
            f"{row['ttft_p50_s'] * 1000:.0f} ms p95 {row['ttft_p95_s'] * 1000:.0f} ms "
            f"({row['completion_tokens_median']:.0f} tokens each)"
        )
    one = rows[0]["aggregate_tok_s"]
    for row in rows:
        row["speedup_over_one"] = row["aggregate_tok_s"] / one
    print(
        "api: aggregate over one stream: "
        + ", ".join(f"{row['concurrency']}: {row['speedup_over_one']:.2f}x" for row in rows)
    )
    return {"url": url, "rounds": rounds, "max_tokens": max_tokens, "concurrency": rows}


def load_default_engine(models_dir: Path | None, decode_activations: str = "int16") -> TorchEngine:
    card = load_builtin_cards()[DEFAULT_MODEL]
    model_dir = prepare_model(
        card, models_dir or default_models_dir(), offline=False,
        on_progress=lambda message: print(message, file=sys.stderr),
    )  # fmt: skip
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    engine = TorchEngine.load(model_dir, shard, decode_activations=decode_activations)  # type: ignore[arg-type]
    engine.warmup()
    return engine


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--models-dir", type=Path, default=None)
    parser.add_argument(
        "--sections", nargs="+", choices=["engine", "api"], default=["engine", "api"]
    )
    parser.add_argument("--api", metavar="URL", help="measure this running node's API")
    parser.add_argument("--api-rounds", type=int, default=3)
    parser.add_argument("--fixed-chunk", type=int, default=None, metavar="TOKENS")
    parser.add_argument(
        "--engine-parts", nargs="+", choices=ENGINE_PARTS, default=list(ENGINE_PARTS)
    )
    parser.add_argument(
        "--decode-activations",
        choices=("int16", "int8"),
        default="int16",
        help="how int4 products round activations (the node's --decode-activations)",
    )
    arguments = parser.parse_args()
    results: dict[str, Any] = {
        "threads": torch.get_num_threads(),
        "decode_activations": arguments.decode_activations,
    }
    print(f"decode activations: {arguments.decode_activations}")
    if "engine" in arguments.sections:
        engine = load_default_engine(arguments.models_dir, arguments.decode_activations)
        results["engine"] = engine_section(
            engine, arguments.concurrency, arguments.decode_tokens, arguments.fixed_chunk,
            tuple(arguments.engine_parts),
        )  # fmt: skip
        del engine  # its memory and threads are not the node's to share
    if "api" in arguments.sections:
        with contextlib.ExitStack() as stack:
            url = arguments.api or stack.enter_context(
                api_node(arguments.models_dir, arguments.decode_activations)
            )
            results["api"] = api_section(
                url, arguments.concurrency, arguments.decode_tokens, arguments.api_rounds
            )
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
