"""`vision_parts.load_vision_tensors` through `VisionTower.load` (a tiny Gemma 3 tower from a
bfloat16 safetensors file): every tensor is the file's, widened to float32, in modules built
without initialization; a tensor of another shape is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from exo.testing.vision_checkpoints import tiny_gemma3_vision
from exo.worker.engines.torch.model.gemma3_vision import Gemma3VisionEncoder


def _saved(directory: Path, change: str | None = None) -> tuple[dict[str, torch.Tensor], object]:
    """The tiny tower's state in bfloat16 (one tensor, `change`, cut by a row), saved as
    `model.safetensors`; returns that state and the model's config."""
    reference, _, encoder = tiny_gemma3_vision()
    state = {
        name: tensor.to(torch.bfloat16).contiguous()
        for name, tensor in encoder.state_dict().items()
    }
    if change is not None:
        state[change] = state[change][:-1].contiguous()
    save_file(state, str(directory / "model.safetensors"))
    return state, reference.config


def test_every_tensor_is_the_files_widened(tmp_path: Path) -> None:
    state, config = _saved(tmp_path)
    loaded = Gemma3VisionEncoder.load(tmp_path, config).state_dict()
    assert loaded.keys() == state.keys()
    for name, tensor in state.items():
        assert loaded[name].dtype == torch.float32, name
        assert torch.equal(loaded[name], tensor.float()), name


def test_a_tensor_of_another_shape_is_refused_by_name(tmp_path: Path) -> None:
    name = "vision_tower.encoder.layers.0.mlp.fc1.weight"
    _, config = _saved(tmp_path, name)
    with pytest.raises(
        ValueError,
        match=rf"vision tensor {name} has shape \[63, 32\], the model expects \[64, 32\]",
    ):
        Gemma3VisionEncoder.load(tmp_path, config)
