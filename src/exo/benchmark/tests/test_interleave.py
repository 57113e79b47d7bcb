"""Placements compared side by side: each placed as its own instance, their runs taken in
turn run by run (each request pinned to its instance), and each alone when they do not fit
together."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo.benchmark import runner
from exo.benchmark.client import ApiTarget
from exo.benchmark.cluster import BenchNodes, BenchSetupError, Placement
from exo.benchmark.runner import BenchConfig, BenchSession, _bench_placements
from exo.benchmark.stats import BenchReport, RequestTiming, RunResult
from exo.shared.constants import INSTANCE_HEADER

SINGLE = Placement("pipeline", 1)
TENSOR = Placement("tensor", 2)


class FakeMemory:
    def __init__(self) -> None:
        self.excluded: list[set[int]] = []

    def start(self, excluded: set[int] | None = None) -> None:
        self.excluded.append(set(excluded or ()))

    def stop(self) -> dict[str, int]:
        return {"node-a": 100 * len(self.excluded)}


class FakeNodes(BenchNodes):
    """Instances named after their placement; with `room_for_one`, a placement beside
    another one is refused as a full cluster refuses it."""

    def __init__(self, room_for_one: bool = False) -> None:
        super().__init__(ApiTarget("http://bench.invalid"), ["node-a", "node-b"])
        self.memory: Any = FakeMemory()
        self.room_for_one = room_for_one
        self.live: list[str] = []
        self.log: list[str] = []

    def place(self, model_id: str, placement: Placement) -> str:
        if self.room_for_one and self.live:
            raise BenchSetupError("no room")
        instance_id = f"instance-{placement.sharding}{placement.nodes}"
        self.live.append(instance_id)
        self.log.append(f"place {instance_id}")
        return instance_id

    def delete(self, instance_id: str) -> None:
        self.live.remove(instance_id)
        self.log.append(f"delete {instance_id}")

    def instance_processes(self, instance_id: str) -> set[int]:
        return {1} if instance_id.endswith("pipeline1") else {2, 3}

    def get(self, path: str, **params: Any) -> Any:
        assert path == "/state"
        return {"node_info": {}}


class FakeText:
    def random_prompt(self, length: int, seed: int) -> tuple[str, list[int]]:
        return f"prompt-{seed}", []

    def logit_bias(self) -> dict[str, float]:
        return {"2": -100.0}


def bench(nodes: FakeNodes, monkeypatch: pytest.MonkeyPatch) -> tuple[BenchReport, list[Any]]:
    runs: list[tuple[str, list[str]]] = []

    def run_concurrent(
        target: ApiTarget, model: str, prompts: list[str], count: int, bias: Any
    ) -> RunResult:
        runs.append((target.headers[INSTANCE_HEADER], prompts))
        nodes.log.append(f"run {target.headers[INSTANCE_HEADER]}")
        timing = RequestTiming(
            prompt_tokens=4, completion_tokens=count, submitted_s=0.0, first_token_s=0.1,
            last_token_s=0.5, finish_reason="length",
        )  # fmt: skip
        return RunResult(requests=[timing] * len(prompts))

    monkeypatch.setattr(runner, "run_concurrent", run_concurrent)
    config = BenchConfig(
        model="m", placements=[SINGLE, TENSOR], prompt_tokens=[4], generation_tokens=[3],
        concurrency=[1], runs=3, warmup=1, settle_seconds=0.0, output=Path("unused"),
    )  # fmt: skip
    report = BenchReport(started_at="now", machine={}, settings={})
    taken: dict[tuple[str, int], tuple[dict[str, float], str | None]] = {
        (p.label, 4): ({"decode_tok_s": 1.0}, None) for p in (SINGLE, TENSOR)
    }
    session = BenchSession(
        config, report, nodes, "m", FakeText(), None, None, taken,  # type: ignore[arg-type]
        lambda _: None, lambda: nodes.log.append("checkpoint"),
    )  # fmt: skip
    _bench_placements(session, [SINGLE, TENSOR])
    return report, runs


def test_placements_are_placed_together_and_measured_run_by_run_in_turn(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = FakeNodes()
    report, runs = bench(nodes, monkeypatch)
    single, tensor = "instance-pipeline1", "instance-tensor2"
    assert nodes.log == [
        f"place {single}", f"place {tensor}",
        *[f"run {instance}" for _ in range(4) for instance in (single, tensor)],
        "checkpoint", f"delete {single}", f"delete {tensor}",
    ]  # fmt: skip
    # Each warm-up / run index sends both placements the same prompts, new ones each time.
    prompts = [prompt for _, (prompt,) in runs]
    assert prompts[0::2] == prompts[1::2]
    assert len(set(prompts)) == 4
    assert [(case.placement, len(case.runs)) for case in report.cases] == [
        ("single", 3),
        ("tensor x2", 3),
    ]
    # A case's peak memory leaves out the other instance's runners.
    assert nodes.memory.excluded == [{2, 3}, {1}] * 3
    assert report.cases[0].peak_memory_bytes == {"node-a": 500}
    assert report.cases[1].predicted == {"decode_tok_s": 1.0}


def test_placements_without_room_together_are_measured_each_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    nodes = FakeNodes(room_for_one=True)
    report, _ = bench(nodes, monkeypatch)
    single, tensor = "instance-pipeline1", "instance-tensor2"
    assert nodes.log == [
        f"place {single}", f"delete {single}",
        f"place {single}", *[f"run {single}"] * 4, "checkpoint", f"delete {single}",
        f"place {tensor}", *[f"run {tensor}"] * 4, "checkpoint", f"delete {tensor}",
    ]  # fmt: skip
    assert [(case.placement, len(case.runs)) for case in report.cases] == [
        ("single", 3),
        ("tensor x2", 3),
    ]
    assert any("measured alone" in note for note in report.notes)
    assert nodes.live == []


def test_memory_sampler_leaves_out_the_other_instances_processes() -> None:
    import os
    import subprocess
    import sys

    import psutil

    from exo.benchmark.cluster import MemorySampler

    children = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    try:
        own = psutil.Process().memory_info().rss
        child = psutil.Process(children[0].pid).memory_info().rss
        sampler = MemorySampler({"node": os.getpid()})
        sampler.start(excluded={children[1].pid})
        peaks = sampler.stop()
        tracked = {process.pid for process in sampler._tracked["node"]}
        assert {os.getpid(), children[0].pid} <= tracked
        assert children[1].pid not in tracked
        assert peaks["node"] >= 0.9 * own + child // 2  # the child's memory is counted
    finally:
        for child in children:
            child.kill()
            child.wait(10)
