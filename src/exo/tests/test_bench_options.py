"""Benchmarks whose `--help` is complete (STYLE: a bench's `--help` is its docstring's
first paragraph and every option has help) stay so; read from their source, not run."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[3] / "bench"
# The benchmarks held to it so far (the others' options still lack help).
COMPLETE_HELP = ("bench_moe.py", "bench_weight_quality.py")


def _options_without_help(tree: ast.Module) -> list[str]:
    """The first argument (or the dump) of each `add_argument(...)` call without `help=`."""
    missing: list[str] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        if node.func.attr != "add_argument":
            continue
        if not any(keyword.arg == "help" for keyword in node.keywords):
            first = node.args[0] if node.args else None
            named = isinstance(first, ast.Constant) and isinstance(first.value, str)
            missing.append(str(first.value) if named else ast.dump(node))  # type: ignore[union-attr]
    return missing


@pytest.mark.parametrize("name", COMPLETE_HELP)
def test_every_option_of_the_bench_has_help(name: str) -> None:
    tree = ast.parse((BENCH_DIR / name).read_text(encoding="utf-8"))
    assert ast.get_docstring(tree), f"{name} has no module docstring for its --help"
    assert _options_without_help(tree) == []
