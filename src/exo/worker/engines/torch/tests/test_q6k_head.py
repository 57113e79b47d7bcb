"""A Q6_K LM head held as its own blocks (`q6k_blocks.Q6KLinear`, `native/q6k_blocks.cpp`):
the kernel against a float64 product of `gguf`'s dequantized weights, 1-8 (and 11)
activation rows, odd output counts, on the 512-bit path and the AVX2 one
(`EXO_NATIVE_AVX512=0`, a child process: the switch is read once); bad input refused; a
vocabulary split; and a tiny Q4_K_M-like GGUF whose Q6_K `output.weight` the engine holds
byte for byte, with logits against the same model given a float32 head of those weights."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from exo.download.gguf_repack import convert_gguf
from exo.download.gguf_tensors import read_gguf_model
from exo.testing.random_gguf import random_q6_k
from exo.testing.random_moe_gguf import MoeGgufShape, write_random_moe_gguf
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.direct_forward_parts import Projection
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.model.sharding import split_head_by_vocab
from exo.worker.engines.torch.quant.int8_channels import Int8Linear
from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel
from exo.worker.engines.torch.quant.q6k_blocks import Q6K_HEAD_ENV, Q6KLinear
from exo.worker.engines.torch.tests.lean_steps import new_cache
from exo.worker.engines.torch.tests.test_distributed import make_shard

pytestmark = pytest.mark.skipif(
    built_int4_kernel() is None, reason="exo's native kernels cannot be built here"
)

# Largest |kernel - float64 reference on the rounded rows| over the largest |reference|:
# each block's integer sum is exact; only float32 conversions and additions remain.
ROUNDED_TOLERANCE = 1e-5


def blocks_of(rows: int, columns: int, seed: int) -> np.ndarray:
    """Random Q6_K blocks (every bit pattern of values and scales) with `d` varying by
    block: uint8 `[rows, columns / 256 * 210]`."""
    rng = np.random.default_rng(seed)
    raw = random_q6_k((rows, columns), rng, 1.0).reshape(rows, -1, 210)
    d = rng.uniform(1e-4, 1e-3, raw.shape[:2]).astype(np.float16)
    raw[..., 208:210] = d[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def rounded_rows(x: np.ndarray) -> np.ndarray:
    """float32 rows as the kernel rounds them: per block of 256, the nearest integer (ties to
    even, in [-127, 127]) times the block's largest |x| / 127; the same float32 steps."""
    blocks = x.reshape(x.shape[0], -1, 256).astype(np.float32)
    largest = np.abs(blocks).max(axis=-1, keepdims=True)
    inverse = np.where(largest > 0, np.float32(127.0) / np.maximum(largest, 1e-30), 0)
    values = np.clip(np.rint((blocks * inverse.astype(np.float32)).astype(np.float32)), -127, 127)
    scales = (largest / np.float32(127.0)).astype(np.float32)
    return (values.astype(np.float64) * scales).reshape(x.shape)


def weight_of(raw: np.ndarray) -> np.ndarray:
    return dequantize(raw, GGMLQuantizationType.Q6_K).reshape(raw.shape[0], -1).astype(np.float64)


def check_against_references(out: int, columns: int, rows: int, seed: int) -> None:
    """The kernel's product of random rows against (1) the float64 product of the rounded
    rows, within `ROUNDED_TOLERANCE`, and (2) that of the rows themselves, within the bound
    the rounding allows (half a step of each block's scale times the block's |weights|)."""
    raw = blocks_of(out, columns, seed)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((rows, columns)).astype(np.float32)
    x[:, :256] *= 5.0  # blocks of different scales
    if rows > 1:
        x[1, 256:512] = 0.0  # an all-zero block
    got = torch.ops.exo_native.q6k_gemv(torch.from_numpy(x), torch.from_numpy(raw)).numpy()
    weight = weight_of(raw)
    reference = rounded_rows(x) @ weight.T
    assert np.abs(got - reference).max() <= ROUNDED_TOLERANCE * np.abs(reference).max()
    steps = np.abs(x.reshape(rows, -1, 256)).max(axis=-1) / 127.0 / 2.0  # [rows, blocks]
    weight_blocks = np.abs(weight.reshape(out, -1, 256)).sum(axis=-1)  # [out, blocks]
    bound = steps @ weight_blocks.T
    exact = x.astype(np.float64) @ weight.T
    assert (np.abs(got - exact) <= bound * 1.001 + 1e-6).all()


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 11])
def test_the_kernel_is_the_dequantized_product_of_the_rounded_rows(rows: int) -> None:
    check_against_references(out=37, columns=768, rows=rows, seed=rows)


