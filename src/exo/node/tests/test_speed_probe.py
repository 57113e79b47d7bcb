"""The speed probe measures for real (at a small size), caches, and reaches the node's info."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest
import torch

from exo.node import speed_measurements, speed_probe
from exo.node.info_gatherer import InfoGatherer
from exo.node.speed_probe import (
    ProbeResult,
    ProbeStopped,
    cached_node_speed,
    fastest_of,
    measure_node_speed,
    probe_key,
    runner_threads,
)
from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import ForwarderEvent, NodeGatheredInfo
from exo.shared.types.nodes import NodeSpeed
from exo.utils.channels import Topic
from exo.worker.engines.torch.quant.native_kernels import bf16_prefill_available

SLOW_FIELDS = {"int4_decode_bytes_per_second": 1e9, "layer_overhead_seconds": 1e-3}
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

SLOW = SPEED.model_copy(update=SLOW_FIELDS)


@pytest.fixture
def small_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """The real measurement at a small size: short timings, operands of a few MiB."""
    monkeypatch.setattr(speed_measurements, "PROBE_SECONDS", 0.01)
    monkeypatch.setattr(speed_probe, "WORKING_SET_BYTES", 2 * 2**20)
    monkeypatch.setattr(speed_probe, "COPY_BYTES", 4 * 2**20)
    monkeypatch.setattr(speed_measurements, "MATMUL_ROWS", 64)
    monkeypatch.setattr(speed_measurements, "MATMUL_INNER", 256)
    monkeypatch.setattr(speed_measurements, "PREFILL_ROWS", 16)
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
    gemm = [
        speed.int4_prefill_int16_flops, speed.int4_prefill_int8_flops,
        speed.int5_prefill_int16_flops, speed.int5_prefill_int8_flops,
        speed.int8_block_prefill_int16_flops, speed.int8_block_prefill_int8_flops,
    ]  # fmt: skip
    # Prefill's integer GEMM with each rounding, where exo's kernels run (else not measured);
    # bf16 only where it runs (AMX-BF16).
    bf16 = [
        speed.int4_prefill_bf16_flops, speed.int5_prefill_bf16_flops,
        speed.int8_block_prefill_bf16_flops,
    ]  # fmt: skip
    if speed.native_kernels:
        assert all(figure is not None and figure > 1e6 for figure in gemm)
    else:
        assert gemm == [None] * 6
    if speed.native_kernels and bf16_prefill_available():
        assert all(figure is not None and figure > 1e6 for figure in bf16)
    else:
        assert bf16 == [None] * 3


def test_interleaved_timings_take_every_call_in_turn() -> None:
    """The prefill GEMM's two roundings are timed in turn, so a stretch of other work
    slows repetitions of both, never all of one."""
    order: list[str] = []
    timings = speed_measurements.fastest_seconds_interleaved(
        [lambda: order.append("int16"), lambda: order.append("int8")], seconds=0.0
    )
    assert len(timings) == 2 and all(seconds >= 0 for seconds in timings)
    assert order == ["int16", "int8"] * 4  # a warm-up each, then at least 3 rounds


@pytest.mark.parametrize("stale", ["older_probe", "unknown_field"])
def test_a_cache_from_another_probe_is_measured_again_not_crashed_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stale: str
) -> None:
    """A settled cache of probe version 7 (no prefill GEMM figures), or one whose figures
    this exo does not know (a newer exo's): measured again and replaced."""
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    monkeypatch.setattr(speed_probe, "threads_contended", lambda _speed: False)
    key = probe_key(runner_threads())
    figures = SPEED.model_dump(mode="json")
    if stale == "older_probe":
        key = {**key, "probe_version": 7}
    else:
        figures["int4_prefill_int4_flops"] = 1e11
    path = tmp_path / "speed_probe.json"
    path.write_text(json.dumps({"key": key, "speed": figures, "settled": True}))
    fresh = SPEED.model_copy(
        update={"int4_prefill_int16_flops": 6e10, "int4_prefill_int8_flops": 1.1e11}
    )
    calls: list[int | None] = []

    def measured(threads: int | None = None, stop: threading.Event | None = None) -> NodeSpeed:
        calls.append(threads)
        return fresh

    monkeypatch.setattr(speed_probe, "measure_node_speed", measured)
    assert cached_node_speed(path=path) == ProbeResult(fresh, settled=True) and len(calls) == 1
    assert json.loads(path.read_text())["key"] == probe_key(runner_threads())
    assert cached_node_speed(path=path).speed == fresh and len(calls) == 1


def test_runner_threads_stay_within_the_affinity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(speed_probe.os, "sched_getaffinity", lambda _pid: {1})
    assert runner_threads() == 1
    assert probe_key(1)["affinity"] == [1]


@pytest.mark.usefixtures("small_probe")
def test_the_cache_answers_until_the_key_changes_or_a_remeasure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    monkeypatch.setattr(speed_probe, "threads_contended", lambda _speed: False)
    # The first measurement is real (seconds long): quiet whatever else this machine runs.
    monkeypatch.setattr(speed_probe, "others_cpu_share", lambda _before, _after, _cpus: 0.0)
    path = tmp_path / "speed_probe.json"
    first = cached_node_speed(path=path).speed
    assert json.loads(path.read_text())["speed"] == first.model_dump(mode="json")
    calls: list[int] = []

    def counted(threads: int | None = None, stop: threading.Event | None = None) -> NodeSpeed:
        calls.append(threads or 0)
        return SPEED

    monkeypatch.setattr(speed_probe, "measure_node_speed", counted)
    assert cached_node_speed(path=path) == ProbeResult(first, settled=True) and calls == []
    assert cached_node_speed(remeasure=True, path=path).speed == SPEED and len(calls) == 1
    assert cached_node_speed(path=path).speed == SPEED and len(calls) == 1
    # Another torch version (or CPU, affinity, thread count, probe version): measured again.
    monkeypatch.setattr(speed_probe, "PROBE_VERSION", speed_probe.PROBE_VERSION + 1)
    cached_node_speed(path=path)
    assert len(calls) == 2
    # A damaged cache is measured over, not trusted.
    path.write_text('{"key": ')
    assert cached_node_speed(path=path).speed == SPEED and len(calls) == 3
    assert json.loads(path.read_text())["key"] == probe_key(runner_threads())
    assert not list(tmp_path.glob(".*.tmp"))


@pytest.mark.anyio
async def test_the_node_reports_its_speed_once_settled(monkeypatch: pytest.MonkeyPatch) -> None:
    results = iter([ProbeResult(SLOW, settled=False), ProbeResult(SPEED, settled=True)])
    asked: list[bool] = []

    def probe(remeasure: bool = False, stop: threading.Event | None = None) -> ProbeResult:
        asked.append(remeasure)
        return next(results)

    monkeypatch.setattr(speed_probe, "cached_node_speed", probe)
    monkeypatch.setattr("exo.node.info_gatherer.SPEED_REMEASURE_SECONDS", 0.05)
    # Busy at the first check (no measurement then: a serving node is left alone), then quiet.
    busy = iter([True, False])
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: next(busy))
    monkeypatch.setattr("exo.node.info_gatherer.GATHER_INTERVAL_SECONDS", 0.02)
    topic: Topic[ForwarderEvent] = Topic("local_events")
    outbox = topic.subscribe()
    gatherer = InfoGatherer(
        LocalEventSender(NodeId("node"), topic.sender()),
        api_port=1,
        measure_speed=True,
        remeasure_speed=True,
    )
    speeds = []
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(gatherer.run)
            async for forwarded in outbox:
                assert isinstance(forwarded.event, NodeGatheredInfo)
                speeds.append(forwarded.event.info.speed)
                if forwarded.event.info.speed == SPEED:
                    break
            tasks.cancel_scope.cancel()
    # Measured on a busy machine first (not reported: no speed), then again (unforced)
    # once quiet, and reported.
    assert SLOW not in speeds and speeds[-1] == SPEED and None in speeds
    assert asked == [True, False]
    assert next(busy, "spent") == "spent"  # the busy check came before the second measurement


