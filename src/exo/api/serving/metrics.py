"""Prometheus metrics of one node (`GET /metrics`, text format, through `prometheus_client`).

Measured by this node's API, with one registry per app (so several apps in one process keep
their own counts):
- `exo_http_requests_total{method, route, status}`: every answer, by route template (never
  the raw path, so ids do not multiply the series) and status; `exo_http_request_duration_
  seconds{route}`.
- `exo_api_generations_in_flight`: generation requests this node is serving now.
- `exo_prompt_tokens_total{model}`, `exo_generation_tokens_total{model}`: from the usage
  of every finished generation this node served.
- `exo_time_to_first_token_seconds{model}`: from the request's arrival to its first token
  reaching the API; `exo_inter_token_latency_seconds{model}`: the gap between tokens as
  they reach the API (a chunk of n tokens counts n gaps of a nth of its wait).
- `exo_prefill_prompt_tokens{model}` / `exo_prefill_prefilled_tokens{model}`: the prompts of
  the generations this node serves that the engine admitted and that have no first token
  yet, and how much of them is prefilled (from the runners' `PrefillProgressChunk`s, at
  most `generation_feed.PREFILL_PROGRESS_SECONDS` old): a long prompt's progress.

Read from the cluster state at each scrape (the same on every node):
- `exo_requests_queued{model}` / `exo_requests_running{model}`: generation tasks pending /
  running on the cluster's runners; `exo_api_admitted_generations{model}` /
  `exo_api_waiting_generations{model}`: this node's admission (`exo.api.serving.admission`).
- `exo_runners{node, status}`: runners by status (`RunnerReady`, `RunnerLoading`, ...).
- `exo_download_downloaded_bytes{node, model}` / `exo_download_total_bytes{node, model}`:
  downloads in progress.
- `exo_link_latency_seconds{source, sink}` / `exo_link_bandwidth_bytes_per_second{source,
  sink}`: measured links between nodes.
- `exo_event_index`: the last cluster event this node applied; `exo_event_replay_lag`:
  events the elected master holds that this node has not applied yet.

Kept by this node's brute-force throttle (`exo.api.guards.throttle`):
- `exo_auth_failures_total`: requests refused for a credential that is not valid (API key,
  session cookie, peer credential, `POST /auth/session`'s key), from addresses that need a
  key; `exo_auth_lockouts_total`: lockouts begun; `exo_auth_throttled_requests_total`:
  requests answered 429 because their address was locked out.
- `exo_auth_locked_addresses`: addresses locked out now; `exo_auth_tracked_addresses`:
  addresses with failures on record (at most `MAX_TRACKED_ADDRESSES`).

Reported by this node's own runners (node-local, not in the cluster state):
- `exo_kv_cache_tokens{runner, model, holder}`: KV-cache tokens held by running requests
  (`holder="running"`) and by the prefix cache (`"prefix_cache"`), in the budget's tokens
  (a sliding-window layer counts the positions it keeps: `batching/kv_footprint.py`);
  `exo_kv_cache_budget_tokens{runner, model}`: the budget they share. A runner appears once
  it has served a request; figures are at most `runner.KV_REPORT_INTERVAL_S` old.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.guards.limits import is_generation
from exo.api.guards.throttle import AuthThrottle
from exo.shared.types.chunks import Chunk, PrefillProgressChunk, TokenChunk
from exo.shared.types.common import ModelId
from exo.shared.types.nodes import DownloadOngoing
from exo.shared.types.runners import KVCacheUse, RunnerReady, RunnerRunning, SpeculationStats
from exo.shared.types.state import State
from exo.shared.types.tasks import TaskPending, TaskRunning

# Seconds. TTFT spans a cached short prompt (tens of ms) to a model loaded on request
# (minutes); inter-token gaps span a GPU's few ms to a CPU split over slow links.
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
INTER_TOKEN_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (0.005, 0.025, 0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0)
UNMATCHED_ROUTE = "unmatched"
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class AdmissionCounts(Protocol):
    """This node's admission of generations (`exo.api.serving.admission.Admission`)."""

    def in_flight(self, model: ModelId) -> int: ...

    def waiting(self, model: ModelId) -> int: ...


