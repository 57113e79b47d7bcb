"""Smoke test of `exo bench` against a fresh local node: a tiny random model (word
tokenizer, so prompt lengths are exact), tiny sizes, through the real command line; and the
`bench/` scripts' `--help`, each described by its docstring's whole first paragraph."""

import ast
import json
import subprocess
import sys
from pathlib import Path

from exo.benchmark.random_models import random_model
from exo.testing.processes import exo_command

TINY_LLAMA = {
    "n_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 300,
}


def test_exo_bench_measures_a_fresh_local_node(tmp_path: Path) -> None:
    model = random_model(tmp_path / "tiny-llama", "llama", TINY_LLAMA)
    output = tmp_path / "results"
    command = [
        exo_command(), "bench", "--model", str(model), "--quick", "--no-plots",
        "--concurrency", "1", "2", "--output", str(output), "--name", "smoke",
    ]  # fmt: skip
    finished = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    report = json.loads((output / "smoke.json").read_text())
    assert report["finished_at"] is not None
    cases = report["cases"]
    assert [(case["engine"], case["placement"], case["concurrency"]) for case in cases] == [
        ("exo", "single", 1),
        ("exo", "single", 2),
    ]
    for case in cases:
        assert len(case["runs"]) == 2  # --quick: 2 measured runs after 1 warm-up
        for run in case["runs"]:
            assert len(run["requests"]) == case["concurrency"]
            for request in run["requests"]:
                # EOS banned: every request decodes exactly the asked count, by length.
                assert request["completion_tokens"] == 8
                assert request["finish_reason"] == "length"
                assert request["prompt_tokens"] == 16
                assert 0 <= request["submitted_s"] < request["first_token_s"]
                assert request["first_token_s"] <= request["last_token_s"]
        for figure in ("ttft_s", "prefill_tok_s", "decode_tok_s", "aggregate_decode_tok_s"):
            spread = case["summary"][figure]
            assert spread["n"] == 2
            assert 0 < spread["min"] <= spread["median"] <= spread["max"]
        (peak,) = case["peak_memory_bytes"].values()
        assert peak > 50 * 2**20  # a node and its runner hold more than 50 MiB
    assert "decode" in finished.stdout and "JSON:" in finished.stdout


BENCH = Path(__file__).resolve().parents[1] / "bench"
# The first paragraph of the module docstring, its lines joined into one.
DESCRIPTION = ast.dump(ast.parse('" ".join(__doc__.split("\\n\\n")[0].split())', mode="eval").body)


def test_every_bench_script_describes_itself_in_whole_sentences() -> None:
    """Trial 42: `--help` cut descriptions mid-sentence (the docstring's first line:
    bench_engine.py's ended "in-process through"). Read from the source (importing the
    scripts would load torch 44 times); one cheap script's `--help` is run."""
    scripts = sorted(BENCH.glob("*.py"))
    assert len(scripts) >= 40
    for script in scripts:
        tree = ast.parse(script.read_text(encoding="utf-8"))
        parsers = [
            node
            for node in ast.walk(tree)
            if isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "ArgumentParser"
        ]
        assert parsers, f"{script.name} builds no argparse parser"
        for parser in parsers:
            description = {keyword.arg: keyword.value for keyword in parser.keywords}
            assert "description" in description, script.name
            assert ast.dump(description["description"]) == DESCRIPTION, script.name
        docstring = ast.get_docstring(tree, clean=False) or ""
        paragraph = " ".join(docstring.split("\n\n")[0].split())
        assert paragraph.endswith("."), (script.name, paragraph)
    shown = subprocess.run(
        [sys.executable, str(BENCH / "bench_tower_loading.py"), "--help"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    help_text = " ".join(shown.stdout.split())
    # The paragraph's last line, which a first-line description left out.
    assert "Peak memory of loading a vision tower:" in help_text, help_text
    tree = ast.parse((BENCH / "bench_tower_loading.py").read_text(encoding="utf-8"))
    last_line = (ast.get_docstring(tree, clean=False) or "").split("\n\n")[0].splitlines()[-1]
    assert " ".join(last_line.split()) in help_text, help_text