def test_the_cache_lives_in_exo_home_unless_overridden(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXO_SPEED_PROBE_CACHE", raising=False)
    monkeypatch.setenv("EXO_HOME", str(tmp_path / "home"))
    assert speed_probe.cache_path() == tmp_path / "home" / "speed_probe.json"
    monkeypatch.setenv("EXO_SPEED_PROBE_CACHE", str(tmp_path / "shared.json"))
    assert speed_probe.cache_path() == tmp_path / "shared.json"


def test_figures_from_a_busy_machine_are_measured_again_keeping_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "speed_probe.json"
    measured = iter([SLOW, SPEED.model_copy(update={"bf16_matmul_flops": 5e10})])
    monkeypatch.setattr(
        speed_probe, "measure_node_speed", lambda threads=None, stop=None: next(measured)
    )
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: True)
    busy = cached_node_speed(path=path)
    assert busy == ProbeResult(SLOW, settled=False)
    assert json.loads(path.read_text())["settled"] is False
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    quiet = cached_node_speed(path=path)
    # The best of both: the quiet run's bandwidth and overhead, the busy run's matmul rate.
    assert quiet.settled and quiet.speed == fastest_of(SLOW, SPEED)
    assert quiet.speed.bf16_matmul_flops == SLOW.bf16_matmul_flops
    assert quiet.speed.int4_decode_bytes_per_second == SPEED.int4_decode_bytes_per_second
    assert quiet.speed.layer_overhead_seconds == SPEED.layer_overhead_seconds
    # Settled: the next start reads it without measuring (the iterator is spent).
    assert cached_node_speed(path=path) == quiet


