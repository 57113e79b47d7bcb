"""The worker's import structure (module- and function-level imports, read with `ast`): no
import cycle anywhere in `src/exo/worker`, and the engine's sub-packages import only
downwards (docs/architecture.md draws the floors).

Floors of `exo.worker.engines.torch`, lowest first; a module may import its own floor and
the ones below, never one above:
0. `decoding/` (sampling, constraints, grammar, vocabulary, stop strings, detokenizer) and
   `comm/` (process group, TCP mesh, parallel linears) — neither imports the other;
1. `quant/` (weight formats, GGUF weights, native kernels);
2. `batching/` (scheduler, request state, slot KV cache, prefix cache);
3. `model/` (families, loading, sharding, fusion, direct forward) and `parallel/` (each
   parallelism's cut, tensor reads and step travel, the messages of a step between ranks),
   which `model/loading.py` calls;
4. the engine and its factory (`engine.py`, `engine_factory.py`).
Nothing in `exo.worker.engines` imports the worker above it (`runner/`, `main.py`, `plan.py`).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import exo

SOURCE = Path(exo.__file__).parent
ENGINE = "exo.worker.engines.torch"
FLOORS = {
    f"{ENGINE}.decoding": 0,
    f"{ENGINE}.comm": 0,
    f"{ENGINE}.quant": 1,
    f"{ENGINE}.batching": 2,
    f"{ENGINE}.model": 3,
    f"{ENGINE}.parallel": 3,
}
ENGINES_FLOOR = 4
# Packages on one floor that must not import each other.
SEPARATE = [(f"{ENGINE}.decoding", f"{ENGINE}.comm")]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(package: str) -> dict[str, Path]:
    root = SOURCE.parent / package.replace(".", "/")
    return {
        module_name(path): path
        for path in sorted(root.rglob("*.py"))
        if "tests" not in path.relative_to(root).parts
    }


def imported_modules(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every exo module `path` imports anywhere in its body (function level included):
    `from package import name` counts as importing `package.name` where that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names]
            targets = [t if t in known else base for t in targets]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module:
                yield target


def import_graph(package: str) -> dict[str, set[str]]:
    modules = modules_under(package)
    known = set(modules_under("exo"))
    return {module: set(imported_modules(module, path, known)) for module, path in modules.items()}


def floor_of(module: str) -> int | None:
    for package, floor in FLOORS.items():
        if module == package or module.startswith(package + "."):
            return floor
    if module.startswith(ENGINE + "."):
        return ENGINES_FLOOR
    return None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in graph:
                continue
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_in_the_worker() -> None:
    assert cycles(import_graph("exo.worker")) == []


def test_engine_sub_packages_import_only_downwards() -> None:
    wrong = []
    for module, targets in import_graph(ENGINE).items():
        floor = floor_of(module)
        for target in targets:
            target_floor = floor_of(target)
            if floor is not None and target_floor is not None and target_floor > floor:
                wrong.append(f"{module} (floor {floor}) -> {target} (floor {target_floor})")
            for first, second in SEPARATE:
                if (module.startswith(first) and target.startswith(second)) or (
                    module.startswith(second) and target.startswith(first)
                ):
                    wrong.append(f"{module} -> {target} (same floor, kept apart)")
    assert wrong == []


def test_the_engines_do_not_import_the_worker_above_them() -> None:
    above = ("exo.worker.runner", "exo.worker.main", "exo.worker.plan")
    wrong = [
        f"{module} -> {target}"
        for module, targets in import_graph("exo.worker.engines").items()
        for target in targets
        if target.startswith(above)
    ]
    assert wrong == []


def test_the_checks_see_a_cycle_and_an_upward_import() -> None:
    """The graph walk finds what it must: a made-up cycle, and today's real downward arrows
    (model -> batching, quant -> comm), so an empty result above is not an empty graph."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    graph = import_graph(ENGINE)
    assert f"{ENGINE}.batching.batch_attention" in graph[f"{ENGINE}.model.direct_forward"]
    assert f"{ENGINE}.comm.parallel_linears" in graph[f"{ENGINE}.quant.quantize"]
    assert floor_of(f"{ENGINE}.engine") == ENGINES_FLOOR
    assert floor_of(f"{ENGINE}.quant.native_kernels") == 1
