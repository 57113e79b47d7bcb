"""Measures what this node's CPU does per second for the engine: a `NodeSpeed`.

Run once at start (`InfoGatherer` calls `cached_node_speed` in a worker thread, so the node
starts at once and reports the figures a moment later) and cached in
`<EXO_HOME>/speed_probe.json` under a key of CPU model, logical CPUs, CPU affinity, torch
version, thread count, whether exo's kernels run and `PROBE_VERSION`: a changed key, or
`exo --remeasure-speed`, measures again. Figures measured while other work kept the machine busy
(`machine_busy`), or with several threads slower than one thread (`threads_contended`),
are unsettled and not reported (the node has no speed, previews predict nothing): the node
measures again once the machine is quiet (`InfoGatherer` checks every 5 minutes for an
hour) and at its next start, keeping each figure's best (`fastest_of`), until a quiet
measurement settles them. The measurement takes about
`PROBE_SECONDS` × 7 (~1.5 s) plus building the operands.

What is measured is what the engine runs (`exo.worker.engines.torch.quantize`), with the
thread count its runners use (`runner_threads`: torch's default capped by the CPUs this
process may run on, as the engine does):
- int4 decode: `aten._weight_int4pack_mm_for_cpu` on one bfloat16 row against
  `[INT4_OUTPUTS, INT4_INPUTS]` packed weights (exo's own kernel on a float32 row where the
  engine runs it, `native_int4`), cycled over copies whose total exceeds the last-level
  cache (the weights of a decode step come from memory, not cache);
- int8 decode: `aten._weight_int8pack_mm` likewise (the engine's LM head), and where exo's
  kernels run its 5-bit and int8-block kernels (GGUF Q5_0, Q8_0 / Q5_1 / Q6_K layers);
- memory copy: `Tensor.copy_` of `COPY_BYTES`, counted as bytes read plus written;
- bfloat16 / float32 matmul FLOP/s at `[MATMUL_ROWS, MATMUL_INNER] @ [MATMUL_INNER,
  MATMUL_INNER]` (prefill);
- per-layer overhead: one decoder layer's decode ops at a tiny width (`_TinyLayer`: RMSNorm,
  int4 Q/K/V/O and gate/up/down with the engine's bfloat16 casts around each kernel, rotary,
  attention over a short KV cache, SiLU gate, residual adds), where bytes are negligible and
  only the fixed cost of each op remains;
- loopback round trip: a small message to a thread of this process and back over TCP on
  127.0.0.1 (what a message between two runners on this machine costs at least).
Each figure is the fastest of timed repetitions after a warm-up (the least disturbed by
other work, as `timeit` advises): the node's capability, not its load at start.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from loguru import logger
from pydantic import ValidationError

from exo.shared.constants import exo_home
from exo.shared.types.nodes import NodeSpeed

# Bump when what is measured changes: cached figures of an older probe are measured again.
PROBE_VERSION = 7  # 7: the int8 head kernel timed without a cast per call; 6: 5-bit lanes
CACHE_FILE_NAME = "speed_probe.json"
# Seconds of timed repetitions per figure (after one warm-up call).
PROBE_SECONDS = 0.2
# A mid-size model's MLP projection (e.g. Qwen3-0.6B's down projection is [1024, 3072]).
INT4_INPUTS = 2048
INT4_OUTPUTS = 2048
INT4_GROUP_SIZE = 32
# Weights cycled through per repetition, at least this many bytes (above a typical LLC) and
# this many times the last-level cache: on the 2-core AMD EPYC (32 MiB L3, a victim cache)
# twice the L3 still hit it often enough to read int8 weights at 26-29 GB/s, where a model's
# 178 MB LM head reads at 21; four times measured 23-24.
WORKING_SET_BYTES = 48 * 2**20
LLC_MULTIPLE = 4
COPY_BYTES = 64 * 2**20
MATMUL_ROWS = 256
MATMUL_INNER = 1024
# A 1-minute load average above this per logical CPU: figures measured then are unsettled
# (not reported). Each figure is the fastest of many short repetitions, which a moderate
# load (a test suite, a model loading next to the probe) barely moves; the figures that came
# out ~80x too low were measured at load averages of 20-70 on 2 CPUs. A lower bound would
# leave a node that starts while it loads its own model with no speed (and no predictions)
# for the 5 minutes until the next check.
BUSY_LOAD_PER_CPU = 3.0


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

    from exo.utils.info_gatherer import cpu_model
    from exo.worker.engines.torch.native_int4 import native_int4_wanted

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


def _fastest_seconds(call: Callable[[], object], seconds: float = PROBE_SECONDS) -> float:
    """Fastest wall time of `call` over repetitions filling `seconds` (at least 3, at most
    10,000), after one warm-up call."""
    call()
    timings: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(timings) < 3 or (time.perf_counter() < deadline and len(timings) < 10_000):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return min(timings)


@contextmanager
def _torch_threads(threads: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _int4_weights(outputs: int, inputs: int) -> tuple[Any, Any]:
    import torch

    generator = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (outputs, inputs), dtype=torch.int32, generator=generator)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(levels, 1)
    groups = inputs // INT4_GROUP_SIZE
    scales_and_zeros = torch.rand(groups, outputs, 2, generator=generator).to(torch.bfloat16)
    return packed, scales_and_zeros


def _read_rate(
    kernel: Callable[..., object], row: Any, operands: tuple[Any, ...], working_set: int
) -> float:
    """Bytes per second `kernel(row, *operands)` reads: the operands (a weight and its
    scales) copied until the copies fill `working_set`, each timed repetition running the
    kernel once over every copy, so the weights come from memory and not from cache."""
    matrix_bytes = sum(operand.numel() * operand.element_size() for operand in operands)
    copies = max(1, -(-working_set // matrix_bytes))
    weights = [tuple(operand.clone() for operand in operands) for _ in range(copies)]

    def step() -> None:
        for copy in weights:
            kernel(row, *copy)

    return copies * matrix_bytes / _fastest_seconds(step)


def _int4_decode_bytes_per_second(working_set: int) -> float:
    import torch

    from exo.worker.engines.torch.native_int4 import native_int4_kernel

    kernel = native_int4_kernel()
    if kernel is not None:  # this CPU's int4 layers run exo's kernel (AVX2)
        return _native_int4_bytes_per_second(kernel, working_set)
    packed, scales_and_zeros = _int4_weights(INT4_OUTPUTS, INT4_INPUTS)
    row = torch.rand(1, INT4_INPUTS).to(torch.bfloat16)

    def product(row: Any, block: Any, scale_zero: Any) -> None:
        torch._weight_int4pack_mm_for_cpu(row, block, INT4_GROUP_SIZE, scale_zero)

    return _read_rate(product, row, (packed, scales_and_zeros), working_set)


def _native_int4_bytes_per_second(kernel: Callable[..., Any], working_set: int) -> float:
    """`_int4_decode_bytes_per_second` for exo's kernel: its block layout, float32 rows."""
    import torch

    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(
        0, 256, (INT4_OUTPUTS, INT4_INPUTS // 2), dtype=torch.uint8, generator=generator
    )
    groups = INT4_INPUTS // INT4_GROUP_SIZE
    scale_zero = torch.rand(INT4_OUTPUTS, groups, 2, generator=generator).to(torch.bfloat16)
    row = torch.rand(1, INT4_INPUTS, generator=generator)
    return _read_rate(kernel, row, (packed, scale_zero), working_set)


def _native_block_bytes_per_second(kind: str, working_set: int) -> float:
    """Bytes per second exo's `kind` block kernel ("int5": GGUF Q5_0's 5-bit lanes,
    "int8_blocks": int8 values with (scale, zero) pairs) reads for one float32 row, over
    copies of an `[INT4_OUTPUTS, INT4_INPUTS]` weight filling `working_set`."""
    import torch

    from exo.worker.engines.torch.int5_blocks import int5_row_bytes

    generator = torch.Generator().manual_seed(3)
    blocks = INT4_INPUTS // INT4_GROUP_SIZE
    if kind == "int5":  # 5-bit lanes: three 5-bit values per 16-bit lane (bit 15 clear)
        lanes = torch.randint(
            0, 1 << 15, (INT4_OUTPUTS, int5_row_bytes(INT4_INPUTS) // 2), generator=generator
        )
        held = lanes.to(torch.int16).view(torch.uint8)
        scales = torch.rand(INT4_OUTPUTS, blocks, generator=generator).to(torch.bfloat16)
        kernel = torch.ops.exo_native.int5_gemv
    else:
        held = torch.randint(
            -128, 128, (INT4_OUTPUTS, INT4_INPUTS), dtype=torch.int8, generator=generator
        )
        scales = torch.rand(INT4_OUTPUTS, blocks, 2, generator=generator).to(torch.bfloat16)
        kernel = torch.ops.exo_native.int8_block_gemv
    row = torch.rand(1, INT4_INPUTS, generator=generator)
    return _read_rate(kernel, row, (held, scales), working_set)


def _int8_decode_bytes_per_second(working_set: int) -> float:
    import torch

    from exo.worker.engines.torch.native_int4 import native_int4_kernel

    generator = torch.Generator().manual_seed(1)
    weight = torch.randint(-127, 128, (INT4_OUTPUTS, INT4_INPUTS), generator=generator)
    weight = weight.to(torch.int8)
    scales = torch.rand(INT4_OUTPUTS, generator=generator).to(torch.bfloat16)
    if native_int4_kernel() is not None:  # Int8Linear runs exo's kernel (AVX2)
        return _read_rate(
            torch.ops.exo_native.int8_channel_gemv, torch.rand(1, INT4_INPUTS), (weight, scales),
            working_set,
        )  # fmt: skip
    row = torch.rand(1, INT4_INPUTS).to(torch.bfloat16)
    return _read_rate(torch._weight_int8pack_mm, row, (weight, scales), working_set)


def _memory_copy_bytes_per_second(size: int) -> float:
    import torch

    source = torch.ones(size // 4)
    target = torch.empty_like(source)
    return 2 * size / _fastest_seconds(lambda: target.copy_(source))


def _matmul_flops(dtype_name: str) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(2)
    left = torch.rand(MATMUL_ROWS, MATMUL_INNER, generator=generator).to(dtype)
    right = torch.rand(MATMUL_INNER, MATMUL_INNER, generator=generator).to(dtype)
    flops = 2 * MATMUL_ROWS * MATMUL_INNER * MATMUL_INNER
    return flops / _fastest_seconds(lambda: left @ right)


class _TinyLayer:
    """One Llama-style decoder layer's decode ops at a tiny width (hidden 64, 2 query heads
    and 1 KV head of 32, MLP 128, 16 cached tokens), float32 activations cast to bfloat16
    around each int4 kernel as `QuantizedLinear.forward` does."""

    HIDDEN = 64
    HEAD_DIM = 32
    HEADS = 2
    MLP = 128
    CACHED = 16

    def __init__(self) -> None:
        import torch

        hidden, head_dim, mlp = self.HIDDEN, self.HEAD_DIM, self.MLP
        self.projections = {
            "q": _int4_weights(self.HEADS * head_dim, hidden),
            "k": _int4_weights(head_dim, hidden),
            "v": _int4_weights(head_dim, hidden),
            "o": _int4_weights(hidden, self.HEADS * head_dim),
            "gate": _int4_weights(mlp, hidden),
            "up": _int4_weights(mlp, hidden),
            "down": _int4_weights(hidden, mlp),
        }
        generator = torch.Generator().manual_seed(3)
        self.norm = torch.ones(hidden)
        self.hidden = torch.rand(1, 1, hidden, generator=generator)
        self.keys = torch.rand(1, 1, self.CACHED, head_dim, generator=generator)
        self.values = torch.rand(1, 1, self.CACHED, head_dim, generator=generator)
        angles = torch.rand(1, 1, 1, head_dim, generator=generator)
        self.cos, self.sin = angles.cos(), angles.sin()

    def _linear(self, name: str, x: Any) -> Any:
        import torch

        packed, scales_and_zeros = self.projections[name]
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        out = torch._weight_int4pack_mm_for_cpu(rows, packed, INT4_GROUP_SIZE, scales_and_zeros)
        return out.to(x.dtype).reshape(*x.shape[:-1], out.shape[-1])

    def _rms_norm(self, x: Any) -> Any:
        import torch

        variance = x.pow(2).mean(-1, keepdim=True)
        return self.norm * (x * torch.rsqrt(variance + 1e-6))

    def _rotate(self, x: Any) -> Any:
        import torch

        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * self.cos + rotated * self.sin

    def forward(self) -> Any:
        import torch

        x = self.hidden
        normed = self._rms_norm(x)
        query = self._linear("q", normed).view(1, 1, self.HEADS, self.HEAD_DIM).transpose(1, 2)
        key = self._linear("k", normed).view(1, 1, 1, self.HEAD_DIM).transpose(1, 2)
        value = self._linear("v", normed).view(1, 1, 1, self.HEAD_DIM).transpose(1, 2)
        query, key = self._rotate(query), self._rotate(key)
        keys = torch.cat((self.keys, key), dim=2).expand(1, self.HEADS, -1, -1)
        values = torch.cat((self.values, value), dim=2).expand(1, self.HEADS, -1, -1)
        attended = torch.nn.functional.scaled_dot_product_attention(query, keys, values)
        x = x + self._linear("o", attended.transpose(1, 2).reshape(1, 1, -1))
        normed = self._rms_norm(x)
        gated = torch.nn.functional.silu(self._linear("gate", normed)) * self._linear("up", normed)
        return x + self._linear("down", gated)


class _NativeTinyLayer:
    """`_TinyLayer`'s layer as the engine runs it where exo's kernels run (AVX2): one call
    of exo's decode layer (`native/decode_layer.cpp`) on int4 weights in its layout."""

    def __init__(self) -> None:
        import torch

        from exo.worker.engines.torch.quantize import pack_native_int4

        hidden, head_dim, mlp, heads = (
            _TinyLayer.HIDDEN, _TinyLayer.HEAD_DIM, _TinyLayer.MLP, _TinyLayer.HEADS,
        )  # fmt: skip
        generator = torch.Generator().manual_seed(3)

        def weights(outputs: int, inputs: int) -> list[Any]:
            levels = torch.randint(0, 16, (outputs, inputs), dtype=torch.uint8, generator=generator)
            pairs = torch.rand(outputs, inputs // 32, 2, generator=generator)
            return [pack_native_int4(levels), pairs.to(torch.bfloat16), None]

        self.linears = [
            *weights((heads + 2) * head_dim, hidden), *weights(hidden, heads * head_dim),
            *weights(2 * mlp, hidden), *weights(hidden, mlp),
        ]  # fmt: skip
        self.norms = [torch.ones(hidden), torch.ones(hidden), None, None, None]
        self.hidden = torch.rand(1, hidden, generator=generator)
        self.keys = torch.rand(1, 1, _TinyLayer.CACHED + 1, head_dim, generator=generator)
        self.values = torch.rand(1, 1, _TinyLayer.CACHED + 1, head_dim, generator=generator)
        angles = torch.rand(1, head_dim, generator=generator)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.perm = torch.arange(head_dim).roll(head_dim // 2)
        self.partial = torch.empty(0)  # only a tensor rank's stages use it

    def forward(self) -> Any:
        import torch

        x = self.hidden.clone()
        torch.ops.exo_native.decode_layer(
            x, self.linears, self.norms, [1e-6] * 5, self.keys, self.values, [0],
            [_TinyLayer.CACHED], self.cos, self.sin, self.perm, _TinyLayer.HEADS, 1,
            _TinyLayer.HEAD_DIM, 0, 0, _TinyLayer.HEAD_DIM**-0.5, self.partial, 0,
        )  # fmt: skip
        return x


LOOPBACK_MESSAGE_BYTES = 64
LOOPBACK_TIMEOUT_SECONDS = 2.0


def _loopback_round_trip_seconds(seconds: float = PROBE_SECONDS) -> float:
    """Fastest round trip of a `LOOPBACK_MESSAGE_BYTES` message to an echoing thread over
    TCP on 127.0.0.1 (Nagle off); sockets time out rather than hang."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(LOOPBACK_TIMEOUT_SECONDS)

        def echo() -> None:
            try:
                peer, _ = server.accept()
            except OSError:
                return
            with peer:
                peer.settimeout(LOOPBACK_TIMEOUT_SECONDS)
                peer.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                try:
                    while message := peer.recv(LOOPBACK_MESSAGE_BYTES):
                        peer.sendall(message)
                except OSError:
                    return

        echoer = threading.Thread(target=echo, name="speed-probe-echo", daemon=True)
        echoer.start()
        with socket.create_connection(server.getsockname(), LOOPBACK_TIMEOUT_SECONDS) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            message = bytes(LOOPBACK_MESSAGE_BYTES)

            def round_trip() -> None:
                client.sendall(message)
                received = 0
                while received < LOOPBACK_MESSAGE_BYTES:
                    chunk = client.recv(LOOPBACK_MESSAGE_BYTES - received)
                    if not chunk:
                        raise OSError("the echo thread closed the connection")
                    received += len(chunk)

            fastest = _fastest_seconds(round_trip, seconds)
        echoer.join(LOOPBACK_TIMEOUT_SECONDS)
    return fastest


def measure_node_speed(threads: int | None = None) -> NodeSpeed:
    """Measure this CPU now with `threads` torch threads (default `runner_threads()`); the
    process's own thread count is restored afterwards."""
    import torch

    threads = threads or runner_threads()
    working_set = max(WORKING_SET_BYTES, LLC_MULTIPLE * _llc_bytes())
    from exo.worker.engines.torch.native_int4 import native_int4_kernel

    native = native_int4_kernel() is not None
    with _torch_threads(threads), torch.inference_mode():
        layer: _TinyLayer | _NativeTinyLayer = _NativeTinyLayer() if native else _TinyLayer()
        return NodeSpeed(
            threads=threads,
            int4_decode_bytes_per_second=_int4_decode_bytes_per_second(working_set),
            int8_decode_bytes_per_second=_int8_decode_bytes_per_second(working_set),
            memory_copy_bytes_per_second=_memory_copy_bytes_per_second(COPY_BYTES),
            bf16_matmul_flops=_matmul_flops("bfloat16"),
            float32_matmul_flops=_matmul_flops("float32"),
            layer_overhead_seconds=_fastest_seconds(layer.forward),
            loopback_round_trip_seconds=_loopback_round_trip_seconds(),
            native_kernels=native,
            int5_decode_bytes_per_second=(
                _native_block_bytes_per_second("int5", working_set) if native else None
            ),
            int8_block_decode_bytes_per_second=(
                _native_block_bytes_per_second("int8_blocks", working_set) if native else None
            ),
        )


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


def _write_cache(path: Path, key: dict[str, Any], result: ProbeResult) -> None:
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
    with _torch_threads(1), torch.inference_mode():
        return _int4_decode_bytes_per_second(working_set)


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


def cached_node_speed(remeasure: bool = False, path: Path | None = None) -> ProbeResult:
    """This node's speed: the cached figures when their key matches and they are settled;
    otherwise measured now (merged with unsettled cached figures by `fastest_of`, unless
    `remeasure`) and cached, settled when the machine was not busy before and after and
    the threads were not held up (`threads_contended`)."""
    path = path or cache_path()
    threads = runner_threads()
    key = probe_key(threads)
    cached = None if remeasure else _read_cache(path, key)
    if cached is not None and cached.settled:
        return cached
    busy_before = machine_busy()
    started = time.perf_counter()
    speed = measure_node_speed(threads)
    contended = threads_contended(speed)
    settled = not (busy_before or contended or machine_busy())
    reason = "threads held up by other work" if contended else "machine busy"
    logger.info(
        f"speed probe ({threads} thread(s), {time.perf_counter() - started:.1f} s"
        f"{'' if settled else f', {reason}: measured again later'}): int4 decode "
        f"{speed.int4_decode_bytes_per_second / 1e9:.1f} GB/s, int8 "
        f"{speed.int8_decode_bytes_per_second / 1e9:.1f} GB/s, 5-bit "
        f"{(speed.int5_decode_bytes_per_second or 0.0) / 1e9:.1f} GB/s, int8 blocks "
        f"{(speed.int8_block_decode_bytes_per_second or 0.0) / 1e9:.1f} GB/s, copy "
        f"{speed.memory_copy_bytes_per_second / 1e9:.1f} GB/s, bf16 matmul "
        f"{speed.bf16_matmul_flops / 1e9:.1f} GFLOP/s, layer overhead "
        f"{speed.layer_overhead_seconds * 1e6:.0f} us"
    )
    if cached is not None:
        speed = fastest_of(speed, cached.speed)
    result = ProbeResult(speed, settled)
    _write_cache(path, key, result)
    return result


if __name__ == "__main__":
    print(measure_node_speed().model_dump_json(indent=2))
