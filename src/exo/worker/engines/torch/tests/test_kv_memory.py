"""KV slot memory: buffers read as zeros, released positions read as zeros again and go back
to the OS, so resident KV memory follows the positions held (the soak's runner RSS drift)."""

from __future__ import annotations

import sys

import psutil
import pytest
import torch

from exo.worker.engines.torch.batching.kv_memory import release, release_positions, zeroed_kv_buffer
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache

CPU = torch.device("cpu")
MIB = 2**20


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def test_buffer_starts_zero_and_release_zeroes_only_its_range() -> None:
    buffer = zeroed_kv_buffer((3, 2, 4096, 8), torch.float32, CPU)
    assert buffer.shape == (3, 2, 4096, 8)
    assert torch.count_nonzero(buffer) == 0
    buffer.fill_(1.5)
    release_positions(buffer, 1, 1000)  # not page aligned: the edges are zeroed in place
    assert torch.all(buffer[0] == 1.5) and torch.all(buffer[2] == 1.5)
    assert torch.all(buffer[1, :, :1000] == 1.5)
    assert torch.count_nonzero(buffer[1, :, 1000:]) == 0
    release_positions(buffer, 2, 0)
    assert torch.count_nonzero(buffer[2]) == 0 and torch.all(buffer[0] == 1.5)
    buffer[2].fill_(2.0)  # released memory is writable again
    assert torch.all(buffer[2] == 2.0)


def test_release_refuses_a_strided_region() -> None:
    buffer = zeroed_kv_buffer((4, 4), torch.float32, CPU)
    with pytest.raises(ValueError, match="contiguous"):
        release(buffer[:, 1])


def test_release_of_an_ordinary_tensor_zeroes_it() -> None:
    tensor = torch.ones(10_000, dtype=torch.bfloat16)
    release(tensor[3:9_000])
    assert torch.all(tensor[:3] == 1) and torch.all(tensor[9_000:] == 1)
    assert torch.count_nonzero(tensor[3:9_000]) == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise is Linux's")
def test_freed_slots_give_their_memory_back() -> None:
    # One layer, one KV head of 64: a slot of 65,536 positions is 16 MiB of keys + 16 of values.
    cache = SlotKVCache(1, 1, 64, torch.float32, CPU, slots=8)
    before = _rss()
    cache.reserve(65_536)
    assert _rss() - before < 16 * MIB, "reserving capacity backs no memory"
    slots = [cache.allocate() for _ in range(6)]
    for slot in slots:
        for tensors in (cache.keys, cache.values):
            tensors[0][slot].fill_(float(slot + 1))
        cache.lengths[slot] = 65_536
    filled = _rss()
    assert filled - before > 150 * MIB  # 6 slots x 32 MiB written
    assert cache.free(slots[0]) == slots[-1]  # the last slot moves into slot 0
    assert torch.all(cache.keys[0][0] == 6.0) and torch.count_nonzero(cache.keys[0][5]) == 0
    for slot in reversed(range(cache.occupied)):
        cache.free(slot)
    assert filled - _rss() > 150 * MIB, "freed slots still hold their pages"
    assert torch.count_nonzero(cache.keys[0]) == 0 and torch.count_nonzero(cache.values[0]) == 0


def test_a_slot_freed_for_a_shorter_one_keeps_no_stale_tail() -> None:
    cache = SlotKVCache(2, 2, 16, torch.float32, CPU, slots=3)
    long_slot, short_slot = cache.allocate(), cache.allocate()
    for layer in range(2):
        cache.keys[layer][long_slot, :, :200].fill_(1.0)
        cache.keys[layer][short_slot, :, :10].fill_(2.0)
    cache.lengths[long_slot], cache.lengths[short_slot] = 200, 10
    assert cache.free(long_slot) == short_slot
    assert cache.lengths[long_slot] == 10
    for layer in range(2):
        assert torch.all(cache.keys[layer][long_slot, :, :10] == 2.0)
        assert torch.count_nonzero(cache.keys[layer][long_slot, :, 10:]) == 0
        assert torch.count_nonzero(cache.keys[layer][short_slot]) == 0
