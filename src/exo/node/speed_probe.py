"""Measures what this node's CPU does per second for the engine: a `NodeSpeed`.

Run once at start (`InfoGatherer` calls `cached_node_speed` in a worker thread, so the node
starts at once and reports the figures a moment later) and cached in
`<EXO_HOME>/speed_probe.json` under a key of CPU model, logical CPUs, CPU affinity, torch
version, thread count, whether exo's kernels run and `PROBE_VERSION`: a changed key, or
`exo --remeasure-speed`, measures again. Figures measured while other work kept the machine busy
(`machine_busy`, `others_cpu_share`), or with several threads slower than one thread
(`threads_contended`), are unsettled and not reported (the node has no speed, previews
predict nothing): the node
measures again once the machine is quiet (`InfoGatherer` checks every 5 minutes for an
hour) and at its next start, keeping each figure's best (`fastest_of`), until a quiet
measurement settles them. The measurement takes about
`PROBE_SECONDS` × 10 plus building the operands (the prefill GEMM figures: ~0.4 s of it).

What is measured is what the engine runs (`exo.worker.engines.torch.quant.quantize`), with the
thread count its runners use (`runner_threads`: torch's default capped by the CPUs this
process may run on, as the engine does):
- int4 decode: `aten._weight_int4pack_mm_for_cpu` on one bfloat16 row against
  `[INT4_OUTPUTS, INT4_INPUTS]` packed weights (exo's own kernel on a float32 row where the
  engine runs it, `native_kernels`), cycled over copies whose total exceeds the last-level
  cache (the weights of a decode step come from memory, not cache);
- int8 decode: `aten._weight_int8pack_mm` likewise (the engine's LM head), and where exo's
  kernels run its 5-bit and int8-block kernels (GGUF Q5_0, Q8_0 / Q5_1 / Q6_K layers);
- memory copy: `Tensor.copy_` of `COPY_BYTES`, counted as bytes read plus written;
- bfloat16 / float32 matmul FLOP/s at `[MATMUL_ROWS, MATMUL_INNER] @ [MATMUL_INNER,
  MATMUL_INNER]` (prefill);
- where exo's kernels run, prefill's integer GEMM (`block_matmul`) FLOP/s for int4, 5-bit
  and Q6_K-style int8 block weights, each with the activations rounded to int16 and to int8
  (`--prefill-activations`: the node publishes which its runners use, `NodeInfo.
  prefill_activations`, and a TTFT prediction reads that figure);
- per-layer overhead: one decoder layer's decode ops at a tiny width (`TinyLayer`: RMSNorm,
  int4 Q/K/V/O and gate/up/down with the engine's bfloat16 casts around each kernel, rotary,
  attention over a short KV cache, SiLU gate, residual adds), where bytes are negligible and
  only the fixed cost of each op remains;
- loopback round trip: a small message to a thread of this process and back over TCP on
  127.0.0.1 (what a message between two runners on this machine costs at least).
Each figure is the fastest of timed repetitions after a warm-up (the least disturbed by
other work, as `timeit` advises): the node's capability, not its load at start. The
measurements themselves are in `exo.node.speed_measurements`.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import psutil
from loguru import logger
from pydantic import ValidationError

from exo.node.speed_measurements import (
    NativeTinyLayer,
    TinyLayer,
    fastest_seconds,
    int4_decode_bytes_per_second,
    int8_decode_bytes_per_second,
    loopback_round_trip_seconds,
    matmul_flops,
    memory_copy_bytes_per_second,
    native_block_bytes_per_second,
    prefill_gemm_flops,
    torch_threads,
)
from exo.shared.constants import exo_home
from exo.shared.types.nodes import NodeSpeed
from exo.utils.cpu_features import cpu_model

T = TypeVar("T")

# Bump when what is measured changes: cached figures of an older probe are measured again.
# 11: prefill FLOP/s with bf16 activations where AMX-BF16 runs them; 10: 512-bit int16
# prefill tiles where the kernels have AVX512-VNNI + AVX512BW; 9: exo's
# kernels on AVX512 CPUs too, built with AVX512 / VNNI where the CPU has them (int16 prefill
# in float32 there); 8: prefill GEMM FLOP/s with int16 and int8 activations; 7: the int8
# head kernel timed without a cast per call; 6: 5-bit lanes.
PROBE_VERSION = 11
CACHE_FILE_NAME = "speed_probe.json"
# Weights cycled through per repetition, at least this many bytes (above a typical LLC) and
# this many times the last-level cache: on the 2-core AMD EPYC (32 MiB L3, a victim cache)
# twice the L3 still hit it often enough to read int8 weights at 26-29 GB/s, where a model's
# 178 MB LM head reads at 21; four times measured 23-24.
WORKING_SET_BYTES = 48 * 2**20
LLC_MULTIPLE = 4
COPY_BYTES = 64 * 2**20
# A 1-minute load average above this per logical CPU: figures measured then are unsettled
# (not reported). Each figure is the fastest of many short repetitions, which a moderate
# load (a test suite, a model loading next to the probe) barely moves; the figures that came
# out ~80x too low were measured at load averages of 20-70 on 2 CPUs. A lower bound would
# leave a node that starts while it loads its own model with no speed (and no predictions)
# for the 5 minutes until the next check.
BUSY_LOAD_PER_CPU = 3.0
# Other processes' share of this machine's CPU time while the probe measured, above which the
# figures are unsettled. The load average lags by a minute, so a burst of other work (a
# runner loading its model, a compiler) during the probe passed it: the 2026-12-07 trial
# settled int8 decode at 0.9 GB/s and int8 blocks at 0.7 GB/s beside int4 at 12.2 GB/s,
# its load average (1.8-2.5 per CPU) under `BUSY_LOAD_PER_CPU`.
BUSY_OTHERS_SHARE = 0.25
# The shortest measurement whose CPU accounting is read: the kernel counts CPU time in clock
# ticks (10 ms), so a shorter window says nothing (a real probe takes several seconds).
MIN_ACCOUNTED_SECONDS = 1.0


def runner_threads() -> int:
    """The torch intra-op threads a runner of this node uses: torch's default (or
    `OMP_NUM_THREADS`), never more than the CPUs this process may run on (the engine's
    `_configure_cpu_threads` rule; a node pinned to one core gets 1)."""
    import torch

    threads = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ or not hasattr(os, "sched_getaffinity"):
        return threads
    return max(1, min(threads, len(os.sched_getaffinity(0))))


def _llc_bytes() -> int:
    """The largest cache of CPU 0 (sysfs), 32 MiB when unknown."""
    largest = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        number, unit = (text[:-1], text[-1]) if text[-1] in units else (text, "")
        if number.isdigit():
            largest = max(largest, int(number) * units.get(unit, 1))
    return largest or 32 * 2**20


def probe_key(threads: int) -> dict[str, Any]:
    """What the cached figures depend on; any change measures again."""
    import torch

    from exo.worker.engines.torch.quant.native_kernels import native_int4_wanted

    affinity = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return {
        "probe_version": PROBE_VERSION,
        "cpu_model": cpu_model(),
        "logical_cpus": psutil.cpu_count(logical=True) or 1,
        "affinity": affinity,
        "torch": torch.__version__,
        "threads": threads,
        # exo's kernels or torch's (`EXO_NATIVE_INT4`): different kernels, other figures.
        "native_kernels": native_int4_wanted(),
    }


class ProbeStopped(Exception):
    """The node stopped while its speed was being measured (`measure_node_speed`'s `stop`)."""


def measure_node_speed(
    threads: int | None = None, stop: threading.Event | None = None
) -> NodeSpeed:
    """Measure this CPU now with `threads` torch threads (default `runner_threads()`); the
    process's own thread count is restored afterwards.

    Raises:
        ProbeStopped: `stop` was set; checked between the figures (each takes well under a
            second to a few seconds), so a node that stops mid-probe does not leave a
            measuring thread behind for the whole probe.
    """
    import torch

    threads = threads or runner_threads()
    working_set = max(WORKING_SET_BYTES, LLC_MULTIPLE * _llc_bytes())
    from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel

    def measured(figure: Callable[[], T]) -> T:
        if stop is not None and stop.is_set():
            raise ProbeStopped("the node stopped during its speed probe")
        return figure()

    native = native_int4_kernel() is not None
    with torch_threads(threads), torch.inference_mode():
        layer: TinyLayer | NativeTinyLayer = NativeTinyLayer() if native else TinyLayer()
        unmeasured: tuple[float | None, float | None, float | None] = (None, None, None)
        int4_gemm = measured(lambda: prefill_gemm_flops("int4")) if native else unmeasured
        int5_gemm = measured(lambda: prefill_gemm_flops("int5")) if native else unmeasured
        int8_block_gemm = (
            measured(lambda: prefill_gemm_flops("int8_blocks")) if native else unmeasured
        )
        return NodeSpeed(
            threads=threads,
            int4_decode_bytes_per_second=measured(
                lambda: int4_decode_bytes_per_second(working_set)
            ),
            int8_decode_bytes_per_second=measured(
                lambda: int8_decode_bytes_per_second(working_set)
            ),
            memory_copy_bytes_per_second=measured(lambda: memory_copy_bytes_per_second(COPY_BYTES)),
            bf16_matmul_flops=measured(lambda: matmul_flops("bfloat16")),
            float32_matmul_flops=measured(lambda: matmul_flops("float32")),
            layer_overhead_seconds=measured(lambda: fastest_seconds(layer.forward)),
            loopback_round_trip_seconds=measured(loopback_round_trip_seconds),
            native_kernels=native,
            int5_decode_bytes_per_second=(
                measured(lambda: native_block_bytes_per_second("int5", working_set))
                if native
                else None
            ),
            int8_block_decode_bytes_per_second=(
                measured(lambda: native_block_bytes_per_second("int8_blocks", working_set))
                if native
                else None
            ),
            int4_prefill_int16_flops=int4_gemm[0],
            int4_prefill_int8_flops=int4_gemm[1],
            int5_prefill_int16_flops=int5_gemm[0],
            int5_prefill_int8_flops=int5_gemm[1],
            int8_block_prefill_int16_flops=int8_block_gemm[0],
            int8_block_prefill_int8_flops=int8_block_gemm[1],
            int4_prefill_bf16_flops=int4_gemm[2],
            int5_prefill_bf16_flops=int5_gemm[2],
            int8_block_prefill_bf16_flops=int8_block_gemm[2],
        )


# "0" turns the probe off: the node reports no speed (placement splits layers by memory and
# previews predict nothing for it). The test suite's nodes run with it off: on a machine
# busy with tests no figure ever settles, so every node started measured again, 25-180 s
# of both cores each (docs/testing.md).
SPEED_PROBE_ENV = "EXO_SPEED_PROBE"


def speed_probe_enabled() -> bool:
    """Whether this node measures its speed (`EXO_SPEED_PROBE` is not "0")."""
    return os.environ.get(SPEED_PROBE_ENV, "1") != "0"


def cache_path() -> Path:
    """`<EXO_HOME>/speed_probe.json`, or `EXO_SPEED_PROBE_CACHE` (test nodes on one machine
    share one file)."""
    override = os.environ.get("EXO_SPEED_PROBE_CACHE")
    return Path(override) if override else exo_home() / CACHE_FILE_NAME


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """The figures and whether they are settled: measured (or merged with measurements)
    while the machine was quiet. Unsettled figures are cached (merged with the next
    measurement) but not reported."""

    speed: NodeSpeed
    settled: bool


def machine_busy() -> bool:
    """Whether other work kept the CPUs busy: a 1-minute load average above
    `BUSY_LOAD_PER_CPU` per logical CPU (figures measured then understate the machine)."""
    try:
        load = os.getloadavg()[0]
    except OSError:
        return False
    return load > BUSY_LOAD_PER_CPU * (psutil.cpu_count(logical=True) or 1)


@dataclass(frozen=True, slots=True)
class CpuUse:
    """A reading of CPU time (seconds): wall clock, the machine's busy time summed over its
    CPUs (user, nice, system, interrupts and time stolen by the hypervisor), and this
    process's own (user + system)."""

    wall: float
    machine_busy: float
    own: float

    @staticmethod
    def now() -> CpuUse:
        machine = psutil.cpu_times()
        busy = sum(
            getattr(machine, field, 0.0)
            for field in ("user", "nice", "system", "irq", "softirq", "steal")
        )
        own = psutil.Process().cpu_times()
        return CpuUse(time.monotonic(), busy, own.user + own.system)


def others_cpu_share(before: CpuUse, after: CpuUse, cpus: int) -> float | None:
    """The share (0-1) of the machine's CPU time (`cpus` CPUs) that other processes used
    between two readings: their busy time over the wall time times the CPUs. None when the
    window is shorter than `MIN_ACCOUNTED_SECONDS` (too short for the kernel's accounting)."""
    wall = after.wall - before.wall
    if wall < MIN_ACCOUNTED_SECONDS or cpus < 1:
        return None
    others = (after.machine_busy - before.machine_busy) - (after.own - before.own)
    return min(1.0, max(0.0, others / (wall * cpus)))


def fastest_of(first: NodeSpeed, second: NodeSpeed) -> NodeSpeed:
    """Each figure at its best over two measurements of the same key: the higher rate, the
    lower time (other work only ever slows a measurement down)."""
    best: dict[str, Any] = {}
    for name, value in first.model_dump().items():
        other = getattr(second, name)
        if name in ("threads", "native_kernels") or value is None or other is None:
            best[name] = value if other is None else other if value is None else value
        elif name.endswith("_seconds"):
            best[name] = min(value, other)
        else:
            best[name] = max(value, other)
    return NodeSpeed.model_validate(best)


def _read_cache(path: Path, key: dict[str, Any]) -> ProbeResult | None:
    try:
        cached = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(cached, dict) or cached.get("key") != key:
        return None
    try:
        return ProbeResult(
            NodeSpeed.model_validate(cached.get("speed")), cached.get("settled") is True
        )
    except ValidationError:
        return None


def write_cache(path: Path, key: dict[str, Any], result: ProbeResult) -> None:
    """Atomically (a temporary file renamed over the cache): never a half-written file."""
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    record = {"key": key, "speed": result.speed.model_dump(mode="json"), "settled": result.settled}
    try:
        temporary.write_text(json.dumps(record))
        temporary.replace(path)
    except OSError as error:
        logger.warning(f"could not cache the speed probe's figures in {path}: {error}")
        temporary.unlink(missing_ok=True)


def one_thread_int4_bytes_per_second() -> float:
    """The int4 decode figure measured now with one thread (`measure_node_speed`'s)."""
    import torch

    working_set = max(WORKING_SET_BYTES, LLC_MULTIPLE * _llc_bytes())
    with torch_threads(1), torch.inference_mode():
        return int4_decode_bytes_per_second(working_set)


def threads_contended(speed: NodeSpeed) -> bool:
    """Whether `speed`'s threads were held up by other work: its int4 decode figure (with
    `speed.threads` threads) is below one thread's, measured now. Each parallel region of
    the kernels waits for all its threads, so a thread that another busy process keeps off
    its CPU stalls every one: on the 2-core AMD EPYC, with a test suite running (load
    average 1.6-4, under `BUSY_LOAD_PER_CPU`), 2 threads measured 0.2-0.4 GB/s where 1
    thread measured 12 (session 10's fresh-user check)."""
    if speed.threads <= 1:
        return False
    return speed.int4_decode_bytes_per_second < one_thread_int4_bytes_per_second()


def cached_node_speed(
    remeasure: bool = False, path: Path | None = None, stop: threading.Event | None = None
) -> ProbeResult:
    """This node's speed: the cached figures when their key matches and they are settled;
    otherwise measured now (merged with unsettled cached figures by `fastest_of`, unless
    `remeasure`) and cached, settled when the machine was not busy before and after, other
    processes took at most `BUSY_OTHERS_SHARE` of the CPU time while it measured
    (`others_cpu_share`), and the threads were not held up (`threads_contended`).

    Raises:
        ProbeStopped: `stop` was set before the measurement ended (nothing is logged or
            cached).
    """
    path = path or cache_path()
    threads = runner_threads()
    key = probe_key(threads)
    cached = None if remeasure else _read_cache(path, key)
    if cached is not None and cached.settled:
        return cached
    busy_before = machine_busy()
    started = time.perf_counter()
    cpu_before = CpuUse.now()
    speed = measure_node_speed(threads, stop)
    share = others_cpu_share(cpu_before, CpuUse.now(), psutil.cpu_count(logical=True) or 1)
    others_busy = share is not None and share > BUSY_OTHERS_SHARE
    contended = threads_contended(speed)
    settled = not (busy_before or contended or others_busy or machine_busy())
    reason = (
        "threads held up by other work"
        if contended
        else f"other work took {share:.0%} of the CPUs"
        if others_busy and share is not None
        else "machine busy"
    )
    logger.info(
        f"speed probe ({threads} thread(s), {time.perf_counter() - started:.1f} s"
        f"{'' if settled else f', {reason}: measured again later'}): int4 decode "
        f"{speed.int4_decode_bytes_per_second / 1e9:.1f} GB/s, int8 "
        f"{speed.int8_decode_bytes_per_second / 1e9:.1f} GB/s, 5-bit "
        f"{(speed.int5_decode_bytes_per_second or 0.0) / 1e9:.1f} GB/s, int8 blocks "
        f"{(speed.int8_block_decode_bytes_per_second or 0.0) / 1e9:.1f} GB/s, copy "
        f"{speed.memory_copy_bytes_per_second / 1e9:.1f} GB/s, bf16 matmul "
        f"{speed.bf16_matmul_flops / 1e9:.1f} GFLOP/s, int4 prefill GEMM "
        f"{(speed.int4_prefill_int16_flops or 0.0) / 1e9:.1f} GFLOP/s (int16 activations) / "
        f"{(speed.int4_prefill_int8_flops or 0.0) / 1e9:.1f} (int8) / "
        f"{(speed.int4_prefill_bf16_flops or 0.0) / 1e9:.1f} (bf16), layer overhead "
        f"{speed.layer_overhead_seconds * 1e6:.0f} us"
    )
    if cached is not None:
        speed = fastest_of(speed, cached.speed)
    result = ProbeResult(speed, settled)
    write_cache(path, key, result)
    return result


if __name__ == "__main__":
    print(measure_node_speed().model_dump_json(indent=2))
