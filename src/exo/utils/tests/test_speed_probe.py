"""The speed probe measures for real (at a small size), caches, and reaches the node's info."""

from __future__ import annotations

import json
from pathlib import Path

import anyio
import pytest
import torch

from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import ForwarderEvent, NodeGatheredInfo
from exo.shared.types.nodes import NodeSpeed
from exo.utils import speed_probe
from exo.utils.channels import Topic
from exo.utils.info_gatherer import InfoGatherer
from exo.utils.speed_probe import cached_node_speed, measure_node_speed, probe_key, runner_threads

SPEED = NodeSpeed(
    threads=1,
    int4_decode_bytes_per_second=1e10,
    int8_decode_bytes_per_second=8e9,
    memory_copy_bytes_per_second=2e10,
    bf16_matmul_flops=1e11,
    float32_matmul_flops=5e10,
    layer_overhead_seconds=1e-4,
    loopback_round_trip_seconds=5e-5,
)


@pytest.fixture
def small_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real measurement at a small size: short timings, operands of a few MiB."""
    monkeypatch.setattr(speed_probe, "PROBE_SECONDS", 0.01)
    monkeypatch.setattr(speed_probe, "WORKING_SET_BYTES", 2 * 2**20)
    monkeypatch.setattr(speed_probe, "COPY_BYTES", 4 * 2**20)
    monkeypatch.setattr(speed_probe, "MATMUL_ROWS", 64)
    monkeypatch.setattr(speed_probe, "MATMUL_INNER", 256)
    monkeypatch.setattr(speed_probe, "_llc_bytes", lambda: 2**20)


@pytest.mark.usefixtures("small_probe")
def test_a_real_measurement_is_positive_and_keeps_the_thread_count() -> None:
    before = torch.get_num_threads()
    speed = measure_node_speed(threads=1)
    assert speed.threads == 1
    assert speed.int4_decode_bytes_per_second > 1e6
    assert speed.int8_decode_bytes_per_second > 1e6
    assert speed.memory_copy_bytes_per_second > 1e6
    assert speed.bf16_matmul_flops > 1e6 and speed.float32_matmul_flops > 1e6
    assert 0 < speed.layer_overhead_seconds < 1
    assert torch.get_num_threads() == before


def test_runner_threads_stay_within_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(speed_probe.os, "sched_getaffinity", lambda _pid: {1})
    assert runner_threads() == 1
    assert probe_key(1)["affinity"] == [1]


@pytest.mark.usefixtures("small_probe")
def test_the_cache_answers_until_the_key_changes_or_a_remeasure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "speed_probe.json"
    first = cached_node_speed(path=path)
    assert json.loads(path.read_text())["speed"] == first.model_dump(mode="json")
    calls: list[int] = []

    def counted(threads: int | None = None) -> NodeSpeed:
        calls.append(threads or 0)
        return SPEED

    monkeypatch.setattr(speed_probe, "measure_node_speed", counted)
    assert cached_node_speed(path=path) == first and calls == []
    assert cached_node_speed(remeasure=True, path=path) == SPEED and len(calls) == 1
    assert cached_node_speed(path=path) == SPEED and len(calls) == 1
    # Another torch version (or CPU, affinity, thread count, probe version): measured again.
    monkeypatch.setattr(speed_probe, "PROBE_VERSION", speed_probe.PROBE_VERSION + 1)
    cached_node_speed(path=path)
    assert len(calls) == 2
    # A damaged cache is measured over, not trusted.
    path.write_text('{"key": ')
    assert cached_node_speed(path=path) == SPEED and len(calls) == 3
    assert json.loads(path.read_text())["key"] == probe_key(runner_threads())
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.anyio
async def test_the_node_reports_its_speed_once_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(speed_probe, "cached_node_speed", lambda remeasure=False: SPEED)
    monkeypatch.setattr("exo.utils.info_gatherer.GATHER_INTERVAL_SECONDS", 0.02)
    topic: Topic[ForwarderEvent] = Topic("local_events")
    outbox = topic.subscribe()
    gatherer = InfoGatherer(
        LocalEventSender(NodeId("node"), topic.sender()), api_port=1, measure_speed=True
    )
    speeds = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(gatherer.run)
            async for forwarded in outbox:
                assert isinstance(forwarded.event, NodeGatheredInfo)
                speeds.append(forwarded.event.info.speed)
                if forwarded.event.info.speed is not None:
                    break
            tasks.cancel_scope.cancel()
    assert speeds[-1] == SPEED
