import json
import math
import sys
from pathlib import Path

import pytest

from exo.benchmark.cli import build_parser, config_from_arguments, parse_arguments
from exo.benchmark.cluster import Placement
from exo.benchmark.ratios import add_ratios
from exo.benchmark.stats import (
    BenchReport,
    CaseResult,
    RequestTiming,
    RunResult,
    summarize,
    write_json,
)
from exo.shared.models.weight_formats import default_prefill_activations


def timing(submitted: float, first: float, last: float, tokens: int = 11) -> RequestTiming:
    return RequestTiming(
        prompt_tokens=100,
        completion_tokens=tokens,
        submitted_s=submitted,
        first_token_s=first,
        last_token_s=last,
        finish_reason="length",
    )


def test_summary_gives_median_extremes_and_inclusive_quartiles() -> None:
    spread = summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (spread.n, spread.median, spread.min, spread.max) == (5, 3.0, 1.0, 5.0)
    assert (spread.q1, spread.q3) == (2.0, 4.0)
    assert spread.relative_iqr == pytest.approx(2.0 / 3.0)
    even = summarize([1.0, 2.0, 3.0, 10.0])
    assert even.median == 2.5
    assert (even.q1, even.q3) == (1.75, 4.75)  # linear interpolation, as numpy's default
    single = summarize([7.0])
    assert (single.q1, single.median, single.q3) == (7.0, 7.0, 7.0)


def test_summary_refuses_no_values_and_non_finite_ones() -> None:
    with pytest.raises(ValueError, match="no values"):
        summarize([])
    with pytest.raises(ValueError, match="finite"):
        summarize([1.0, math.nan])


def test_one_request_figures() -> None:
    request = timing(submitted=1.0, first=1.5, last=3.5, tokens=11)
    assert request.ttft_s == 0.5
    assert request.decode_tok_s == 5.0  # 10 tokens after the first in 2 s
    run = RunResult(requests=[request])
    assert run.prefill_tok_s == 200.0  # 100 prompt tokens in 0.5 s
    assert run.aggregate_decode_tok_s == run.decode_tok_s == 5.0


def test_concurrent_run_aggregates_over_the_batch() -> None:
    run = RunResult(requests=[timing(0.0, 1.0, 3.0, tokens=11), timing(0.0, 2.0, 5.0, tokens=13)])
    assert run.ttft_s == 1.5
    assert run.prefill_tok_s == 100.0  # 200 prompt tokens by the last first token at 2 s
    assert run.decode_tok_s == pytest.approx((5.0 + 4.0) / 2)
    assert run.aggregate_decode_tok_s == pytest.approx(22 / 4.0)  # 10 + 12 tokens, 1 s to 5 s


def case(engine: str, placement: str, decode: list[float], concurrency: int = 1) -> CaseResult:
    runs = [RunResult(requests=[timing(0.0, 0.5, 0.5 + 10 / value)]) for value in decode]
    return CaseResult(
        engine=engine,
        model="m",
        placement=placement,
        pinned=False,
        threads=2,
        prompt_tokens=100,
        generation_tokens=11,
        concurrency=concurrency,
        runs=runs,
    ).summarise()


def test_ratios_compare_medians_of_matching_cases() -> None:
    report = BenchReport(started_at="now", machine={}, settings={})
    report.cases = [
        case("exo", "single", [10.0, 20.0, 30.0]),
        case("llama.cpp", "single", [40.0, 50.0, 40.0]),
        case("exo-engine", "single", [25.0]),
        case("exo", "pipeline x2", [60.0]),
        case("exo", "tensor x2", [15.0]),
        case("exo", "pipeline x2", [70.0], concurrency=4),  # no single case at x4
    ]
    add_ratios(report)
    values = {item.name: (item.value, item.target) for item in report.ratios}
    assert values == {
        "decode vs llama.cpp (prompt 100, gen 11, x1)": (pytest.approx(0.5), 1.0),
        "prefill vs llama.cpp (prompt 100, gen 11, x1)": (pytest.approx(1.0), 2.0),
        "API decode vs engine (prompt 100, gen 11, x1)": (pytest.approx(0.8), 0.95),
        # The targets: pipeline x2 with 4 streams, tensor x2 on one stream.
        "pipeline x2 vs single (prompt 100, gen 11, x1)": (pytest.approx(3.0), None),
        "tensor x2 vs single (prompt 100, gen 11, x1)": (pytest.approx(0.75), 1.3),
    }


