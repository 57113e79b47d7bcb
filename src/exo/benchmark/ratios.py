"""A bench report's comparisons, from its cases: exo over llama.cpp, the API over the engine
in-process, each multi-node placement over one node; printed with the speed predictions
against what was measured."""

from __future__ import annotations

from exo.benchmark.stats import BenchReport, Print, ratio


def add_ratios(report: BenchReport) -> None:
    """The report's comparisons, from its cases: exo over llama.cpp (decode, prefill), API
    over the engine in-process (decode), and each multi-node placement over the single one
    (aggregate decode), per (prompt, generation, concurrency)."""
    for case in report.cases:
        if case.engine != "exo":
            continue
        same = {
            "prompt_tokens": case.prompt_tokens,
            "generation_tokens": case.generation_tokens,
        }
        tag = f"prompt {case.prompt_tokens}, gen {case.generation_tokens}, x{case.concurrency}"
        if case.placement == "single" and case.concurrency == 1:
            llama = report.case(engine="llama.cpp", **same)
            if llama is not None:
                report.ratios.append(
                    ratio(f"decode vs llama.cpp ({tag})", "decode_tok_s", case, llama, 1.0)
                )
                report.ratios.append(
                    ratio(f"prefill vs llama.cpp ({tag})", "prefill_tok_s", case, llama, 2.0)
                )
        if case.placement == "single":
            engine = report.case(engine="exo-engine", concurrency=case.concurrency, **same)
            if engine is not None:
                report.ratios.append(
                    ratio(f"API decode vs engine ({tag})", "decode_tok_s", case, engine, 0.95)
                )
            continue
        single = report.case(engine="exo", placement="single", concurrency=case.concurrency, **same)
        if single is not None:
            # The targets: pipeline x2 with 4 streams, tensor x2 on one stream.
            target = None
            if case.placement.startswith("pipeline") and case.concurrency >= 4:
                target = 1.6
            elif case.placement.startswith("tensor") and case.concurrency == 1:
                target = 1.3
            name = f"{case.placement} vs single ({tag})"
            report.ratios.append(ratio(name, "aggregate_decode_tok_s", case, single, target))


def print_ratios(report: BenchReport, say: Print = print) -> None:
    for item in report.ratios:
        target = f"  (target >= {item.target:g})" if item.target is not None else ""
        say(f"{item.name}: {item.value:.2f}x{target}")
    for case in report.cases:
        for figure, predicted in case.predicted.items():
            measured = case.summary.get(figure)
            if measured is None or not measured.median:
                continue
            note = " (single-stream prediction)" if case.concurrency > 1 else ""
            say(
                f"{case.label} prompt {case.prompt_tokens} x{case.concurrency}: {figure} "
                f"predicted {predicted:.3g}, measured {measured.median:.3g} "
                f"(predicted / measured - 1: {(predicted / measured.median - 1) * 100:+.0f}%)"
                f"{note}"
            )
