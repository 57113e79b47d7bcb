"""A Q4_K GGUF converted with compact scales (`.int4_q4k_scales`,
`worker/engines/torch/quant/q4k_scales.py`) against the same conversion in the earlier form
(float32 `.int4_scales` / `.int4_zeros`, which still loads): the engine holds the compact
scales as they are, its prefill logits are bit for bit the earlier form's (block_matmul
reads the same bfloat16 pairs) and its decode logits within a stated bound of them (exo's
decode kernel reads the compact scales unrounded), with the same greedy tokens; on two
tensor-parallel ranks a rank whose columns cut a super-block of 256 holds the groups
instead. With exo's kernels the one-rank step runs the compact scales through prefill's
block_matmul, the native decode layer (the attention projections) and the MoE experts
kernel (checked by wrapping `torch.ops.exo_native`, 2026-12-06)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from exo.download.tests.test_gguf_moe import PROMPT, SHAPE
from exo.shared.models.cards import card_from_local_directory
from exo.shared.models.tensor_names import INT4_Q4K_SCALES, INT4_SCALES, INT4_ZEROS
from exo.testing.random_moe_gguf import write_random_moe_gguf
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.int4_groups import Int4Linear
from exo.worker.engines.torch.quant.native_kernels import native_int4_kernel
from exo.worker.engines.torch.quant.q4k_scales import (
    COMPACT_Q4K_ENV,
    compact_from_stored,
    q4k_scales_and_zeros,
)
from exo.worker.engines.torch.tests.test_distributed import make_shard
from exo.worker.engines.torch.tests.test_moe import engine_greedy

CPU = torch.device("cpu")


def earlier_form(directory: Path, target: Path) -> int:
    """A copy of converted `directory` with every compact Q4_K scale tensor written as the
    earlier conversion wrote it (float32 scales and zeros, `repack_q4_k`'s values: tested
    equal in test_q4k_scales.py). Returns the weights rewritten."""
    shutil.copytree(directory, target)
    rewritten = 0
    for path in target.glob("*.safetensors"):
        tensors = load_file(str(path))
        for name in [name for name in tensors if name.endswith(INT4_Q4K_SCALES)]:
            base = name.removesuffix(INT4_Q4K_SCALES)
            scales, zeros = q4k_scales_and_zeros(compact_from_stored(tensors.pop(name)))
            tensors[base + INT4_SCALES], tensors[base + INT4_ZEROS] = scales, zeros
            rewritten += 1
        save_file(tensors, str(path), metadata={"format": "pt"})
    return rewritten


def int4_modules(model: Any) -> dict[str, Int4Linear]:
    return {
        name: module for name, module in model.named_modules() if isinstance(module, Int4Linear)
    }


def test_compact_scales_load_to_the_earlier_forms_logits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(COMPACT_Q4K_ENV, "1")  # held compact (by default: the earlier pairs)
    gguf_path = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "Q4_K")[0]
    from exo.download.gguf_repack import convert_gguf

    names = ("compact", "earlier")
    compact_dir = tmp_path / "compact"
    compact_dir.mkdir()
    convert_gguf(gguf_path, compact_dir)
    assert earlier_form(compact_dir, tmp_path / "earlier") > 0
    # The compact scales hold no weights of their own, as scales and zeros hold none.
    counts = {card_from_local_directory(tmp_path / name).parameter_count for name in names}
    assert len(counts) == 1
    models = {}
    for name in names:
        model_dir = tmp_path / name
        models[name] = load_model(model_dir, make_shard(model_dir, "pipeline", 0, 1), CPU, "int4")
    held = int4_modules(models["compact"])
    assert held  # the experts and attention linears, built from the blocks
    if native_int4_kernel() is not None:  # exo's kernels hold the compact scales as they are
        assert all(module.scales_and_zeros.dtype == torch.uint8 for module in held.values())
    earlier = int4_modules(models["earlier"])
    for name, module in held.items():
        assert torch.equal(module.scale_zero_by_output(), earlier[name].scale_zero_by_output())
    compact_logits, compact_tokens = engine_greedy(models["compact"], PROMPT)
    earlier_logits, earlier_tokens = engine_greedy(models["earlier"], PROMPT)
    prompt = len(PROMPT)
    assert torch.equal(compact_logits[:prompt], earlier_logits[:prompt])
    assert compact_tokens == earlier_tokens
    # Decode: the compact scales read unrounded, the earlier form's rounded to bfloat16 (a
    # relative error up to 2^-9 per scale and zero), carried through two layers to the LM
    # head: measured 0.012 of the step's largest |logit| at most (2026-12-06); the bound,
    # 2^-5 (0.031), leaves 2.7 times that.
    difference = (compact_logits[prompt:] - earlier_logits[prompt:]).abs().amax(-1)
    spread = earlier_logits[prompt:].abs().amax(-1)
    assert bool((difference <= spread * 2.0**-5).all()), (difference / spread).max()


def test_tensor_parallel_ranks_hold_compact_or_group_slices(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two tensor ranks (`EXO_Q4K_COMPACT=1`): each linear's slice of the whole weight; a
    row-parallel down projection of 256 inputs gives each rank 128, half a super-block:
    groups there."""
    monkeypatch.setenv(COMPACT_Q4K_ENV, "1")
    gguf_path = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "Q4_K")[0]
    from exo.download.gguf_repack import convert_gguf

    model_dir = tmp_path / "compact"
    model_dir.mkdir()
    convert_gguf(gguf_path, model_dir)
    whole = int4_modules(load_model(model_dir, make_shard(model_dir, "tensor", 0, 1), CPU, "int4"))
    kinds = set()
    for rank in range(2):
        model = load_model(model_dir, make_shard(model_dir, "tensor", rank, 2), CPU, "int4")
        for name, module in int4_modules(model).items():
            full = whole[name.replace(".local", "")].dequantize_float()
            out_features, in_features = module.out_features, module.in_features
            if out_features != full.shape[0]:  # column parallel: this rank's rows
                expected = full[rank * out_features : (rank + 1) * out_features]
            else:  # row parallel: its columns
                expected = full[:, rank * in_features : (rank + 1) * in_features]
            assert torch.equal(module.dequantize_float(), expected), name
            kinds.add((module.scales_and_zeros.dtype, in_features % 256 == 0))
    if native_int4_kernel() is not None:
        assert kinds == {(torch.uint8, True), (torch.bfloat16, False)}
