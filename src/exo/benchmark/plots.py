"""PNG plots of a bench report (matplotlib, the `bench` extra)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from exo.benchmark.stats import BenchReport, CaseResult


class PlotsUnavailableError(RuntimeError):
    """matplotlib is not installed."""


def require_matplotlib() -> None:
    """Check before a run starts that plots can be drawn at its end.

    Raises:
        PlotsUnavailableError: matplotlib is missing (the message says how to install it).
    """
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotsUnavailableError(
            "exo bench draws its plots with matplotlib, which is not installed: "
            "pip install 'exo[bench]' (or run with --no-plots; the JSON is written either way)"
        ) from None


def _decode_figure(case: CaseResult) -> str:
    return "aggregate_decode_tok_s" if case.concurrency > 1 else "decode_tok_s"


def plot_report(report: BenchReport, path: Path, title: str) -> Path:
    """Bars of decode tok/s, prefill tok/s and TTFT per case (median; whiskers: min and
    max over the runs), one group per (prompt, generation, concurrency).

    Raises:
        PlotsUnavailableError: matplotlib is missing.
    """
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    groups: dict[str, list[CaseResult]] = {}
    for case in report.cases:
        key = f"prompt {case.prompt_tokens}\ngen {case.generation_tokens} x{case.concurrency}"
        groups.setdefault(key, []).append(case)
    labels = sorted({case.label for case in report.cases})
    panels = (
        ("decode tok/s (x>1: all streams)", _decode_figure, 1.0),
        ("prefill tok/s", lambda _case: "prefill_tok_s", 1.0),
        ("TTFT (ms)", lambda _case: "ttft_s", 1000.0),
    )
    figure, axes = pyplot.subplots(1, 3, figsize=(15, 4.8))
    width = 0.8 / max(1, len(labels))
    colors: Any = pyplot.get_cmap("tab10")
    for axis, (name, figure_of, scale) in zip(axes, panels, strict=True):
        for index, label in enumerate(labels):
            xs, heights, low, high = [], [], [], []
            for position, cases in enumerate(groups.values()):
                for case in cases:
                    spread = case.summary.get(figure_of(case))
                    if case.label != label or spread is None:
                        continue
                    xs.append(position + (index - (len(labels) - 1) / 2) * width)
                    heights.append(spread.median * scale)
                    low.append((spread.median - spread.min) * scale)
                    high.append((spread.max - spread.median) * scale)
            if xs:
                axis.bar(xs, heights, width, yerr=[low, high], capsize=2,
                         label=label, color=colors(index % 10))  # fmt: skip
        axis.set_xticks(range(len(groups)), list(groups), fontsize=8)
        axis.set_title(name)
        axis.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    load = report.machine.get("load_average_at_start", [0.0])[0]
    figure.suptitle(f"{title} (median, whiskers min-max; load average at start {load:.1f})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
    return path
