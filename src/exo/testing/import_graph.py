"""The import graph of `src/exo`, read with `ast` (module- and function-level imports), for
the tests that hold the code's floors (`exo/tests/test_layering.py`,
`exo/worker/tests/test_import_structure.py`; `docs/architecture.md` states the order).

An import counts wherever it is written: at module level, inside a function or under
`if TYPE_CHECKING:` — a type-only arrow still ties the two modules together. Test modules
(any `tests` folder) are left out: they may import any floor.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import exo

SOURCE = Path(exo.__file__).parent


def module_name(path: Path) -> str:
    """`exo.x.y` for `src/exo/x/y.py` (a package's `__init__.py` is the package)."""
    parts = list(path.relative_to(SOURCE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules_under(package: str) -> dict[str, Path]:
    """Every module of `package` (itself included) outside `tests` folders, by name."""
    root = SOURCE.parent / package.replace(".", "/")
    if root.with_suffix(".py").is_file():
        return {package: root.with_suffix(".py")}
    return {
        module_name(path): path
        for path in sorted(root.rglob("*.py"))
        if "tests" not in path.relative_to(root).parts
    }


def imported_modules(module: str, path: Path, known: set[str]) -> Iterator[str]:
    """Every module of `known` that `module` (at `path`) imports anywhere in its body:
    `from package import name` counts as importing `package.name` where that is a module,
    else `package`; a name inside a module counts as the module."""
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
    """Each module of `package` (tests left out) -> the exo modules it imports."""
    modules = modules_under(package)
    known = set(modules_under("exo"))
    return {module: set(imported_modules(module, path, known)) for module, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module, each sorted (Tarjan's
    algorithm; arrows to modules outside `graph` are ignored)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
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
