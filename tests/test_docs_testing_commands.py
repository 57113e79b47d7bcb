"""The long-check commands docs/testing.md shows (`python bench/chaos.py --json chaos.json`,
`python bench/soak.py ...`, `python bench/node_memory.py ...`) start as written: from the
repository root, with no PYTHONPATH beyond what `pip install -e .` gives. Only `--help` is
run, so each takes seconds (an import and argparse), not the scenarios themselves."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("script", ["bench/chaos.py", "bench/soak.py", "bench/node_memory.py"])
def test_docs_testing_command_starts_as_written(script: str) -> None:
    assert f"python {script}" in (ROOT / "docs" / "testing.md").read_text()
    environment = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    # The installed package's directory only, as an editable install puts it on sys.path.
    environment["PYTHONPATH"] = str(ROOT / "src")
    result = subprocess.run(
        [sys.executable, script, "--help"],
        cwd=ROOT, env=environment, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout
