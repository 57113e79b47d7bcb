import torch
from transformers.cache_utils import DynamicLayer

from exo.worker.engines.torch.kv_cache import PreallocatedLayer


def states(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    shape = (1, 3, length, 8)  # [batch, kv_heads, new positions, head_dim]
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_preallocated_layer_matches_dynamic_layer_through_growth() -> None:
    ours, reference = PreallocatedLayer(capacity_tokens=4), DynamicLayer()
    for step, length in enumerate([3, 1, 1, 5, 1]):  # exceeds the capacity of 4 twice
        keys, values = states(length, step)
        our_keys, our_values = ours.update(keys, values)
        expected_keys, expected_values = reference.update(keys, values)
        assert torch.equal(our_keys, expected_keys)
        assert torch.equal(our_values, expected_values)
        assert ours.get_seq_length() == reference.get_seq_length()
        assert ours.get_mask_sizes(1) == reference.get_mask_sizes(1)


def test_preallocated_layer_writes_in_place_within_capacity() -> None:
    layer = PreallocatedLayer(capacity_tokens=16)
    keys, _ = layer.update(*states(4, 0))
    first_pointer = keys.data_ptr()
    keys, _ = layer.update(*states(1, 1))
    assert keys.data_ptr() == first_pointer  # same buffer, no re-concatenation
    assert keys.shape == (1, 3, 5, 8)


def test_preallocated_layer_crop() -> None:
    layer = PreallocatedLayer(capacity_tokens=8)
    layer.update(*states(6, 0))
    layer.crop(-2)
    assert layer.get_seq_length() == 4
    keys, _ = layer.update(*states(1, 1))
    assert keys.shape[-2] == 5
    assert torch.equal(keys[:, :, 4:], states(1, 1)[0])
