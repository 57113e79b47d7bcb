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
   `embedding/` (the embedding backend protocol, encoder and EmbeddingGemma forwards) sits
   on this floor too and reads the gemma3 family's pieces from `model/`;
4. the engine, its requests, images and scheduler construction, and its factory
   (`engine.py`, `engine_requests.py`, `engine_images.py`, `engine_scheduler.py`,
   `engine_factory.py`).
Nothing in `exo.worker.engines` imports the worker above it (`runner/`, `main.py`, `plan.py`).
"""

from __future__ import annotations

from exo.testing.import_graph import cycles, import_graph

ENGINE = "exo.worker.engines.torch"
FLOORS = {
    f"{ENGINE}.decoding": 0,
    f"{ENGINE}.comm": 0,
    f"{ENGINE}.quant": 1,
    f"{ENGINE}.batching": 2,
    f"{ENGINE}.model": 3,
    f"{ENGINE}.parallel": 3,
    f"{ENGINE}.embedding": 3,
}
ENGINES_FLOOR = 4
# Packages on one floor that must not import each other.
SEPARATE = [(f"{ENGINE}.decoding", f"{ENGINE}.comm")]


def floor_of(module: str) -> int | None:
    for package, floor in FLOORS.items():
        if module == package or module.startswith(package + "."):
            return floor
    if module.startswith(ENGINE + "."):
        return ENGINES_FLOOR
    return None


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
