"""The floors of `src/exo` (module- and function-level imports, read with `ast`): no import
cycle anywhere, and every top-level package imports only its own floor and those below.

Floors, lowest first (`docs/architecture.md`, "Floors", says why each sits where it does);
packages on one floor do not import each other, except on the top floor (the composition):
0. `exo` (the package root), `utils/` (channels, CPU facts, heap, OpenMP, process title:
   imports nothing of exo), `resources/` (the built-in model cards' files);
1. `shared/` (wire types, events, state and its pure `apply`, model cards, memory
   arithmetic, parallelism descriptions, the local event channel);
2. `routing/` (zenoh transport, cluster TLS, secrets) and `chat_protocol/` (prompt
   rendering, output, reasoning and tool-call parsing);
3. `download/` (model files: Hub, PyPI, GGUF, peers);
4. `worker/` (runners, the engine);
5. `node/` (election, replica, event log, home lock, info gatherer, speed probe, link
   prober): the speed probe times the engine's kernels;
6. `master/` (placement, decisions, recovery): persists through the node's event log;
7. `api/` (the HTTP dialects, serving, guards): asks the master's placement and decisions;
8. `testing/` (what the tests build and start: tiny models, local Hub, nodes);
9. the node's composition and its commands: `main`, `node_options`, `cli`, `__main__`,
   `docs_options` and `benchmark/` (`exo bench`, which starts clusters as the tests do).
"""

from __future__ import annotations

from exo.testing.import_graph import SOURCE, cycles, import_graph, modules_under

FLOORS: dict[str, int] = {
    "exo": 0,
    "exo.utils": 0,
    "exo.resources": 0,
    "exo.shared": 1,
    "exo.routing": 2,
    "exo.chat_protocol": 2,
    "exo.download": 3,
    "exo.worker": 4,
    "exo.node": 5,
    "exo.master": 6,
    "exo.api": 7,
    "exo.testing": 8,
    "exo.benchmark": 9,
    "exo.main": 9,
    "exo.cli": 9,
    "exo.node_options": 9,
    "exo.docs_options": 9,
    "exo.__main__": 9,
}
COMPOSITION_FLOOR = 9


def top_package(module: str) -> str:
    """The entry of `FLOORS` a module belongs to (`exo.shared.types.state` -> `exo.shared`)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else module


def wrong_imports(graph: dict[str, set[str]], floors: dict[str, int]) -> list[str]:
    """Every arrow that goes up a floor, or across one floor between two packages (the
    ground floor's root package and the top floor's composition excepted)."""
    wrong = []
    for module, targets in sorted(graph.items()):
        here = top_package(module)
        for target in sorted(targets):
            there = top_package(target)
            if there == here:
                continue
            if floors[there] > floors[here]:
                wrong.append(f"{module} (floor {floors[here]}) -> {target} (floor {floors[there]})")
            elif floors[there] == floors[here] and floors[here] not in (0, COMPOSITION_FLOOR):
                wrong.append(f"{module} -> {target} (both on floor {floors[here]})")
    return wrong


def test_every_top_level_package_has_a_floor() -> None:
    tops = {top_package(module) for module in modules_under("exo")}
    tops |= {
        f"exo.{path.name}"
        for path in SOURCE.iterdir()
        if path.is_dir() and (path / "__init__.py").exists() and path.name != "tests"
    }
    assert tops - set(FLOORS) == set()


def test_no_import_cycle_in_src_exo() -> None:
    assert cycles(import_graph("exo")) == []


def test_imports_go_down_the_floors() -> None:
    assert wrong_imports(import_graph("exo"), FLOORS) == []


def test_utils_imports_nothing_of_exo() -> None:
    graph = import_graph("exo.utils")
    assert {
        target
        for targets in graph.values()
        for target in targets
        if not target.startswith("exo.utils")
    } == set()


def test_the_checks_see_an_upward_and_a_sideways_import() -> None:
    """The checks find what they must on a made-up graph, and the real graph has the
    downward arrows the floors describe, so an empty result is not an empty graph."""
    made_up = {
        "exo.shared.a": {"exo.api.b"},
        "exo.routing.c": {"exo.chat_protocol.d"},
        "exo.api.e": {"exo.shared.a"},
    }
    assert wrong_imports(made_up, FLOORS) == [
        "exo.routing.c -> exo.chat_protocol.d (both on floor 2)",
        "exo.shared.a (floor 1) -> exo.api.b (floor 7)",
    ]
    graph = import_graph("exo")
    assert "exo.node.event_log" in graph["exo.master.main"]
    assert "exo.chat_protocol.prompt" in graph["exo.api.serving.token_counting"]
    assert "exo.utils.channels" in graph["exo.shared.local_events"]