def test_the_avx2_path_gives_the_same_products() -> None:
    """The 256-bit kernel (`EXO_NATIVE_AVX512=0`, read once per process: a child) against
    the same references, every row count from 1 to 9, odd outputs."""
    script = (
        "import torch\n"
        "from exo.worker.engines.torch.quant.native_kernels import built_int4_kernel\n"
        "from exo.worker.engines.torch.tests import test_q6k_head as t\n"
        "assert built_int4_kernel() is not None\n"
        "assert int(torch.ops.exo_native.int4_decode_bits()) in (0, 256)\n"
        "for rows in range(1, 10):\n"
        "    t.check_against_references(out=29, columns=512, rows=rows, seed=rows)\n"
        "print('checked')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        env={**os.environ, "EXO_NATIVE_AVX512": "0"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("checked")


def test_bad_input_is_refused_with_its_reason() -> None:
    raw = torch.from_numpy(blocks_of(8, 512, 0))
    with pytest.raises(RuntimeError, match="multiple of 256"):
        torch.ops.exo_native.q6k_gemv(torch.zeros(1, 500), raw)
    with pytest.raises(RuntimeError, match="420 expected"):
        torch.ops.exo_native.q6k_gemv(torch.zeros(1, 512), raw[:, :210].contiguous())
    with pytest.raises(RuntimeError, match="uint8"):
        torch.ops.exo_native.q6k_gemv(torch.zeros(1, 512), raw.to(torch.int8))
    with pytest.raises(RuntimeError, match="float32"):
        torch.ops.exo_native.q6k_gemv(torch.zeros(1, 512, dtype=torch.float64), raw)
    with pytest.raises(ValueError, match="whole blocks"):
        Q6KLinear(raw[:, :300], None)
    with pytest.raises(ValueError, match="uint8"):
        Q6KLinear(raw.to(torch.int16), None)


def test_the_module_and_a_vocabulary_share_keep_the_rows() -> None:
    raw = blocks_of(200, 512, 4)
    head = Q6KLinear(torch.from_numpy(raw), None)
    assert (head.in_features, head.out_features) == (512, 200)
    torch.testing.assert_close(
        head.dequantize_float(), torch.from_numpy(weight_of(raw)).float(), rtol=0, atol=0
    )
    model = torch.nn.Module()
    model.lm_head = head
    assert split_head_by_vocab(model, 1, 2)
    share: Any = model.lm_head
    assert isinstance(share.local, Q6KLinear) and share.start == 128
    assert torch.equal(share.local.blocks, head.blocks[128:])
    x = torch.randn(3, 512)
    torch.testing.assert_close(share.local(x), head(x)[:, 128:], rtol=0, atol=0)


SHAPE = MoeGgufShape()  # 2 layers, hidden 256, vocabulary 320: a Q6_K head of 320 x 256
PROMPT = [int(token) for token in np.random.default_rng(0).integers(3, SHAPE.vocab_size, 24)]
FED = [int(token) for token in np.random.default_rng(1).integers(3, SHAPE.vocab_size, 6)]


def forced_logits(model: Any) -> torch.Tensor:
    """The prompt prefilled in one step, then one decode step per token of `FED`:
    `[len(PROMPT) + len(FED), vocab]` float32 logits (tokens fixed, so two heads' runs
    compare row by row)."""
    cache, windows, layer_of = new_cache(model)
    slot = cache.allocate()
    segment = PrefillSegment(slot, 0, 0, len(PROMPT))
    plan = BatchPlan(cache, windows, [], [], [segment], layer_of)
    positions = torch.arange(len(PROMPT))[None]
    logits = [forward_batch(model, plan, torch.tensor([PROMPT]), positions, positions[0])]
    for offset, token in enumerate(FED):
        position = len(PROMPT) + offset
        plan = BatchPlan(cache, windows, [slot], [position], [], layer_of)
        where = torch.tensor([[position]])
        logits.append(forward_batch(model, plan, torch.tensor([[token]]), where, torch.tensor([0])))
    return torch.cat(logits).float()


def test_a_q4_k_m_like_gguf_keeps_its_q6_k_head_as_the_file_stores_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine holds `output.weight`'s Q6_K bytes unchanged; its logits (prefill rows and
    decode rows) equal those of the same model with a float32 head of gguf's dequantized
    weights up to the activations' int8 rounding; `EXO_Q6K_HEAD=0` keeps the int8 head."""
    gguf_path = write_random_moe_gguf(tmp_path / "moe.gguf", SHAPE, "Q4_K")[0]
    directory = tmp_path / "converted"
    directory.mkdir()
    convert_gguf(gguf_path, directory)
    stored = {tensor.name: tensor for tensor in read_gguf_model(gguf_path).tensors}["output.weight"]
    assert stored.type_name == "Q6_K"
    shard = make_shard(directory, "pipeline", 0, 1)
    held: Any = load_model(directory, shard, torch.device("cpu"), "int4")
    head = held.lm_head
    assert isinstance(head, Q6KLinear)
    file_bytes = np.asarray(stored.data, dtype=np.uint8).reshape(SHAPE.vocab_size, -1)
    assert np.array_equal(head.blocks.numpy(), file_bytes)
    logits = forced_logits(held)
    float_head = torch.nn.Linear(SHAPE.hidden_size, SHAPE.vocab_size, bias=False)
    float_head.weight = torch.nn.Parameter(head.dequantize_float(), requires_grad=False)
    lean = lean_step_of(held)
    assert isinstance(lean, LeanModel)
    lean._head = Projection([float_head], lean.bf16)  # the same model, a float32 head
    reference = forced_logits(held)
    assert reference.shape == (len(PROMPT) + len(FED), SHAPE.vocab_size)
    assert reference.abs().max() > 0.1  # logits that could differ
    relative = (logits - reference).norm() / reference.norm()
    assert relative < 0.01, relative  # int8 activations per 256: ~0.3 % measured
    monkeypatch.setenv(Q6K_HEAD_ENV, "0")
    int8: Any = load_model(directory, shard, torch.device("cpu"), "int4")
    assert isinstance(int8.lm_head, Int8Linear)