@pytest.mark.parametrize("native", ["0", "1"])
def test_int4_decode_is_measured_on_the_kernel_the_engine_runs(
    native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exo.worker.engines.torch.quant import native_kernels

    monkeypatch.setenv(native_kernels.NATIVE_INT4_ENV, native)
    calls: list[tuple[torch.Size, torch.dtype]] = []
    kernel = native_kernels.built_int4_kernel()
    assert kernel is not None

    def counting(row: torch.Tensor, packed: torch.Tensor, pairs: torch.Tensor) -> torch.Tensor:
        calls.append((packed.shape, row.dtype))
        return kernel(row, packed, pairs)

    monkeypatch.setattr(native_kernels, "built_int4_kernel", lambda: counting)
    rate = speed_measurements.int4_decode_bytes_per_second(1 << 20)
    assert rate > 0
    if native == "1":
        assert calls and calls[0] == (
            (speed_measurements.INT4_OUTPUTS, speed_measurements.INT4_INPUTS // 2),
            torch.float32,
        )
    else:
        assert calls == []  # torch's kernel


@pytest.mark.parametrize(("one_thread", "settled"), [(2e10, False), (6e9, True)])
def test_threads_slower_than_one_thread_leave_the_figures_unsettled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: float, settled: bool
) -> None:
    """Two threads measuring less than one thread does: another process held a CPU (every
    parallel region waited for it), so the figures understate the machine."""
    two_threads = SPEED.model_copy(update={"threads": 2})  # int4 1e10 B/s
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    monkeypatch.setattr(speed_probe, "runner_threads", lambda: 2)
    monkeypatch.setattr(
        speed_probe, "measure_node_speed", lambda threads=None, stop=None: two_threads
    )
    monkeypatch.setattr(speed_probe, "one_thread_int4_bytes_per_second", lambda: one_thread)
    result = cached_node_speed(path=tmp_path / "speed_probe.json")
    assert result == ProbeResult(two_threads, settled=settled)
    assert json.loads((tmp_path / "speed_probe.json").read_text())["settled"] is settled
    assert not speed_probe.threads_contended(SPEED)  # one thread: nothing to compare


@pytest.mark.usefixtures("small_probe")
def test_one_thread_int4_figure_is_measured_for_real() -> None:
    before = torch.get_num_threads()
    assert speed_probe.one_thread_int4_bytes_per_second() > 1e6
    assert torch.get_num_threads() == before


def test_the_cache_key_says_whose_kernels_were_measured(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXO_NATIVE_INT4", "1")
    native = speed_probe.probe_key(2)
    monkeypatch.setenv("EXO_NATIVE_INT4", "0")
    torch_kernels = speed_probe.probe_key(2)
    assert native["native_kernels"] is True and torch_kernels["native_kernels"] is False


def test_the_probe_runs_unless_turned_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(speed_probe.SPEED_PROBE_ENV, raising=False)
    assert speed_probe.speed_probe_enabled()
    monkeypatch.setenv(speed_probe.SPEED_PROBE_ENV, "0")
    assert not speed_probe.speed_probe_enabled()
    monkeypatch.setenv(speed_probe.SPEED_PROBE_ENV, "1")
    assert speed_probe.speed_probe_enabled()


def test_test_nodes_do_not_probe_and_bench_nodes_do(tmp_path: Path) -> None:
    """The suite's nodes start with the probe off (each start measured again on a machine
    busy with tests); a test may turn it back on."""
    from exo.testing.processes import ExoNode

    assert ExoNode(tmp_path / "a").environment()[speed_probe.SPEED_PROBE_ENV] == "0"
    on = ExoNode(tmp_path / "b", env={speed_probe.SPEED_PROBE_ENV: "1"})
    assert on.environment()[speed_probe.SPEED_PROBE_ENV] == "1"


@pytest.mark.usefixtures("small_probe")
def test_a_stopped_probe_measures_no_further_and_caches_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    stop = threading.Event()
    matmuls: list[str] = []

    def copy_then_stop(copy_bytes: int) -> float:
        stop.set()  # the node stops while this figure is measured
        return 1e10

    def matmul(dtype: str) -> float:
        matmuls.append(dtype)
        return 1e11

    monkeypatch.setattr(speed_probe, "memory_copy_bytes_per_second", copy_then_stop)
    monkeypatch.setattr(speed_probe, "matmul_flops", matmul)
    path = tmp_path / "speed.json"
    with pytest.raises(ProbeStopped):
        cached_node_speed(path=path, stop=stop)
    assert matmuls == [] and not path.exists()


@pytest.mark.anyio
async def test_a_node_stopping_mid_probe_tells_the_probe_thread_to_stop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The probe thread is abandoned on cancellation (shutdown does not wait seconds for
    it) but told to stop, so it logs and caches nothing after the node has stopped."""
    started = threading.Event()
    stopped_seen = threading.Event()

    def probe(remeasure: bool = False, stop: threading.Event | None = None) -> ProbeResult:
        assert stop is not None
        started.set()
        if stop.wait(timeout=20):
            stopped_seen.set()
        raise ProbeStopped("stopped")

    monkeypatch.setattr(speed_probe, "cached_node_speed", probe)
    topic: Topic[ForwarderEvent] = Topic("local_events")
    gatherer = InfoGatherer(
        LocalEventSender(NodeId("node"), topic.sender()), api_port=1, measure_speed=True
    )
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(gatherer.run)
            while not started.is_set():
                await anyio.sleep(0.01)
            tasks.cancel_scope.cancel()
        await anyio.to_thread.run_sync(stopped_seen.wait, 20)
    assert stopped_seen.is_set()


def test_others_cpu_share_is_their_busy_time_over_the_machines() -> None:
    """Other processes' CPU time between two readings over wall time x CPUs; None for a
    window too short for the kernel's accounting."""
    before = speed_probe.CpuUse(wall=100.0, machine_busy=50.0, own=10.0)
    after = speed_probe.CpuUse(wall=102.0, machine_busy=53.0, own=11.0)  # others: 2 s of 4
    assert speed_probe.others_cpu_share(before, after, cpus=2) == pytest.approx(0.5)
    assert speed_probe.others_cpu_share(before, after, cpus=8) == pytest.approx(0.125)
    alone = speed_probe.CpuUse(wall=102.0, machine_busy=52.0, own=12.0)  # all of it ours
    assert speed_probe.others_cpu_share(before, alone, cpus=2) == 0.0
    instant = speed_probe.CpuUse(wall=100.5, machine_busy=51.0, own=10.0)
    assert speed_probe.others_cpu_share(before, instant, cpus=2) is None


def test_figures_measured_while_other_processes_took_the_cpus_are_unsettled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of other work during the measurement (one busy process per CPU for 1.5 s),
    which the lagging load average does not show, leaves the figures unsettled (the
    2026-12-07 trial settled int8 decode at 0.9 GB/s that way)."""
    monkeypatch.setattr(speed_probe, "machine_busy", lambda: False)
    monkeypatch.setattr(speed_probe, "threads_contended", lambda _speed: False)

    def measured_beside_others(threads: int | None = None, stop: object = None) -> NodeSpeed:
        burners = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(os.cpu_count() or 1)
        ]
        try:
            time.sleep(1.5)
        finally:
            for burner in burners:
                burner.kill()
                burner.wait(timeout=10)
        return SPEED

    monkeypatch.setattr(speed_probe, "measure_node_speed", measured_beside_others)
    result = cached_node_speed(path=tmp_path / "speed_probe.json")
    assert result == ProbeResult(SPEED, settled=False)
    assert json.loads((tmp_path / "speed_probe.json").read_text())["settled"] is False
