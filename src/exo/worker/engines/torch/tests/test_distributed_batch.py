"""The step header multi-rank engines exchange (with a pipeline's per-row sampling), its
micro-batch split, and the replay of rank 0's KV-slot operations (no process group
needed)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from exo.worker.engines.torch.batching.batch_attention import PrefillSegment
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.sampling import (
    SampledToken,
    Sampler,
    TokenChooser,
    step_logprobs,
)
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.parallel.cache_ops import (
    CACHE_ALLOCATE,
    CACHE_FREE,
    CACHE_RESERVE,
    CacheOpLog,
    RecordingSlotKVCache,
    replay_cache_ops,
)
from exo.worker.engines.torch.parallel.last_rank_sampling import (
    FULL_ROW,
    RowSampling,
    answer_rows,
    read_answer,
)
from exo.worker.engines.torch.parallel.rank_steps import (
    MICRO_BATCH_MIN_ROWS,
    STEP,
    StepHeader,
    micro_batch_count,
    split_micro_batches,
)

# 3 decoding requests (slots 0, 2, 3) then prefill chunks of slots 1 (5 rows, the prompt's
# end: its last row wants logits) and 4 (2 rows, mid-prompt: no logits).
STEP_HEADER = StepHeader(
    command=STEP,
    cache_ops=((CACHE_ALLOCATE, 4, 0, 0), (CACHE_FREE, 5, 0, 0)),
    decode_slots=(0, 2, 3),
    decode_positions=(7, 9, 11),
    prefill=(PrefillSegment(1, 0, 3, 5), PrefillSegment(4, 32, 8, 2)),
    input_ids=tuple(range(100, 110)),
    position_ids=(7, 9, 11, 0, 1, 2, 3, 4, 32, 33),
    logit_rows=(0, 1, 2, 7),
    samplings=(
        RowSampling(True, -1, 0.0),
        FULL_ROW,
        RowSampling(True, 3, 0.7, 40, 0.95, 0.05, 2**62 + 12345),
        RowSampling(True, 0, 1.5, 0, 1.0, 0.0, 2**63 - 1),
    ),
)


def test_header_survives_encoding() -> None:
    assert StepHeader.decode(STEP_HEADER.encode()) == STEP_HEADER
    assert StepHeader.decode(StepHeader(STEP).encode()) == StepHeader(STEP)
    with pytest.raises(RuntimeError, match="malformed"):
        StepHeader.decode(torch.cat((STEP_HEADER.encode(), torch.tensor([1]))))


@pytest.mark.parametrize("parts", [1, 2, 3, 8])
def test_micro_batches_cover_the_step_once(parts: int) -> None:
    micro_batches = split_micro_batches(STEP_HEADER, parts)
    assert len(micro_batches) == min(parts, 5)  # 5 requests at most
    assert micro_batches[0].header.cache_ops == STEP_HEADER.cache_ops
    assert all(not batch.header.cache_ops for batch in micro_batches[1:])
    # Each (slot, position) row appears once, with its token.
    rows = sorted(
        (slot, position, token)
        for batch in micro_batches
        for slot, position, token in _rows(batch.header)
    )
    assert rows == sorted(_rows(STEP_HEADER))
    # Reassembling per-micro-batch "logits" (here: the row's token) in `logit_order` gives
    # the whole step's logit rows in order.
    # Each row's sampling goes with it.
    gathered: dict[int, tuple[int, RowSampling]] = {}
    for batch in micro_batches:
        header = batch.header
        for local, (local_row, order) in enumerate(
            zip(header.logit_rows, batch.logit_order, strict=True)
        ):
            gathered[order] = (header.input_ids[local_row], header.samplings[local])
    assert [gathered[order] for order in range(4)] == [
        (STEP_HEADER.input_ids[row], sampling)
        for row, sampling in zip(STEP_HEADER.logit_rows, STEP_HEADER.samplings, strict=True)
    ]
    if parts == 2:  # 10 rows: the 5-row chunk alone, the rest (5 rows) together
        assert sorted(batch.header.rows for batch in micro_batches) == [5, 5]


def _rows(header: StepHeader) -> list[tuple[int, int, int]]:
    """(slot, position, token) of every row, checked against the header's layout."""
    rows = [
        (slot, position, header.input_ids[index])
        for index, (slot, position) in enumerate(
            zip(header.decode_slots, header.decode_positions, strict=True)
        )
    ]
    offset = len(header.decode_slots)
    for segment in header.prefill:
        assert segment.offset == offset  # segments follow the decode rows, packed
        for row in range(segment.offset, segment.offset + segment.length):
            position = segment.start + row - segment.offset
            assert header.position_ids[row] == position
            rows.append((segment.slot, position, header.input_ids[row]))
        offset += segment.length
    assert offset == header.rows
    return rows


