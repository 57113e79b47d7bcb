"""The figures of a `NodeSpeed`, each measured on its own (`exo.node.speed_probe` runs
them all with the runners' thread count, and caches the result): the engine's int4, int8
and (where exo's kernels run) 5-bit and int8-block decode kernels as bytes read per second,
a memory copy, bfloat16 / float32 matmul FLOP/s, (where exo's kernels run) prefill's integer
GEMM FLOP/s with activations rounded to int16 and to int8, one tiny decoder layer's fixed
cost (`TinyLayer`, `NativeTinyLayer`) and a loopback round trip. Each is the fastest of timed
repetitions after a warm-up (`fastest_seconds`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Seconds of timed repetitions per figure (after one warm-up call).
PROBE_SECONDS = 0.2
# A mid-size model's MLP projection (e.g. Qwen3-0.6B's down projection is [1024, 3072]).
INT4_INPUTS = 2048
INT4_OUTPUTS = 2048
INT4_GROUP_SIZE = 32
MATMUL_ROWS = 256
MATMUL_INNER = 1024
# Prompt tokens of one timed prefill GEMM (`prefill_gemm_flops`), times an
# `[INT4_OUTPUTS, INT4_INPUTS]` weight: ~6-11 ms per call on 2 Zen 3 cores.
PREFILL_ROWS = 256


def fastest_seconds(call: Callable[[], object], seconds: float | None = None) -> float:
    """Fastest wall time of `call` over repetitions filling `seconds` (default
    `PROBE_SECONDS`, read at the call; at least 3, at most 10,000), after one warm-up call."""
    seconds = PROBE_SECONDS if seconds is None else seconds
    call()
    timings: list[float] = []
    deadline = time.perf_counter() + seconds
    while len(timings) < 3 or (time.perf_counter() < deadline and len(timings) < 10_000):
        started = time.perf_counter()
        call()
        timings.append(time.perf_counter() - started)
    return min(timings)


def fastest_seconds_interleaved(
    calls: Sequence[Callable[[], object]], seconds: float | None = None
) -> list[float]:
    """`fastest_seconds` of each of `calls`, their repetitions taken in turn over one
    `seconds` (so other work that holds the CPUs for a while slows every call's
    repetitions, not all of one call's: figures meant to be compared stay comparable)."""
    seconds = PROBE_SECONDS if seconds is None else seconds
    for call in calls:
        call()
    timings: list[list[float]] = [[] for _ in calls]
    deadline = time.perf_counter() + seconds
    while len(timings[0]) < 3 or (time.perf_counter() < deadline and len(timings[0]) < 10_000):
        for call, taken in zip(calls, timings, strict=True):
            started = time.perf_counter()
            call()
            taken.append(time.perf_counter() - started)
    return [min(taken) for taken in timings]


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
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

    return copies * matrix_bytes / fastest_seconds(step)


def int4_decode_bytes_per_second(working_set: int) -> float:
    import torch

    from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel

    kernel = native_int4_kernel()
    if kernel is not None:  # this CPU's int4 layers run exo's kernel (AVX2)
        return _native_int4_bytes_per_second(kernel, working_set)
    packed, scales_and_zeros = _int4_weights(INT4_OUTPUTS, INT4_INPUTS)
    row = torch.rand(1, INT4_INPUTS).to(torch.bfloat16)

    def product(row: Any, block: Any, scale_zero: Any) -> None:
        torch._weight_int4pack_mm_for_cpu(row, block, INT4_GROUP_SIZE, scale_zero)

    return _read_rate(product, row, (packed, scales_and_zeros), working_set)


def _native_int4_bytes_per_second(kernel: Callable[..., Any], working_set: int) -> float:
    """`int4_decode_bytes_per_second` for exo's kernel: its block layout, float32 rows."""
    import torch

    generator = torch.Generator().manual_seed(0)
    packed = torch.randint(
        0, 256, (INT4_OUTPUTS, INT4_INPUTS // 2), dtype=torch.uint8, generator=generator
    )
    groups = INT4_INPUTS // INT4_GROUP_SIZE
    scale_zero = torch.rand(INT4_OUTPUTS, groups, 2, generator=generator).to(torch.bfloat16)
    row = torch.rand(1, INT4_INPUTS, generator=generator)
    return _read_rate(kernel, row, (packed, scale_zero), working_set)


def native_block_bytes_per_second(kind: str, working_set: int) -> float:
    """Bytes per second exo's `kind` block kernel ("int5": GGUF Q5_0's 5-bit lanes,
    "int8_blocks": int8 values with (scale, zero) pairs) reads for one float32 row, over
    copies of an `[INT4_OUTPUTS, INT4_INPUTS]` weight filling `working_set`."""
    import torch

    from exo.worker.engines.torch.quant.int5_blocks import int5_row_bytes

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


def _prefill_weight(kind: str) -> tuple[Any, Any]:
    """An `[INT4_OUTPUTS, INT4_INPUTS]` weight as the engine holds `kind` ("int4": int4
    pairs with (scale, zero) per 32; "int5": 5-bit lanes, one scale per 32; "int8_blocks":
    int8 in [-32, 31] with one scale per 16, GGUF Q6_K's form) and its bfloat16 scales."""
    import torch

    from exo.worker.engines.torch.quant.int4_groups import pack_native_int4
    from exo.worker.engines.torch.quant.int5_blocks import int5_lanes

    generator = torch.Generator().manual_seed(4)
    shape = (INT4_OUTPUTS, INT4_INPUTS)
    if kind == "int4":
        levels = torch.randint(0, 16, shape, dtype=torch.uint8, generator=generator)
        pairs = torch.rand(INT4_OUTPUTS, INT4_INPUTS // INT4_GROUP_SIZE, 2, generator=generator)
        return pack_native_int4(levels), pairs.to(torch.bfloat16)
    if kind == "int5":
        values = torch.randint(-16, 16, shape, generator=generator)
        scales = torch.rand(INT4_OUTPUTS, INT4_INPUTS // INT4_GROUP_SIZE, generator=generator)
        return int5_lanes(values), scales.to(torch.bfloat16)
    values = torch.randint(-32, 32, shape, dtype=torch.int8, generator=generator)
    scales = torch.rand(INT4_OUTPUTS, INT4_INPUTS // 16, generator=generator)
    return values, scales.to(torch.bfloat16)


def prefill_gemm_flops(kind: str) -> tuple[float, float, float | None]:
    """FLOP/s (2 per multiply-add) of prefill's product (exo's `block_matmul`,
    native/prefill.cpp) of `PREFILL_ROWS` float32 rows times a `kind` weight
    (`_prefill_weight`), with the rows rounded to int16 and to int8 per block of 32, and to
    bfloat16 where that runs (`--prefill-activations`): `(int16, int8, bf16 or None)`,
    their repetitions in turn over `PROBE_SECONDS` (`fastest_seconds_interleaved`: the
    prediction reads their ratios; a call takes a few ms, so that is still tens of
    repetitions)."""
    import torch

    from exo.worker.engines.torch.quant.native_kernels import bf16_prefill_available

    weight, scales = _prefill_weight(kind)
    rows = torch.randn(PREFILL_ROWS, INT4_INPUTS, generator=torch.Generator().manual_seed(5))
    flops = 2 * PREFILL_ROWS * INT4_INPUTS * INT4_OUTPUTS

    def int16() -> object:
        return torch.ops.exo_native.block_matmul(rows, weight, scales, 16)

    def int8() -> object:
        return torch.ops.exo_native.block_matmul(rows, weight, scales, 8)

    def bf16() -> object:
        return torch.ops.exo_native.block_matmul(rows, weight, scales, 16, 0, True)

    if not bf16_prefill_available():
        int16_seconds, int8_seconds = fastest_seconds_interleaved([int16, int8])
        return flops / int16_seconds, flops / int8_seconds, None
    int16_seconds, int8_seconds, bf16_seconds = fastest_seconds_interleaved([int16, int8, bf16])
    return flops / int16_seconds, flops / int8_seconds, flops / bf16_seconds


def int8_decode_bytes_per_second(working_set: int) -> float:
    import torch

    from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel

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


def memory_copy_bytes_per_second(size: int) -> float:
    import torch

    source = torch.ones(size // 4)
    target = torch.empty_like(source)
    return 2 * size / fastest_seconds(lambda: target.copy_(source))


def matmul_flops(dtype_name: str) -> float:
    import torch

    dtype = getattr(torch, dtype_name)
    generator = torch.Generator().manual_seed(2)
    left = torch.rand(MATMUL_ROWS, MATMUL_INNER, generator=generator).to(dtype)
    right = torch.rand(MATMUL_INNER, MATMUL_INNER, generator=generator).to(dtype)
    flops = 2 * MATMUL_ROWS * MATMUL_INNER * MATMUL_INNER
    return flops / fastest_seconds(lambda: left @ right)


class TinyLayer:
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


class NativeTinyLayer:
    """`TinyLayer`'s layer as the engine runs it where exo's kernels run (AVX2): one call
    of exo's decode layer (`native/decode_layer.cpp`) on int4 weights in its layout."""

    def __init__(self) -> None:
        import torch

        from exo.worker.engines.torch.quant.int4_groups import pack_native_int4

        hidden, head_dim, mlp, heads = (
            TinyLayer.HIDDEN, TinyLayer.HEAD_DIM, TinyLayer.MLP, TinyLayer.HEADS,
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
        self.keys = torch.rand(1, 1, TinyLayer.CACHED + 1, head_dim, generator=generator)
        self.values = torch.rand(1, 1, TinyLayer.CACHED + 1, head_dim, generator=generator)
        angles = torch.rand(1, head_dim, generator=generator)
        self.cos, self.sin = angles.cos(), angles.sin()
        self.perm = torch.arange(head_dim).roll(head_dim // 2)
        self.partial = torch.empty(0)  # only a tensor rank's stages use it

    def forward(self) -> Any:
        import torch

        x = self.hidden.clone()
        torch.ops.exo_native.decode_layer(
            x, self.linears, self.norms, [1e-6] * 5, self.keys, self.values, [0],
            [TinyLayer.CACHED], self.cos, self.sin, self.perm, TinyLayer.HEADS, 1,
            TinyLayer.HEAD_DIM, 0, 0, TinyLayer.HEAD_DIM**-0.5, self.partial, 0,
        )  # fmt: skip
        return x


LOOPBACK_MESSAGE_BYTES = 64
LOOPBACK_TIMEOUT_SECONDS = 2.0


def loopback_round_trip_seconds(seconds: float | None = None) -> float:
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

            fastest = fastest_seconds(round_trip, seconds)
        echoer.join(LOOPBACK_TIMEOUT_SECONDS)
    return fastest
