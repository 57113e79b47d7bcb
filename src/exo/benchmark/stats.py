"""Statistics and the JSON report of `exo bench`.

A case is one (engine, model, placement, prompt length, generation length, concurrency)
measured `runs` times after warm-up; each figure is summarised by its median and spread
(min, max and the interquartile range).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# Where a bench prints its lines (`print`, or a test's collector).
Print = Callable[[str], None]

Engine = Literal["exo", "llama.cpp", "exo-engine"]


class Spread(BaseModel):
    """Median and spread of one figure over the runs of a case (same unit as the figure).

    `q1` / `q3` are the quartiles by the "inclusive" method (`statistics.quantiles`, linear
    interpolation between order statistics, as numpy's default percentile), so a single run
    has q1 = median = q3."""

    model_config = ConfigDict(frozen=True)

    n: int
    median: float
    min: float
    max: float
    q1: float
    q3: float

    @property
    def relative_iqr(self) -> float:
        """(q3 - q1) / median: the spread as a fraction of the median (0 when median is 0)."""
        return (self.q3 - self.q1) / self.median if self.median else 0.0


def summarize(values: Sequence[float]) -> Spread:
    """Median, min, max and quartiles of `values`.

    Raises:
        ValueError: `values` is empty or holds a NaN or infinity.
    """
    if not values:
        raise ValueError("no values to summarise")
    if not all(math.isfinite(value) for value in values):
        raise ValueError(f"values must be finite, got {list(values)}")
    ordered = sorted(float(value) for value in values)
    if len(ordered) == 1:
        q1 = q3 = ordered[0]
    else:
        q1, _, q3 = statistics.quantiles(ordered, n=4, method="inclusive")
    return Spread(
        n=len(ordered),
        median=statistics.median(ordered),
        min=ordered[0],
        max=ordered[-1],
        q1=q1,
        q3=q3,
    )


class RequestTiming(BaseModel):
    """One generation request as its client saw it (seconds from the run's start)."""

    model_config = ConfigDict(frozen=True)

    prompt_tokens: int
    completion_tokens: int
    submitted_s: float
    first_token_s: float
    last_token_s: float
    finish_reason: str | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.submitted_s

    @property
    def decode_tok_s(self) -> float:
        """Tokens after the first / time from the first token to the last."""
        seconds = self.last_token_s - self.first_token_s
        return (self.completion_tokens - 1) / seconds if seconds > 0 else 0.0


class RunResult(BaseModel):
    """One run of a case: `concurrency` requests submitted together."""

    model_config = ConfigDict(frozen=True)

    requests: list[RequestTiming]

    @property
    def ttft_s(self) -> float:
        """Median TTFT of the run's requests (seconds)."""
        return statistics.median(request.ttft_s for request in self.requests)

    @property
    def prefill_tok_s(self) -> float:
        """Prompt tokens of every request / time from the first submission to the last first
        token: the rate at which the run's prompts were prefilled (tok/s)."""
        start = min(request.submitted_s for request in self.requests)
        end = max(request.first_token_s for request in self.requests)
        tokens = sum(request.prompt_tokens for request in self.requests)
        return tokens / (end - start) if end > start else 0.0

    @property
    def decode_tok_s(self) -> float:
        """Median decode tok/s of one stream of the run."""
        return statistics.median(request.decode_tok_s for request in self.requests)

    @property
    def aggregate_decode_tok_s(self) -> float:
        """Tokens after each request's first, summed over the requests / time from the
        earliest first token to the latest last token (tok/s of the whole batch; equals
        `decode_tok_s` for one request)."""
        start = min(request.first_token_s for request in self.requests)
        end = max(request.last_token_s for request in self.requests)
        tokens = sum(request.completion_tokens - 1 for request in self.requests)
        return tokens / (end - start) if end > start else 0.0


class CaseResult(BaseModel):
    """Every run of one case, their summaries, and what the nodes used."""

    engine: Engine
    model: str
    placement: str
    """"single", "pipeline x2", "tensor x2", ... (the llama.cpp rows: "single")."""
    pinned: bool
    threads: int | None
    prompt_tokens: int
    generation_tokens: int
    concurrency: int
    runs: list[RunResult]
    summary: dict[str, Spread] = Field(default_factory=dict)
    peak_memory_bytes: dict[str, int] = Field(default_factory=dict)
    """Per node (id or label): the peak RSS of the node and its runners during the case."""
    predicted: dict[str, float] = Field(default_factory=dict)
    """The placement preview's prediction (`decode_tok_s`, `ttft_s`), when it gives one."""

    def summarise(self) -> CaseResult:
        """This case with `summary` filled from its runs."""
        figures = {
            "ttft_s": [run.ttft_s for run in self.runs],
            "prefill_tok_s": [run.prefill_tok_s for run in self.runs],
            "decode_tok_s": [run.decode_tok_s for run in self.runs],
            "aggregate_decode_tok_s": [run.aggregate_decode_tok_s for run in self.runs],
        }
        summary = {name: summarize(values) for name, values in figures.items() if values}
        return self.model_copy(update={"summary": summary})

    @property
    def label(self) -> str:
        pin = ", pinned" if self.pinned else ""
        return f"{self.engine} {self.placement}{pin}"


class Ratio(BaseModel):
    """A figure of one case over the same figure of another (medians)."""

    name: str
    figure: str
    numerator: str
    denominator: str
    value: float
    target: float | None = None


class BenchReport(BaseModel):
    """What `exo bench` writes as JSON."""

    started_at: str
    finished_at: str | None = None
    machine: dict[str, Any]
    settings: dict[str, Any]
    cases: list[CaseResult] = Field(default_factory=list)
    ratios: list[Ratio] = Field(default_factory=list)
    notes: list[str] = Field(default_factory=list)

    def case(self, **match: Any) -> CaseResult | None:
        """The first case whose fields equal `match`."""
        for case in self.cases:
            if all(getattr(case, name) == value for name, value in match.items()):
                return case
        return None


def ratio(
    name: str, figure: str, numerator: CaseResult, denominator: CaseResult, target: float | None
) -> Ratio:
    """`figure`'s median in `numerator` over its median in `denominator`.

    Raises:
        KeyError: a case has no summary of `figure`.
    """
    top = numerator.summary[figure].median
    bottom = denominator.summary[figure].median
    return Ratio(
        name=name,
        figure=figure,
        numerator=numerator.label,
        denominator=denominator.label,
        value=top / bottom if bottom else math.inf,
        target=target,
    )


def write_json(report: BenchReport, path: Path) -> None:
    """Write `report` to `path` atomically (a temporary file renamed over it), so a reader
    never sees half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report.model_dump(mode="json"), indent=2, allow_nan=False)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "w") as file:
            file.write(text + "\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