def test_replayed_slot_operations_keep_the_caches_alike() -> None:
    shape = (1, 1, 2)  # layers, kv heads, head dim
    recording = RecordingSlotKVCache(
        *shape, torch.float32, torch.device("cpu"), 4, log=CacheOpLog()
    )
    replica = SlotKVCache(*shape, torch.float32, torch.device("cpu"), 4)

    def fill(slot: int, length: int, value: float) -> None:  # a forward pass on both ranks
        for cache in (recording, replica):
            cache.keys[0][slot, :, :length] = value
            cache.lengths[slot] = length

    for value in (1.0, 2.0, 3.0):  # one request admitted per step
        slot = recording.allocate()
        replay_cache_ops(replica, recording.log.take())
        fill(slot, 3, value)
    recording.free(0)  # slot 2 (value 3) moves into slot 0
    recording.reserve(1000)
    slot = recording.allocate()
    ops = recording.log.take()
    assert [op[0] for op in ops] == [CACHE_FREE, CACHE_RESERVE, CACHE_ALLOCATE]
    assert recording.log.take() == ()
    replay_cache_ops(replica, ops)
    fill(slot, 2, 4.0)
    assert (replica.occupied, replica.lengths, replica.capacity) == (
        recording.occupied, recording.lengths, recording.capacity,
    )  # fmt: skip
    assert torch.equal(replica.keys[0][:3, :, :3], recording.keys[0][:3, :, :3])
    assert replica.keys[0][0, 0, 0, 0].item() == 3.0  # the moved slot
    with pytest.raises(RuntimeError, match="rank 0 got"):
        replay_cache_ops(replica, ((CACHE_ALLOCATE, 0, 0, 0),))
    with pytest.raises(RuntimeError, match="only from a prefix hit"):
        recording.write(0, torch.zeros(1), 1)


def test_only_a_step_with_many_rows_is_split_into_micro_batches() -> None:
    decode = StepHeader(
        STEP, decode_slots=(0, 1, 2, 3), decode_positions=(9, 9, 9, 9), input_ids=(1, 2, 3, 4),
        position_ids=(9, 9, 9, 9), logit_rows=(0, 1, 2, 3),
    )  # fmt: skip
    assert micro_batch_count(decode, 2) == 1
    rows = MICRO_BATCH_MIN_ROWS
    prefill = StepHeader(
        STEP, prefill=(PrefillSegment(0, 0, 0, rows),), input_ids=(1,) * rows,
        position_ids=tuple(range(rows)), logit_rows=(rows - 1,),
    )  # fmt: skip
    assert micro_batch_count(prefill, 3) == 3


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.0},
        {"temperature": 0.9},
        {"temperature": 0.8, "top_k": 20},
        {"temperature": 1.2, "top_p": 0.9, "min_p": 0.02},
    ],
)
def test_the_last_rank_picks_the_token_rank_zero_would(settings: dict[str, Any]) -> None:
    """A lean row's answer (through the header's encoding and the answer vector) gives the
    token and logprobs rank 0's sampler picks from the same logits with the same seed; a
    step whose row was skipped (pre-empted) hands out the same key again."""
    vocab_size = 300
    logits = 3 * torch.randn(12, vocab_size, generator=torch.Generator().manual_seed(4))
    params = SamplingParams(seed=11, **settings)
    alone = Sampler(params)
    state = SimpleNamespace(chooser=TokenChooser(Sampler(params)), top_logprobs=2)
    plain = SimpleNamespace(chooser=TokenChooser(Sampler(params)), top_logprobs=None)
    for row in logits:
        expected = alone.sample(row)
        sampling = RowSampling.of(state)  # type: ignore[arg-type]
        assert RowSampling.of(state) == sampling  # type: ignore[arg-type]
        assert RowSampling.decode(sampling.encode()) == sampling
        both = (sampling, RowSampling.of(plain), FULL_ROW)  # type: ignore[arg-type]
        answer = answer_rows(torch.stack((row, row, row)), both)
        assert answer.numel() == (3 + 2 * 2) + 1 + vocab_size
        lean, lean_plain, full = read_answer(answer, both, vocab_size)
        assert isinstance(lean, SampledToken) and isinstance(lean_plain, SampledToken)
        assert isinstance(full, torch.Tensor) and torch.equal(full, row)
        assert lean.token_id == lean_plain.token_id == expected
        assert lean.logprobs == step_logprobs(row, expected, 2) and lean_plain.logprobs is None
        assert state.chooser.choose(lean) == plain.chooser.choose(lean_plain) == expected
    # A chooser with a penalty, bias or constraint gets its logits.
    penalised = SamplingParams(temperature=0.0, presence_penalty=1.0)
    chooser = TokenChooser(Sampler(penalised), penalties=object())  # type: ignore[arg-type]
    assert RowSampling.of(SimpleNamespace(chooser=chooser, top_logprobs=None)) == FULL_ROW  # type: ignore[arg-type]