def test_report_json_round_trips_and_is_written_whole(tmp_path: Path) -> None:
    report = BenchReport(started_at="now", machine={"cpus": 2}, settings={"runs": 3})
    report.cases.append(case("exo", "single", [10.0, 12.0]))
    path = tmp_path / "out" / "bench.json"
    write_json(report, path)
    loaded = BenchReport.model_validate(json.loads(path.read_text()))
    assert loaded == report
    assert loaded.cases[0].summary["decode_tok_s"].median == pytest.approx(11.0)
    assert [entry.name for entry in path.parent.iterdir()] == ["bench.json"]  # no temp left


def test_placements_parse() -> None:
    assert Placement.parse("single") == Placement("pipeline", 1)
    assert Placement.parse("pipeline:2") == Placement("pipeline", 2)
    assert Placement.parse("Tensor×3") == Placement("tensor", 3)
    assert Placement.parse("pipeline").label == "pipeline x2"
    with pytest.raises(ValueError, match="placement"):
        Placement.parse("ring:2")


def test_arguments_are_checked_before_anything_runs(tmp_path: Path) -> None:
    parser = build_parser()
    with pytest.raises(ValueError, match="generation-tokens"):
        config_from_arguments(parser.parse_args(["--generation-tokens", "1"]))
    with pytest.raises(ValueError, match="pin-cores"):
        config_from_arguments(parser.parse_args(["--api", "http://x", "--pin-cores"]))
    with pytest.raises(ValueError, match="prefill-activations applies to the nodes"):
        config_from_arguments(
            parser.parse_args(["--api", "http://x", "--prefill-activations", "int8"])
        )
    assert (
        config_from_arguments(
            parser.parse_args(["--prefill-activations", "int8"])
        ).prefill_activations
        == "int8"
    )
    # Unset: what a node started here rounds by default (bf16 with AMX-BF16, else int16).
    for given in ([], ["--api", "http://x"]):
        default = config_from_arguments(parser.parse_args(given)).prefill_activations
        assert default == default_prefill_activations()
    with pytest.raises(ValueError, match="no file"):
        config_from_arguments(parser.parse_args(["--compare-llama-cpp", str(tmp_path / "x")]))
    # The pause before each run: 0.5 s unless given, never negative, NaN or past a minute.
    assert config_from_arguments(parser.parse_args([])).settle_seconds == 0.5
    assert config_from_arguments(parser.parse_args(["--settle-seconds", "0"])).settle_seconds == 0
    for bad in ("-0.1", "nan", "61"):
        with pytest.raises(ValueError, match="settle-seconds"):
            config_from_arguments(parser.parse_args(["--settle-seconds", bad]))
    # A host and port without a scheme is http (it gave a garbled httpx error before).
    bare = config_from_arguments(parser.parse_args(["--api", "127.0.0.1:53999"]))
    assert bare.api == "http://127.0.0.1:53999"
    secure = config_from_arguments(parser.parse_args(["--api", "https://node.lan:52415/"]))
    assert secure.api == "https://node.lan:52415"
    for bad, complaint in (("ftp://node:1", "use http://HOST:PORT"), ("node:port", "port")):
        with pytest.raises(ValueError, match=complaint):
            config_from_arguments(parser.parse_args(["--api", bad]))
    quick = config_from_arguments(parser.parse_args(["--quick", "--placement", "tensor:2"]))
    assert (quick.prompt_tokens, quick.generation_tokens, quick.node_count()) == ([16], [8], 2)
    # --quick shrinks only the sizes the command line did not set.
    mixed = config_from_arguments(parse_arguments(["--quick", "--generation-tokens", "64"]))
    assert (mixed.prompt_tokens, mixed.generation_tokens, mixed.runs) == ([16], [64], 2)


def test_a_missing_matplotlib_stops_the_bench_before_it_starts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import exo.benchmark.cli as cli

    def must_not_run(*_args: object) -> int:
        raise AssertionError("the bench ran without matplotlib")

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    monkeypatch.setattr(cli, "run_config", must_not_run)
    assert cli.main(["--quick"]) == 2
    assert "pip install 'exo[bench]'" in capsys.readouterr().err
    monkeypatch.setattr(cli, "run_config", lambda *_args: 0)
    assert cli.main(["--quick", "--no-plots"]) == 0
