"""exo's decode attention (`native/decode_attention.cpp`) against a float64 reference, on
both vector widths: decode rows of several slots, a speculative draft's verify rows, short
prompt chunks (the row kernel) and a long one (torch's SDPA), every head dimension path
(registers for 64 / 128 / 256, a runtime loop, one value at a time), grouped-query heads,
sliding windows, rows split over several tasks (more than 512 keys), float32 and bfloat16
caches. A row's output must be the same bits whatever other rows share its call (a verified
draft position equals the plain decode step's)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel

pytestmark = pytest.mark.skipif(
    built_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)

# float32 sums of a few thousand products against float64: the widened bfloat16 values
# are exact, so only the float32 arithmetic differs.
TOLERANCE = 2e-5


@dataclass(frozen=True)
class Case:
    heads: int
    kv_heads: int
    head_dim: int
    window: int = 0


CASES = [
    Case(9, 3, 64),  # SmolLM2's shape
    Case(8, 1, 128),
    Case(4, 1, 256, window=37),  # Gemma 3 270M's shape, a sliding-window layer
    Case(4, 4, 80),  # a runtime loop at 512 bits (5 vectors), at 256 (10)
    Case(6, 2, 40),  # 256-bit only (40 is no multiple of 16)
    Case(2, 1, 12),  # one value at a time
]


@pytest.fixture(params=[512, 256])
def width(request: pytest.FixtureRequest) -> Iterator[int]:
    vector_bits = torch.ops.exo_native.decode_attention_vector_bits
    if request.param == 512 and vector_bits(0) != 512:
        pytest.skip("the native kernels were built without AVX512F here")
    previous = vector_bits(0)
    vector_bits(request.param)
    try:
        yield request.param
    finally:
        vector_bits(previous)


def _cache(case: Case, slots: int, capacity: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    shape = (slots, case.kv_heads, capacity, case.head_dim)
    return torch.randn(shape, generator=generator).to(dtype)


def _reference(
    case: Case,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: list[int],
    positions: list[int],
    scaling: float,
) -> torch.Tensor:
    """Each row's heads attending to its slot's keys from the window's start to its position,
    in float64: [rows, heads * head_dim]."""
    group = case.heads // case.kv_heads
    out = torch.empty(len(slots), case.heads, case.head_dim, dtype=torch.float64)
    for row, (slot, position) in enumerate(zip(slots, positions, strict=True)):
        first = max(0, position - case.window + 1) if case.window else 0
        for head in range(case.heads):
            k = keys[slot, head // group, first : position + 1].double()
            v = values[slot, head // group, first : position + 1].double()
            q = queries[row, head * case.head_dim : (head + 1) * case.head_dim].double()
            weights = torch.softmax(k @ q * scaling, dim=0)
            out[row, head] = weights @ v
    return out.reshape(len(slots), -1)


def _attend(
    case: Case,
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    slots: list[int],
    positions: list[int],
    scaling: float,
) -> torch.Tensor:
    # qkv rows: the queries, then room for keys and values (not read by the attention).
    kv_width = 2 * case.kv_heads * case.head_dim
    qkv = torch.cat([queries, torch.zeros(queries.shape[0], kv_width)], dim=1).contiguous()
    result: torch.Tensor = torch.ops.exo_native.decode_attention_of(
        qkv, keys, values, torch.tensor(slots), torch.tensor(positions), case.heads,
        case.window, scaling,
    )  # fmt: skip
    return result


# (slot, position) rows of one step: decode rows of three slots (one past 512 keys: split
# over tasks; one past 1,024); a draft's verify rows of slot 3 from its last position down,
# across the 512-key split; short prompt chunks (the row kernel): slot 4's, slot 6's across
# the split, slot 7's from the start (inside every window); a long chunk of slot 5 (SDPA).
# The consecutive rows of one slot share tasks in the row kernel.
STEP = (
    [(0, 3), (1, 700), (2, 1300)]
    + [(3, 514 - i) for i in range(5)]
    + [(4, 40 + i) for i in range(3)]
    + [(6, 508 + i) for i in range(8)]
    + [(7, 2 + i) for i in range(4)]
    + [(5, 1000 + i) for i in range(20)]
)
ROW_KERNEL_ROWS = len(STEP) - 20


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c.heads}x{c.kv_heads}x{c.head_dim}")
def test_rows_equal_the_float64_reference(case: Case, dtype: torch.dtype, width: int) -> None:
    slots = [slot for slot, _ in STEP]
    positions = [position for _, position in STEP]
    keys = _cache(case, 8, 1400, dtype, seed=1)
    values = _cache(case, 8, 1400, dtype, seed=2)
    queries = torch.randn(
        len(STEP), case.heads * case.head_dim, generator=torch.Generator().manual_seed(3)
    )
    scaling = 1.0 / math.sqrt(case.head_dim)
    attended = _attend(case, queries, keys, values, slots, positions, scaling)
    expected = _reference(case, queries, keys, values, slots, positions, scaling)
    assert (attended.double() - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: f"{c.heads}x{c.kv_heads}x{c.head_dim}")
def test_a_row_is_the_same_bits_whatever_shares_its_call(case: Case, width: int) -> None:
    keys = _cache(case, 8, 1400, torch.bfloat16, seed=4)
    values = _cache(case, 8, 1400, torch.bfloat16, seed=5)
    queries = torch.randn(
        len(STEP), case.heads * case.head_dim, generator=torch.Generator().manual_seed(6)
    )
    scaling = 1.0 / math.sqrt(case.head_dim)
    slots = [slot for slot, _ in STEP]
    positions = [position for _, position in STEP]
    together = _attend(case, queries, keys, values, slots, positions, scaling)
    # The row kernel's rows (not the long chunk's, which SDPA computes as one): alone, and
    # in another company (a chunk's rows share tasks, a row alone has its own).
    for row in range(ROW_KERNEL_ROWS):
        alone = _attend(
            case,
            queries[row : row + 1],
            keys,
            values,
            slots[row : row + 1],
            positions[row : row + 1],
            scaling,
        )
        assert torch.equal(alone[0], together[row]), row
    others = [0, 2, 4, 6, 8, 12, 14, 19]
    mixed = _attend(
        case,
        queries[others],
        keys,
        values,
        [slots[i] for i in others],
        [positions[i] for i in others],
        scaling,
    )
    for index, row in enumerate(others):
        assert torch.equal(mixed[index], together[row]), row


def test_a_score_far_below_the_largest_weighs_nothing(width: int) -> None:
    """Exponentials of scores more than 87 below their row's largest are 0 (no denormals,
    nothing NaN): a row with one key far above the rest returns that key's value."""
    case = Case(1, 1, 64)
    keys = torch.zeros(1, 1, 40, 64)
    values = torch.randn(1, 1, 40, 64, generator=torch.Generator().manual_seed(7))
    keys[0, 0, 17] = 10.0
    query = torch.full((1, 64), 10.0)
    attended = _attend(case, query, keys, values, [0], [39], 1.0)
    assert torch.equal(attended[0], values[0, 0, 17])
