"""A mixed step (decode rows and a prompt chunk in one forward pass, which exo's decode layer
runs for every row: model/direct_forward.py) against the same work as two steps, a
decode-only step then a prompt-only step (which the lean forward's prefill operators run):
the decode rows' logits, the chunk's last logits, the KV the chunk leaves and the next
step's logits agree, on a tiny int4 model (chunks of 1, 6 and 20 rows: one prompt row, the
decode kernels' rows, the integer GEMM's rows)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    PrefillSegment,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.model.direct_forward import LeanModel
from exo.worker.engines.torch.model.loading import load_model
from exo.worker.engines.torch.quant.native_kernels import NATIVE_INT4_ENV, native_int4_kernel
from exo.worker.engines.torch.tests import lean_steps
from exo.worker.engines.torch.tests.test_distributed import make_shard

# Largest |mixed - separate| logit or key: the two paths round activations to the same int16
# blocks but sum in another order (decode kernels or GEMM, per-row or flash attention), so
# a last-bit difference can move a value by one int16 step of its block. Measured: up to
# 6e-5 on logits ~2.8 wide (2026-12-05).
TOLERANCE = 1e-3
A_PROMPT = 12  # request A: prompt, then it decodes
B_PREFIX = 10  # request B: prefilled so far, then a chunk joins A's decode step


@pytest.fixture(scope="module")
def int4_llama(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """A tiny llama whose decoder linears are all int4 (outputs multiples of 64), so exo's
    decode layer takes every layer."""
    return save_tiny_model(
        tmp_path_factory.mktemp("mixed-int4"), "llama", real_model_dir, n_layers=3,
        hidden_size=128, head_dim=32,
    )  # fmt: skip


def _steps(model: Any, chunk: int, mixed: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A's prompt and B's first `B_PREFIX` tokens in one step; A's next token beside B's
    `chunk` prompt tokens (one step when `mixed`, else a decode-only step then a prompt-only
    one); then both decode one token. Returns the logits of A's decode row, B's last chunk
    row and the last step's two rows `[4, vocab]`, and each layer's keys of B's slot."""
    generator = torch.Generator().manual_seed(chunk)
    a = torch.randint(0, 1000, (A_PROMPT + 2,), generator=generator).tolist()
    b = torch.randint(0, 1000, (B_PREFIX + chunk + 1,), generator=generator).tolist()
    cache, windows, layer_of = lean_steps.new_cache(model)
    slot_a, slot_b = cache.allocate(), cache.allocate()

    def step(
        decode: list[tuple[int, int, int]], prefill: list[tuple[int, int, list[int]]],
        rows: list[int],
    ) -> torch.Tensor:  # fmt: skip
        """decode: (slot, position, token); prefill: (slot, start, tokens)."""
        ids = [token for _, _, token in decode]
        positions = [position for _, position, _ in decode]
        segments = []
        for slot, start, tokens in prefill:
            segments.append(PrefillSegment(slot, start, len(ids), len(tokens)))
            ids += tokens
            positions += range(start, start + len(tokens))
        plan = BatchPlan(
            cache, windows, [slot for slot, _, _ in decode],
            [position for _, position, _ in decode], segments, layer_of,
        )  # fmt: skip
        return forward_batch(
            model, plan, torch.tensor([ids]), torch.tensor([positions]), torch.tensor(rows)
        )

    step([], [(slot_a, 0, a[:A_PROMPT]), (slot_b, 0, b[:B_PREFIX])], [A_PROMPT - 1])
    chunk_tokens = b[B_PREFIX : B_PREFIX + chunk]
    if mixed:
        logits = step([(slot_a, A_PROMPT, a[A_PROMPT])], [(slot_b, B_PREFIX, chunk_tokens)],
                      [0, chunk])  # fmt: skip
    else:
        decoded = step([(slot_a, A_PROMPT, a[A_PROMPT])], [], [0])
        prefilled = step([], [(slot_b, B_PREFIX, chunk_tokens)], [chunk - 1])
        logits = torch.cat([decoded, prefilled])
    end = B_PREFIX + chunk
    last = step([(slot_a, A_PROMPT + 1, a[A_PROMPT + 1]), (slot_b, end, b[end])], [], [0, 1])
    keys = [layer_keys[slot_b, :, : end + 1].clone() for layer_keys in cache.keys]
    return torch.cat([logits, last]), keys


@pytest.mark.skipif(native_int4_kernel() is None, reason="exo's native kernels do not run here")
@pytest.mark.parametrize("chunk", [1, 6, 20])
def test_a_mixed_step_equals_its_decode_and_prompt_steps_apart(
    int4_llama: Path, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(NATIVE_INT4_ENV, "1")
    model = load_model(int4_llama, make_shard(int4_llama, "pipeline", 0, 1), torch.device("cpu"),
                       "int4")  # fmt: skip
    lean = lean_step_of(model)
    assert isinstance(lean, LeanModel) and lean._decode_layer is not None
    native_rows: list[int] = []
    run_layers = lean._decode_layers

    def counted(plan: BatchPlan, x: torch.Tensor, tables: Any) -> None:
        native_rows.append(x.shape[0])
        run_layers(plan, x, tables)

    monkeypatch.setattr(lean, "_decode_layers", counted)
    mixed, mixed_keys = _steps(model, chunk, mixed=True)
    assert native_rows == [1 + chunk, 2]  # the mixed step ran in the decode layer
    native_rows.clear()
    separate, separate_keys = _steps(model, chunk, mixed=False)
    assert native_rows == [1, 2]  # the prompt-only step did not
    assert mixed.shape == separate.shape == (4, mixed.shape[1])
    difference = (mixed - separate).abs().max().item()
    assert difference < TOLERANCE
    assert torch.equal(mixed.argmax(-1), separate.argmax(-1))
    for layer_mixed, layer_separate in zip(mixed_keys, separate_keys, strict=True):
        assert (layer_mixed - layer_separate).abs().max().item() < TOLERANCE