class ApiMetrics:
    """The metrics of one app, in their own registry.

    Args:
        current_state: the node's cluster state now.
        master_event_index: the last event index the elected master announced (None while
            unknown); None: no replay-lag metric.
        admission: this node's admission, for its in-flight and waiting counts per model.
        auth_throttle: the brute-force throttle whose counts to export (None: none).
    """

    def __init__(
        self,
        current_state: Callable[[], State],
        master_event_index: Callable[[], int | None] | None = None,
        admission: AdmissionCounts | None = None,
        kv_cache: Callable[[], list[KVCacheUse]] = list,
        auth_throttle: AuthThrottle | None = None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.requests = Counter(
            "exo_http_requests",
            "HTTP requests answered, by route template and status",
            ("method", "route", "status"),
            registry=registry,
        )
        self.request_seconds = Histogram(
            "exo_http_request_duration_seconds",
            "Time from a request's arrival to the end of its answer",
            ("route",),
            buckets=REQUEST_BUCKETS,
            registry=registry,
        )
        self.generations_in_flight = Gauge(
            "exo_api_generations_in_flight",
            "Generation requests this node's API is serving now",
            registry=registry,
        )
        self.prompt_tokens = Counter(
            "exo_prompt_tokens",
            "Prompt tokens of the generations this node served",
            ("model",),
            registry=registry,
        )
        self.generation_tokens = Counter(
            "exo_generation_tokens",
            "Generated tokens of the generations this node served",
            ("model",),
            registry=registry,
        )
        self.time_to_first_token = Histogram(
            "exo_time_to_first_token_seconds",
            "From a generation request's arrival to its first token reaching the API",
            ("model",),
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.prefill_prompt_tokens = Gauge(
            "exo_prefill_prompt_tokens",
            "Prompt tokens of admitted generations this node serves that have no token yet",
            ("model",),
            registry=registry,
        )
        self.prefill_prefilled_tokens = Gauge(
            "exo_prefill_prefilled_tokens",
            "How many of those prompt tokens are prefilled (prefix-cached ones included)",
            ("model",),
            registry=registry,
        )
        self.inter_token_latency = Histogram(
            "exo_inter_token_latency_seconds",
            "Time between consecutive tokens reaching the API",
            ("model",),
            buckets=INTER_TOKEN_BUCKETS,
            registry=registry,
        )
        registry.register(StateCollector(current_state, master_event_index, admission, kv_cache))
        if auth_throttle is not None:
            registry.register(AuthThrottleCollector(auth_throttle))


class AuthThrottleCollector(Collector):
    """The brute-force throttle's counts, read at each scrape."""

    def __init__(self, throttle: AuthThrottle) -> None:
        self._throttle = throttle

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        throttle = self._throttle
        counters = (
            ("exo_auth_failures", "Requests refused for a credential that is not valid",
             throttle.failures_total),
            ("exo_auth_lockouts", "Addresses locked out after repeated failed credentials",
             throttle.lockouts_total),
            ("exo_auth_throttled_requests", "Requests answered 429 during a lockout",
             throttle.refusals_total),
        )  # fmt: skip
        for name, documentation, value in counters:
            counter = CounterMetricFamily(name, documentation)
            counter.add_metric((), value)
            yield counter
        yield GaugeMetricFamily(
            "exo_auth_locked_addresses",
            "Client addresses locked out now after failed credentials",
            value=throttle.locked_addresses(),
        )
        yield GaugeMetricFamily(
            "exo_auth_tracked_addresses",
            "Client addresses with failed credentials on record",
            value=throttle.tracked_addresses,
        )


class StateCollector(Collector):
    """Gauges read from the cluster state (and this node's admission) at each scrape."""

    def __init__(
        self,
        current_state: Callable[[], State],
        master_event_index: Callable[[], int | None] | None,
        admission: AdmissionCounts | None = None,
        kv_cache: Callable[[], list[KVCacheUse]] = list,
    ) -> None:
        self._current_state = current_state
        self._master_event_index = master_event_index
        self._admission = admission
        self._kv_cache = kv_cache

    def describe(self) -> list[Metric]:
        return []  # collected fresh each scrape; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        state = self._current_state()
        yield from _task_gauges(state)
        if self._admission is not None:
            yield from _admission_gauges(state, self._admission)
        yield from _kv_cache_gauges(self._kv_cache())
        yield from _speculation_gauges(state)
        runners = GaugeMetricFamily(
            "exo_runners", "Runners by node and status", labels=("node", "status")
        )
        counts: dict[tuple[str, str], int] = {}
        for runner_id, status in state.runners.items():
            key = (str(state.runner_nodes.get(runner_id, "")), status.kind)
            counts[key] = counts.get(key, 0) + 1
        for (node, kind), count in sorted(counts.items()):
            runners.add_metric((node, kind), count)
        yield runners
        yield from _gauges(
            ("node", "model"),
            (
                (
                    "exo_download_downloaded_bytes",
                    "Bytes downloaded so far of each download in progress",
                ),
                ("exo_download_total_bytes", "Bytes in all of each download in progress"),
            ),
            (
                ((node, model), (download.progress.downloaded_bytes, download.progress.total_bytes))
                for node, models in sorted(state.downloads.items())
                for model, download in sorted(models.items())
                if isinstance(download, DownloadOngoing) and download.progress is not None
            ),
        )
        yield from _gauges(
            ("source", "sink"),
            (
                ("exo_link_latency_seconds", "Measured round trip between two nodes' APIs"),
                (
                    "exo_link_bandwidth_bytes_per_second",
                    "Measured bandwidth from a node to another",
                ),
            ),
            (
                ((source, sink), (edge.latency_ms / 1000, edge.bandwidth_mbps * 1e6 / 8))
                for source, edges in sorted(state.topology.items())
                for sink, edge in sorted(edges.items())
            ),
        )
        applied = state.last_event_applied_idx
        yield GaugeMetricFamily(
            "exo_event_index", "Index of the last cluster event this node applied", value=applied
        )
        if self._master_event_index is not None:
            master = self._master_event_index()
            if master is not None:
                yield GaugeMetricFamily(
                    "exo_event_replay_lag",
                    "Events the elected master holds that this node has not applied",
                    value=max(0, master - applied),
                )


def _gauges(
    labels: tuple[str, ...],
    descriptions: Sequence[tuple[str, str]],
    rows: Iterable[tuple[Sequence[str], Sequence[float]]],
) -> list[GaugeMetricFamily]:
    """Gauge families that share their labels, one per (name, help text) of
    `descriptions`: each row is a set of label values and one value per family, in the
    order of `descriptions`."""
    families = [GaugeMetricFamily(name, text, labels=labels) for name, text in descriptions]
    for label_values, values in rows:
        for family, value in zip(families, values, strict=True):
            family.add_metric(label_values, value)
    return families


def _task_gauges(state: State) -> Iterator[Metric]:
    counts: dict[tuple[str, str], int] = {}
    for task in state.tasks.values():
        if isinstance(task.status, TaskPending | TaskRunning):
            key = (task.params.model, task.status.kind)
            counts[key] = counts.get(key, 0) + 1
    models = sorted({model for model, _ in counts} | {i.model_id for i in state.instances.values()})
    yield from _gauges(
        ("model",),
        (
            ("exo_requests_queued", "Generation tasks waiting for their runner"),
            ("exo_requests_running", "Generation tasks running on their runner"),
        ),
        (
            (
                (model,),
                (counts.get((model, "TaskPending"), 0), counts.get((model, "TaskRunning"), 0)),
            )
            for model in models
        ),
    )


def _kv_cache_gauges(uses: list[KVCacheUse]) -> Iterator[Metric]:
    held = GaugeMetricFamily(
        "exo_kv_cache_tokens",
        "KV-cache tokens held by this node's runners: by running requests or the prefix cache",
        labels=("runner", "model", "holder"),
    )
    budget = GaugeMetricFamily(
        "exo_kv_cache_budget_tokens",
        "KV-cache budget of each of this node's runners (running requests and prefix cache)",
        labels=("runner", "model"),
    )
    for use in uses:
        held.add_metric((use.runner_id, use.model_id, "running"), use.running_tokens)
        held.add_metric((use.runner_id, use.model_id, "prefix_cache"), use.prefix_cache_tokens)
        budget.add_metric((use.runner_id, use.model_id), use.budget_tokens)
    yield held
    yield budget


def _speculation_gauges(state: State) -> Iterator[Metric]:
    """Each runner's speculative decoding, from its status in the state
    (`SpeculationStats`; runners that have not measured a value are left out), labelled
    with its draft source: its draft model (`RunnerReady.draft_model`) or "ngram"."""
    models = {
        runner_id: str(instance.shard_assignments.model_id)
        for instance in state.instances.values()
        for runner_id in instance.shard_assignments.runner_to_shard
    }
    rows: list[tuple[tuple[str, str, str], SpeculationStats]] = []
    for runner_id, status in sorted(state.runners.items()):
        if isinstance(status, RunnerReady | RunnerRunning) and status.speculation is not None:
            source = status.draft_model or "ngram"
            labels = (str(runner_id), models.get(runner_id, ""), source)
            rows.append((labels, status.speculation))
    rates = [
        (labels, stats.acceptance_rate, stats.tokens_per_step)
        for labels, stats in rows
        if stats.acceptance_rate is not None and stats.tokens_per_step is not None
    ]
    yield from _gauges(
        ("runner", "model", "draft"),
        (
            (
                "exo_speculative_acceptance_rate",
                "Share of the draft tokens a runner verified that it accepted",
            ),
            (
                "exo_speculative_tokens_per_step",
                "Tokens a decoding request gained per step on a runner, drafts or not (1 without)",
            ),
        ),
        ((labels, (acceptance, per_step)) for labels, acceptance, per_step in rates),
    )
    yield from _gauges(
        ("runner", "model", "draft"),
        (
            ("exo_speculative_drafted_tokens", "Draft tokens a runner verified"),
            ("exo_speculative_accepted_tokens", "Draft tokens a runner accepted"),
        ),
        ((labels, (stats.drafted_tokens, stats.accepted_tokens)) for labels, stats in rows),
    )


def _admission_gauges(state: State, admission: AdmissionCounts) -> Iterator[Metric]:
    yield from _gauges(
        ("model",),
        (
            (
                "exo_api_admitted_generations",
                "Generations this node admitted and has not finished (running or queued)",
            ),
            (
                "exo_api_waiting_generations",
                "Generation requests waiting on this node for a place in a full model's queue",
            ),
        ),
        (
            ((model,), (admission.in_flight(model), admission.waiting(model)))
            for model in sorted({instance.model_id for instance in state.instances.values()})
        ),
    )


# ------------------------------------------------------------------ per request


@dataclass(slots=True)
class _RequestTiming:
    metrics: ApiMetrics
    started: float
    first_token_seen: bool = False


_CURRENT_REQUEST: ContextVar[_RequestTiming | None] = ContextVar("exo_request_timing", default=None)


def observed_chunks(chunks: AsyncIterator[Chunk]) -> AsyncIterator[Chunk]:
    """`chunks`, timed and counted into the metrics of the HTTP request being served (TTFT,
    inter-token latency, tokens); `chunks` unchanged outside a request of a metered app."""
    timing = _CURRENT_REQUEST.get()
    if timing is None:
        return chunks
    return _observe(chunks, timing)


async def _observe(chunks: AsyncIterator[Chunk], timing: _RequestTiming) -> AsyncIterator[Chunk]:
    metrics = timing.metrics
    last_token_at: float | None = None
    prefill: PrefillProgressChunk | None = None  # counted in the prefill gauges now

    def count_prefill(progress: PrefillProgressChunk, sign: int) -> None:
        model = progress.model
        metrics.prefill_prompt_tokens.labels(model).inc(sign * progress.prompt_tokens)
        metrics.prefill_prefilled_tokens.labels(model).inc(sign * progress.prefilled_tokens)

    try:
        async for chunk in chunks:
            if isinstance(chunk, PrefillProgressChunk):
                if prefill is not None:
                    count_prefill(prefill, -1)
                prefill = chunk
                count_prefill(prefill, 1)
            elif prefill is not None:
                count_prefill(prefill, -1)
                prefill = None
            last_token_at = _observe_chunk(chunk, timing, last_token_at)
            yield chunk
    finally:
        if prefill is not None:
            count_prefill(prefill, -1)


def _observe_chunk(
    chunk: Chunk, timing: _RequestTiming, last_token_at: float | None
) -> float | None:
    """Count one chunk into TTFT, inter-token latency and token totals; returns the time of
    the last token seen (`last_token_at`, updated)."""
    metrics = timing.metrics
    now = time.perf_counter()
    if isinstance(chunk, TokenChunk) and (chunk.token_ids or chunk.text or chunk.reasoning_text):
        if not timing.first_token_seen:
            timing.first_token_seen = True
            metrics.time_to_first_token.labels(chunk.model).observe(now - timing.started)
        elif last_token_at is not None:
            tokens = max(1, len(chunk.token_ids))
            histogram = metrics.inter_token_latency.labels(chunk.model)
            for _ in range(tokens):
                histogram.observe((now - last_token_at) / tokens)
        last_token_at = now
    usage = getattr(chunk, "usage", None)
    if usage is not None:
        metrics.prompt_tokens.labels(chunk.model).inc(usage.prompt_tokens)
        metrics.generation_tokens.labels(chunk.model).inc(usage.completion_tokens)
    return last_token_at


def route_template(routes: Sequence[BaseRoute], scope: Scope) -> str:
    """The path template of the route that serves `scope` (`/instance/{instance_id}`), or
    `UNMATCHED_ROUTE`."""
    partial: str | None = None
    for route in routes:
        match, _ = route.matches(scope)
        path = getattr(route, "path", None)
        if match is Match.FULL and path is not None:
            return str(path) or "/"
        if match is Match.PARTIAL and partial is None and path is not None:
            partial = str(path)
    return partial or UNMATCHED_ROUTE


class MetricsMiddleware:
    """Counts and times every HTTP answer (refusals by the other middleware included), and
    makes the request's timing available to `observed_chunks`."""

    def __init__(
        self, app: ASGIApp, metrics: ApiMetrics, routes: Callable[[], Sequence[BaseRoute]]
    ) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = [500]

        async def send_and_record(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        generation = is_generation(scope["method"], scope["path"])
        if generation:
            self.metrics.generations_in_flight.inc()
        token = _CURRENT_REQUEST.set(_RequestTiming(self.metrics, started))
        try:
            await self.app(scope, receive, send_and_record)
        finally:
            _CURRENT_REQUEST.reset(token)
            if generation:
                self.metrics.generations_in_flight.dec()
            route = route_template(self.routes(), scope)
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.metrics.requests.labels(method, route, str(status[0])).inc()
            self.metrics.request_seconds.labels(route).observe(time.perf_counter() - started)
