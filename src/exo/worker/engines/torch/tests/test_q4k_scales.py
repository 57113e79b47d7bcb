"""Compact Q4_K scales (`quant/q4k_scales.py`) against the bfloat16 (scale, zero) pairs an
old conversion of the same GGUF loads to: the pairs themselves, and bit for bit every
product that reads them (the decode kernel at both widths and with int8 activations,
prefill's block_matmul, the MoE experts kernel, the native decode layer's products), on
random Q4_K super-blocks with d and dmin across fp16's range (subnormal to large)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from exo.download.gguf_repack import q4k_compact_scales, repack_q4_k
from exo.worker.engines.torch.quant.int4_groups import (
    Int4Linear,
    int4_linear_from_groups,
    int4_linear_from_q4k,
)
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.q4k_scales import (
    COMPACT_Q4K_ENV,
    compact_from_stored,
    q4k_scale_pairs,
    q4k_scales_and_zeros,
)

needs_kernels = pytest.mark.skipif(built_int4_kernel() is None, reason="exo's kernels not built")

_Q4_K_BYTES = 144


def random_q4_k(rows: int, columns: int, seed: int) -> np.ndarray:
    """Raw Q4_K bytes `[rows, columns / 256 * 144]`: random scale fields and nibbles, d and
    dmin drawn log-uniformly over fp16's finite range from subnormals (2^-24) to 2^4."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows, columns // 256, _Q4_K_BYTES), dtype=np.uint8)
    for offset in (0, 2):
        halves = np.exp2(rng.uniform(-24.0, 4.0, blocks.shape[:2])).astype(np.float16)
        blocks[..., offset : offset + 2] = halves[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def both_forms(rows: int, columns: int, seed: int) -> tuple[Int4Linear, Int4Linear]:
    """The same Q4_K weight as an old conversion loads it (float32 scales and zeros → bf16
    pairs) and with compact scales."""
    data = random_q4_k(rows, columns, seed)
    groups = repack_q4_k(data, rows)
    packed = torch.from_numpy(groups.packed)
    old = int4_linear_from_groups(
        packed, torch.from_numpy(groups.scales), torch.from_numpy(groups.zeros), None
    )
    compact = compact_from_stored(torch.from_numpy(q4k_compact_scales(data, rows)))
    return old, int4_linear_from_q4k(packed, compact, None)


def test_compact_scales_give_the_repacked_groups_exactly() -> None:
    data = random_q4_k(64, 1024, seed=1)
    groups = repack_q4_k(data, 64)
    compact = compact_from_stored(torch.from_numpy(q4k_compact_scales(data, 64)))
    scales, zeros = q4k_scales_and_zeros(compact)
    assert torch.equal(scales, torch.from_numpy(groups.scales))
    assert torch.equal(zeros, torch.from_numpy(groups.zeros))
    pairs = torch.stack([scales, zeros], dim=-1).to(torch.bfloat16)
    assert torch.equal(q4k_scale_pairs(compact), pairs)


def test_the_compact_module_holds_the_same_weight() -> None:
    old, new = both_forms(128, 512, seed=2)
    assert torch.equal(new.scale_zero_by_output(), old.scale_zero_by_output())
    assert torch.equal(new.dequantize_float(), old.dequantize_float())
    if new.native:  # held as they are: 20 bytes per 256 inputs, not 32
        assert new.scales_and_zeros.dtype == torch.uint8
        assert new.scales_and_zeros.numel() * 32 == old.scales_and_zeros.numel() * 2 * 20


def test_compact_scales_can_be_expanded_at_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(COMPACT_Q4K_ENV, "0")
    old, new = both_forms(64, 512, seed=5)
    assert new.scales_and_zeros.dtype == old.scales_and_zeros.dtype
    assert torch.equal(new.scales_and_zeros, old.scales_and_zeros)


def test_fusing_compact_with_pairs_falls_back_to_pairs() -> None:
    old, new = both_forms(64, 512, seed=3)
    mixed = Int4Linear.concatenate([new, old])
    assert torch.equal(
        mixed.scale_zero_by_output(),
        torch.cat([old.scale_zero_by_output(), old.scale_zero_by_output()]),
    )
    fused = Int4Linear.concatenate([new, new])
    assert fused.scales_and_zeros.dtype == new.scales_and_zeros.dtype
    x = torch.randn(3, 512)
    assert torch.equal(fused(x), mixed(x))


@needs_kernels
def test_the_native_op_expands_as_the_load_does() -> None:
    old, new = both_forms(128, 768, seed=4)
    expanded = torch.ops.exo_native.q4k_scale_pairs(new.scales_and_zeros)
    assert torch.equal(expanded, old.scales_and_zeros)


_PRODUCTS_SCRIPT = """
import sys, torch
sys.path.insert(0, sys.argv[1])
from test_q4k_scales import both_forms
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
kernel = built_int4_kernel()
ops = torch.ops.exo_native
failures = []
# (out, in): an expert's gate/up and down at Qwen3-30B-A3B's widths; 1 and 9 super-blocks
# (the 512-bit kernel's last pair and odd block paths); odd output counts (tail tiles).
for out, k in ((64, 2048), (37, 768), (5, 256), (64, 2304)):
    old, new = both_forms(out if out % 64 == 0 else 64, k, seed=out + k)
    q, pairs, compact = old.packed[:out], old.scales_and_zeros[:out], new.scales_and_zeros[:out]
    for bits in (16, 8):
        ops.set_decode_activation_bits(bits)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 12):
                x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
                if not torch.equal(kernel(x, q, compact), kernel(x, q, pairs)):
                    failures.append(("decode", out, k, bits, threads, rows))
    ops.set_decode_activation_bits(16)
    for rows, bits, int16_rows in ((8, 16, 0), (40, 16, 0), (40, 8, 3)):
        x = torch.randn(rows, k)
        a = ops.block_matmul(x, q, compact, bits, int16_rows, False)
        b = ops.block_matmul(x, q, pairs, bits, int16_rows, False)
        if not torch.equal(a, b):
            failures.append(("prefill", out, k, rows, bits))
print("width", ops.int4_decode_bits(), "failures", failures)
assert not failures
"""


@needs_kernels
@pytest.mark.parametrize("avx512", ["1", "0"])
def test_products_equal_the_pairs_bit_for_bit(avx512: str) -> None:
    """Decode rows 1-12 (both tile widths: `EXO_NATIVE_AVX512` is read once per process,
    so each runs in a child), int16 and int8 decode activations, 1 and 2 threads, and
    prefill's block_matmul (int16, int8 with leading int16 rows)."""
    env = {**os.environ, "EXO_NATIVE_AVX512": avx512}
    done = subprocess.run(
        [sys.executable, "-c", _PRODUCTS_SCRIPT, str(Path(__file__).parent)],
        capture_output=True, text=True, env=env, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def moe_products(
    tokens: int, experts: list[tuple[Int4Linear, Int4Linear]], index: int, hidden: int
) -> torch.Tensor:
    """moe_int4_experts over `tokens` rows each sent to every expert (gate/up and down
    `experts[e][0]`, `[1]`), each weight in form `index` (0: pairs, 1: compact)."""
    generator = torch.Generator().manual_seed(tokens)
    count = len(experts) // 2
    rows = torch.randn(tokens, hidden, generator=generator)
    row_of = torch.arange(tokens).repeat(count)
    weight_of = torch.rand(tokens * count, generator=generator)
    spans = [value for e in range(count) for value in (e * tokens, (e + 1) * tokens)]
    gate_up, down = experts[:count], experts[count:]
    mode = [16, 0, 0]
    out: torch.Tensor = torch.ops.exo_native.moe_int4_experts(
        rows, row_of, weight_of, spans,
        [pair[index].packed for pair in gate_up],
        [pair[index].scales_and_zeros for pair in gate_up],
        [pair[index].packed for pair in down],
        [pair[index].scales_and_zeros for pair in down],
        0, mode, mode,
    )  # fmt: skip
    return out


@needs_kernels
def test_the_moe_experts_kernel_equals_the_pairs() -> None:
    """moe_int4_experts with each expert's compact scales against its pairs: decode rows
    (the decode kernel) and a prefill span (block_matmul)."""
    hidden, width = 512, 256
    experts = [both_forms(2 * width, hidden, seed=10 + e) for e in range(3)]
    experts += [both_forms(hidden, width, seed=20 + e) for e in range(3)]
    for tokens in (1, 12):
        compact = moe_products(tokens, experts, 1, hidden)
        assert torch.equal(compact, moe_products(tokens, experts, 0, hidden))
