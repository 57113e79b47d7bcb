"""No module outside the parallelism descriptions (`shared/parallelism/`) and the engine
transforms (`worker/engines/torch/parallel/`) tests the kind of a shard or instance: not by
type (`isinstance`, a `match` case on a shard or instance class) and not by value (comparing
`sharding` with a string, or `match`ing it against one). Code elsewhere asks the kind's
description (`exo.shared.parallelism.parallelism(sharding)`) or transform
(`exo.worker.engines.torch.parallel.engine_transform(sharding)`). Tests are exempt: they
assert which kind they got.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import exo

SOURCE = Path(exo.__file__).parent
ALLOWED = (
    SOURCE / "shared" / "parallelism",
    SOURCE / "worker" / "engines" / "torch" / "parallel",
)
# The shard and instance types, and any per-kind class of them (past or future).
KIND_CLASS = re.compile(r"^(\w*ShardMetadata|Instance|(Pipeline|Tensor|Expert|Single)\w*Instance)$")


def _name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _is_sharding(node: ast.expr) -> bool:
    return _name(node) == "sharding"


def _string_constants(node: ast.expr) -> bool:
    """A string, or a tuple / list / set of them."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, str)
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(_string_constants(element) for element in node.elts)
    return False


def _kind_classes(node: ast.expr) -> list[str]:
    """The shard / instance classes named by an `isinstance` second argument."""
    if isinstance(node, ast.Tuple):
        return [name for element in node.elts for name in _kind_classes(element)]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _kind_classes(node.left) + _kind_classes(node.right)
    name = _name(node)
    return [name] if name is not None and KIND_CLASS.match(name) else []


def _string_pattern(pattern: ast.pattern) -> bool:
    if isinstance(pattern, ast.MatchValue):
        return _string_constants(pattern.value)
    if isinstance(pattern, ast.MatchOr):
        return any(_string_pattern(option) for option in pattern.patterns)
    return False


def _class_patterns(pattern: ast.pattern) -> list[str]:
    found: list[str] = []
    for node in ast.walk(pattern):
        if isinstance(node, ast.MatchClass):
            name = _name(node.cls)
            if name is not None and KIND_CLASS.match(name):
                found.append(name)
    return found


def kind_tests(source: str, filename: str = "<source>") -> list[str]:
    """Every place `source` tests the kind of a shard or instance, as `file:line: what`."""
    found: list[str] = []
    for node in ast.walk(ast.parse(source, filename)):
        where = f"{filename}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, ast.Call) and _name(node.func) == "isinstance" and len(node.args) == 2:
            for name in _kind_classes(node.args[1]):
                found.append(f"{where}: isinstance(..., {name})")
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(_is_sharding(side) for side in sides) and any(
                _string_constants(side) for side in sides
            ):
                found.append(f"{where}: sharding compared with a string")
        elif isinstance(node, ast.Match):
            for case in node.cases:
                for name in _class_patterns(case.pattern):
                    found.append(f"{where}: match case {name}(...)")
                if _is_sharding(node.subject) and _string_pattern(case.pattern):
                    found.append(f"{where}: match on sharding with a string case")
    return found


def _checked_modules() -> list[Path]:
    return [
        path
        for path in sorted(SOURCE.rglob("*.py"))
        if "tests" not in path.relative_to(SOURCE).parts
        and not any(path.is_relative_to(allowed) for allowed in ALLOWED)
    ]


def test_no_module_outside_the_parallelism_files_tests_the_kind() -> None:
    found = [
        hit
        for path in _checked_modules()
        for hit in kind_tests(path.read_text(), str(path.relative_to(SOURCE)))
    ]
    assert found == []


def test_the_exempt_folders_exist_and_the_check_reads_the_rest() -> None:
    assert all(allowed.is_dir() for allowed in ALLOWED)
    checked = {str(path.relative_to(SOURCE)) for path in _checked_modules()}
    assert {
        "master/placement.py",
        "master/group_layout.py",
        "download/shard_files.py",
        "testing/builders.py",
    } <= checked
    assert "shared/parallelism/tensor.py" not in checked


@pytest.mark.parametrize(
    "snippet",
    [
        "isinstance(shard, TensorShardMetadata)",
        "isinstance(instance, (PipelineInstance, TensorInstance))",
        "isinstance(shard, types.PipelineShardMetadata | ShardMetadata)",
        "match shard:\n    case PipelineShardMetadata():\n        pass",
        "match shard:\n    case ShardMetadata(sharding='tensor'):\n        pass",
        "if shard.sharding == 'tensor':\n    pass",
        "if sharding != 'pipeline':\n    pass",
        "ok = 'tensor' == instance.sharding",
        "ok = shard.sharding in ('tensor', 'expert')",
        "ok = shard.sharding not in {'pipeline'}",
        "match instance.sharding:\n    case 'pipeline' | 'tensor':\n        pass",
    ],
)
def test_the_check_finds_a_kind_test(snippet: str) -> None:
    assert kind_tests(snippet) != []


@pytest.mark.parametrize(
    "snippet",
    [
        "isinstance(command, PlaceInstance)",
        "ok = shard.sharding == instance.sharding",
        "kind = parallelism(shard.sharding)",
        "ok = status.kind == 'tensor'",
        "match command:\n    case DeleteInstance():\n        pass",
    ],
)
def test_the_check_leaves_other_code_alone(snippet: str) -> None:
    assert kind_tests(snippet) == []
