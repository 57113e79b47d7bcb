"""Soak: concurrent streams with cancels and client disconnects for a long time, while the
node's and its runners' memory and open files are sampled.

Usage: PYTHONPATH=src python bench/soak.py [--minutes 30] [--streams 8] [--seed 17]
       [--warmup-minutes M] [--sample-seconds 10] [--json PATH] [--models-dir DIR]

A node is started on loopback with the default model (a fresh home; the converted weights
from `--models-dir`, by default this machine's models directory). `--streams` client threads
send streaming requests back to back, each request's dialect (Chat Completions, Claude
Messages, Responses, Ollama chat), prompt and fate drawn from one seeded generator:
- complete: read the stream to its end;
- cancel: after a few chunks, `POST /v1/cancel/{id}`, then read the stream to its end;
- disconnect: after a few chunks, close the connection (the client goes away).
Prompts are drawn from seeded random words (and some share a long prefix), so the prefix
cache and the KV cache fill to their budgets during the warm-up.

Each stream is a client of its own: it connects from its own loopback address
(`client_address`), which the node's per-client limits count as one client, so no stream
is refused for another's generations (a 429 fails the run).

Every request must end "cleanly": completed (the dialect's end of stream), cancelled or
disconnected as planned, or refused/failed with the dialect's error shape (an HTTP error with
a JSON body, or an error event in the stream). Anything else (a hang past the client timeout,
a stream that stops without its end, a transport error) counts as unclean.

Every `--sample-seconds` the node's and each runner's RSS (bytes) and open file-descriptor
count are sampled (psutil), with the KV cache tokens the runners hold (running requests and
prefix cache) against their budget, from `/metrics`: a runner's RSS grows while its KV cache
fills, so growth while the cache still fills is the cache, not a leak. After the warm-up
(default: a fifth of the run, at least one minute), the baseline is the median of the first
five samples and the end the median of the last five; the run passes when each process's RSS
grows < 10% over that window, its fd count does not grow, no runner was replaced, and no
request ended uncleanly. The figures are printed and written as JSON. On a machine loaded by
other work the request counts vary from run to run, and the KV cache fills more slowly (a
longer `--warmup-minutes` then); RSS and fd figures do not depend on the load.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
from prometheus_client.parser import text_string_to_metric_families

from exo.shared.constants import models_dir as default_models_dir
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode

# The longest wait for a byte before a request counts as hung: the OpenAI Python SDK's
# default read timeout. A queued request sends nothing until its first token, and on a
# 2-core machine loaded by other work 8 streams have taken minutes each.
CLIENT_TIMEOUT_SECONDS = 600.0
RESPONSES_MIN_OUTPUT_TOKENS = 16
RSS_GROWTH_LIMIT = 0.10
BASELINE_SAMPLES = 5
WORDS = (
    "river", "stone", "cloud", "lamp", "orbit", "garden", "copper", "violin", "harbor",
    "maple", "signal", "desert", "lantern", "meadow", "prism", "falcon", "ember", "glacier",
    "quartz", "thunder", "willow", "canyon", "beacon", "compass", "velvet",
)  # fmt: skip
DIALECTS = ("chat", "claude", "responses", "ollama")
FATES = ("complete", "complete", "cancel", "disconnect")
SHARED_PREFIX = " ".join(random.Random(0).choice(WORDS) for _ in range(300))


@dataclass
class Outcomes:
    counts: Counter[str] = field(default_factory=Counter)
    unclean: list[str] = field(default_factory=list)
    refusals: Counter[str] = field(default_factory=Counter)  # "status: message" -> count
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, kind: str, detail: str = "") -> None:
        with self.lock:
            self.counts[kind] += 1
            if kind == "unclean":
                self.unclean.append(detail[:400])
            if kind in ("refused", "failed_clean"):
                self.refusals[detail[:160]] += 1


def request_body(dialect: str, prompt: str, max_tokens: int) -> tuple[str, dict[str, Any]]:
    messages = [{"role": "user", "content": prompt}]
    if dialect == "chat":
        return "/v1/chat/completions", {
            "model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": max_tokens,
            "temperature": 0.7, "seed": len(prompt), "stream": True,
        }  # fmt: skip
    if dialect == "claude":
        return "/v1/messages", {
            "model": DEFAULT_MODEL_ID, "messages": messages, "max_tokens": max_tokens,
            "stream": True,
        }  # fmt: skip
    if dialect == "responses":
        # OpenAI's Responses API takes max_output_tokens >= 16 (a smaller one is a 400).
        return "/v1/responses", {
            "model": DEFAULT_MODEL_ID, "input": prompt,
            "max_output_tokens": max(max_tokens, RESPONSES_MIN_OUTPUT_TOKENS),
            "stream": True,
        }  # fmt: skip
    return "/ollama/api/chat", {
        "model": DEFAULT_MODEL_ID, "messages": messages, "stream": True,
        "options": {"num_predict": max_tokens},
    }  # fmt: skip


def generation_id(dialect: str, event: dict[str, Any]) -> str | None:
    """The id `POST /v1/cancel/{id}` takes, from a stream event that carries it."""
    if dialect == "chat":
        return event.get("id")
    if dialect == "claude" and event.get("type") == "message_start":
        return event["message"]["id"]
    if dialect == "responses" and event.get("type") == "response.created":
        return event["response"]["id"]
    return None


def stream_end(dialect: str, line: str, event: dict[str, Any] | None) -> str | None:
    """ "end" or "error" when this stream line ends the stream in the dialect, else None."""
    if event is not None and ("error" in event or event.get("type") in ("error",)):
        return "error"
    if dialect == "chat":
        return "end" if line == "data: [DONE]" else None
    if dialect == "claude":
        return "end" if event is not None and event.get("type") == "message_stop" else None
    if dialect == "responses":
        ends = ("response.completed", "response.incomplete", "response.failed")
        return "end" if event is not None and event.get("type") in ends else None
    return "end" if event is not None and event.get("done") is True else None


def parse(dialect: str, line: str) -> dict[str, Any] | None:
    text = line if dialect == "ollama" else line.removeprefix("data: ")
    if dialect != "ollama" and not line.startswith("data: "):
        return None
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def one_request(
    client: httpx.Client, rng: random.Random, outcomes: Outcomes, url: str, max_tokens: int = 48
) -> None:
    """One request of the soak's mix (dialect, prompt and fate drawn from `rng`), its end
    counted in `outcomes`; it asks for 4 to `max_tokens` tokens."""
    dialect = rng.choice(DIALECTS)
    fate = rng.choice(FATES)
    if fate == "cancel" and dialect == "ollama":  # Ollama's stream carries no id
        fate = "disconnect"
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(5, 120)))
    prompt = f"{SHARED_PREFIX} {words}" if rng.random() < 0.3 else f"Tell a story about {words}"
    path, body = request_body(dialect, prompt, rng.randint(4, max(4, max_tokens)))
    act_after = rng.randint(1, 6)
    chunks = 0
    sent = time.monotonic()
    cancelled = False
    gen_id: str | None = None
    try:
        with client.stream("POST", f"{url}{path}", json=body) as response:
            if response.status_code != 200:
                text = response.read().decode(errors="replace")
                shaped = text.startswith("{") and "error" in text
                outcomes.add("refused" if shaped else "unclean", f"{response.status_code} {text}")
                return
            for line in response.iter_lines():
                if not line.strip():
                    continue
                event = parse(dialect, line)
                if event is not None:
                    gen_id = gen_id or generation_id(dialect, event)
                end = stream_end(dialect, line, event)
                if end is not None:
                    kind = "failed_clean" if end == "error" else "completed"
                    outcomes.add("cancelled" if cancelled else kind, line)
                    return
                chunks += 1
                if chunks >= act_after and fate == "disconnect":
                    outcomes.add("disconnected")
                    return  # leaving the block closes the connection mid-stream
                if chunks >= act_after and fate == "cancel" and not cancelled and gen_id:
                    answer = client.post(f"{url}/v1/cancel/{gen_id}", timeout=30)
                    # 404: it had already finished (a short answer) — a clean race.
                    if answer.status_code not in (200, 404):
                        outcomes.add("unclean", f"cancel {answer.status_code} {answer.text}")
                    cancelled = True
            outcomes.add("unclean", f"{dialect} stream stopped without its end ({chunks} chunks)")
    except httpx.HTTPError as error:
        waited = time.monotonic() - sent
        outcomes.add(
            "unclean", f"{dialect} {fate}: {error!r} after {waited:.0f} s and {chunks} chunks"
        )


def client_address(index: int) -> str:
    """Stream `index`'s own loopback source address (127.0.0.2, 127.0.0.3, ...). The node
    tells clients apart by address (no API key on loopback), so each stream is a client of
    its own, as `--streams` users would be, and the per-client limits
    (`--max-generations-per-client`, `--rate-limit`) count it alone; one address for all
    would be one client running every stream, which trips that limit by design."""
    return f"127.0.0.{2 + index}"


def client_loop(
    index: int, seed: int, deadline: float, outcomes: Outcomes, url: str
) -> None:  # fmt: skip
    rng = random.Random(seed * 1000 + index)
    transport = httpx.HTTPTransport(local_address=client_address(index))
    with httpx.Client(timeout=CLIENT_TIMEOUT_SECONDS, transport=transport) as client:
        while time.monotonic() < deadline:
            one_request(client, rng, outcomes, url)


def process_figures(process: psutil.Process) -> dict[str, int]:
    return {"rss": process.memory_info().rss, "fds": process.num_fds()}


def kv_cache_tokens(url: str) -> dict[str, float]:
    """The node's runners' KV cache from `/metrics`: tokens held by running requests
    (`running`) and by the prefix cache (`prefix_cache`), and the `budget`, each summed over
    runners; empty if the node does not answer within 10 s."""
    try:
        text = httpx.get(f"{url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return {}
    figures: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for metric in family.samples:
            if metric.name == "exo_kv_cache_tokens":
                key = metric.labels.get("holder", "running")
            elif metric.name == "exo_kv_cache_budget_tokens":
                key = "budget"
            else:
                continue
            figures[key] = figures.get(key, 0.0) + metric.value
    return figures


def sample(node: ExoNode) -> dict[str, Any]:
    assert node.process is not None
    row: dict[str, Any] = {"t": time.monotonic(), "node": process_figures(
        psutil.Process(node.process.pid))}  # fmt: skip
    row["runners"] = {}
    for runner in node.runner_processes():
        try:
            row["runners"][str(runner.pid)] = process_figures(runner)
        except psutil.Error:
            continue
    row["kv"] = kv_cache_tokens(node.url)
    return row


def growth(samples: list[dict[str, int]]) -> dict[str, Any]:
    start = samples[:BASELINE_SAMPLES]
    end = samples[-BASELINE_SAMPLES:]
    rss_start = statistics.median(s["rss"] for s in start)
    rss_end = statistics.median(s["rss"] for s in end)
    fds_start = statistics.median(s["fds"] for s in start)
    fds_end = statistics.median(s["fds"] for s in end)
    return {
        "rss_start_mib": rss_start / 2**20,
        "rss_end_mib": rss_end / 2**20,
        "rss_max_mib": max(s["rss"] for s in samples) / 2**20,
        "rss_growth": (rss_end - rss_start) / rss_start,
        "fds_start": fds_start,
        "fds_end": fds_end,
        "fds_max": max(s["fds"] for s in samples),
        "samples": len(samples),
    }


def soak(node: ExoNode, arguments: argparse.Namespace) -> dict[str, Any]:
    started = time.monotonic()
    deadline = started + arguments.minutes * 60
    warmup = arguments.warmup_minutes
    if warmup is None:
        warmup = max(1.0, arguments.minutes / 5)
    outcomes = Outcomes()
    threads = [
        threading.Thread(
            target=client_loop, args=(i, arguments.seed, deadline, outcomes, node.url), daemon=True
        )
        for i in range(arguments.streams)
    ]
    for thread in threads:
        thread.start()
    samples: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        samples.append(sample(node))
        elapsed = time.monotonic() - started
        last = samples[-1]
        runners = ", ".join(
            f"runner {pid} {r['rss'] / 2**20:.0f} MiB {r['fds']} fds"
            for pid, r in last["runners"].items()
        )
        kv = last["kv"]
        print(
            f"{elapsed / 60:5.1f} min: node {last['node']['rss'] / 2**20:.0f} MiB "
            f"{last['node']['fds']} fds; {runners}; KV tokens running "
            f"{kv.get('running', 0):.0f} + prefix cache {kv.get('prefix_cache', 0):.0f} of "
            f"{kv.get('budget', 0):.0f}; requests {dict(outcomes.counts)}",
            flush=True,
        )
        time.sleep(min(arguments.sample_seconds, max(0.0, deadline - time.monotonic())))
    for thread in threads:
        thread.join(timeout=CLIENT_TIMEOUT_SECONDS + 30)
    hung = sum(thread.is_alive() for thread in threads)
    samples.append(sample(node))
    after_warmup = [s for s in samples if s["t"] - started >= warmup * 60]
    runner_pids = sorted({pid for s in samples for pid in s["runners"]})
    processes: dict[str, Any] = {"node": growth([s["node"] for s in after_warmup])}
    for pid in runner_pids:
        rows = [s["runners"][pid] for s in after_warmup if pid in s["runners"]]
        if len(rows) >= 2 * BASELINE_SAMPLES:
            processes[f"runner {pid}"] = growth(rows)
    verdicts = {
        "every request ended cleanly": not outcomes.unclean and hung == 0,
        "RSS growth < 10% after warm-up": all(
            p["rss_growth"] < RSS_GROWTH_LIMIT for p in processes.values()
        ),
        "no fd growth after warm-up": all(
            p["fds_end"] <= p["fds_start"] for p in processes.values()
        ),
        "no runner replaced": len(runner_pids) == 1,
        "no 429 (per-client limits)": not any(
            detail.startswith("429 ") for detail in outcomes.refusals
        ),
        "runner sampled after warm-up": len(processes) >= 2,
    }
    return {
        "minutes": arguments.minutes,
        "warmup_minutes": warmup,
        "streams": arguments.streams,
        "seed": arguments.seed,
        "requests": dict(outcomes.counts),
        "unclean": outcomes.unclean[:20],
        "refusals": dict(outcomes.refusals.most_common(10)),
        "client_threads_hung": hung,
        "runner_pids": runner_pids,
        "processes": processes,
        "verdicts": verdicts,
        "passed": all(verdicts.values()),
        "timeline": [
            {
                "minute": (s["t"] - started) / 60,
                "node_rss_mib": s["node"]["rss"] / 2**20,
                "node_fds": s["node"]["fds"],
                "kv_cache_tokens": s["kv"],
                "runners": {
                    pid: {"rss_mib": r["rss"] / 2**20, "fds": r["fds"]}
                    for pid, r in s["runners"].items()
                },
            }
            for s in samples
        ],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--warmup-minutes", type=float, default=None)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--seed", type=int, default=17)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--models-dir", type=Path, default=None)
    arguments = parser.parse_args()
    if not 1 <= arguments.streams <= 253:
        parser.error("--streams must be 1 to 253 (one loopback address each)")
    # SIGTERM (timeout, kill) unwinds like Ctrl-C, so the node below is stopped, not orphaned.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with tempfile.TemporaryDirectory(prefix="exo-soak-") as home:
        node = ExoNode(Path(home), arguments.models_dir or default_models_dir(), ("-q",))
        node.start()
        try:
            node.wait_ready()
            result = soak(node, arguments)
            alive = httpx.get(f"{node.url}/node_id", timeout=10).status_code == 200
            result["verdicts"]["node answers after the soak"] = alive
            result["passed"] = result["passed"] and alive
        finally:
            node.stop()
    print(f"requests: {result['requests']} (client threads hung: {result['client_threads_hung']})")
    for detail in result["unclean"]:
        print(f"  unclean: {detail}")
    for detail, count in result["refusals"].items():
        print(f"  refused or failed cleanly x{count}: {detail}")
    for name, figures in result["processes"].items():
        print(
            f"{name}: RSS {figures['rss_start_mib']:.0f} -> {figures['rss_end_mib']:.0f} MiB "
            f"({figures['rss_growth'] * 100:+.1f}%, max {figures['rss_max_mib']:.0f}), fds "
            f"{figures['fds_start']:.0f} -> {figures['fds_end']:.0f} (max {figures['fds_max']})"
        )
    for verdict, ok in result["verdicts"].items():
        print(f"{'PASS' if ok else 'FAIL'}: {verdict}")
    if arguments.json is not None:
        arguments.json.write_text(json.dumps(result, indent=2))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
