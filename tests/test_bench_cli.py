"""Smoke test of `exo bench` against a fresh local node: a tiny random model (word
tokenizer, so prompt lengths are exact), tiny sizes, through the real command line."""

import json
import subprocess
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
