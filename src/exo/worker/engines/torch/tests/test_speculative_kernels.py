"""Speculative decoding (issue 43), the same kernels: a verify step's draft rows are
computed as the decode rows they stand for (attention row by row; the logits bit for bit
on exo's native decode layer, within float rounding elsewhere)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
import torch

from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    attend,
    commit_lengths,
    lean_step_of,
)
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser
from exo.worker.engines.torch.tests.conftest import save_tiny_llama
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    ScriptedDrafts,
    load,
    request,
    run,
    speculation,
)

# |speculative - plain| logits of float32 weights (as test_batching.py's batched - alone).
FLOAT32_TOLERANCE = 5e-4


class Recording:
    """Wraps a chooser, keeping every row's logits it was given."""

    def __init__(self, inner: TokenChooser) -> None:
        self.inner = inner
        self.logits: list[torch.Tensor] = []

    @property
    def needs_logits(self) -> bool:
        return self.inner.needs_logits

    @property
    def is_complete(self) -> bool:
        return self.inner.is_complete

    @property
    def sampler(self) -> Sampler:
        return self.inner.sampler

    def choose(self, logits: torch.Tensor) -> int:
        self.logits.append(logits.detach().clone())
        return self.inner.choose(logits)

    def observe(self, token_id: int) -> None:
        self.inner.observe(token_id)


@pytest.mark.parametrize("window", [None, 5])
def test_attention_gives_each_draft_row_a_decode_rows_output(window: int | None) -> None:
    """`attend` (the lean forward's torch path) over a step with a draft (three rows of slot
    0 beside a decode row of slot 1) writes their keys and gives each row the output of the
    plain decode steps that would have computed it one position at a time."""
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 16

    def random(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator)

    def filled_cache() -> SlotKVCache:
        cache = SlotKVCache(1, kv_heads, dim, torch.float32, torch.device("cpu"), slots=2)
        for slot, length in ((cache.allocate(), 10), (cache.allocate(), 7)):
            cache.keys[0][slot, :, :length] = keys[slot, :, :length]
            cache.values[0][slot, :, :length] = values[slot, :, :length]
            cache.commit(slot, length)
        return cache

    keys, values = random(2, kv_heads, 16, dim), random(2, kv_heads, 16, dim)
    # Rows: slot 0 at 12, 11, 10 (a draft of two, last position first), slot 1 at 7.
    slots, positions = [0, 0, 0, 1], [12, 11, 10, 7]
    query = random(1, heads, 4, dim)
    key, value = random(1, kv_heads, 4, dim), random(1, kv_heads, 4, dim)
    cache = filled_cache()
    plan = BatchPlan(cache, [window], slots, positions, [], {})
    plan.prepare(torch.device("cpu"))
    together = attend(plan, 0, query, key, value, None)
    # Plain decoding: position 10 (slot 0) beside position 7 (slot 1), then 11, then 12.
    cache = filled_cache()
    one_by_one = torch.empty_like(together)
    for step_rows in ([2, 3], [1], [0]):
        plan = BatchPlan(cache, [window], [slots[row] for row in step_rows],
                         [positions[row] for row in step_rows], [], {})  # fmt: skip
        plan.prepare(torch.device("cpu"))
        rows = torch.tensor(step_rows)
        out = attend(plan, 0, query[:, :, rows], key[:, :, rows], value[:, :, rows], None)
        commit_lengths(plan)
        one_by_one[0, rows] = out[0]
    # One SDPA call over the rows' keys padded to the step's longest: its float32 sums
    # round by that length, as a plain step's do by its own (ulps; the native decode layer
    # loops over each row's own keys: bit for bit, `test_verify_rows_are_...`).
    torch.testing.assert_close(together, one_by_one, atol=1e-6, rtol=0)


@pytest.mark.parametrize("weights", ["int4", "float32"])
def test_verify_rows_are_computed_bit_for_bit_as_decode_rows(
    tmp_path: Path, real_model_dir: Path, int4_layout: str, weights: str
) -> None:
    """Each verified position's logits are the plain decode step's: bit for bit with int4
    weights on exo's native decode layer (the serving path on AVX2 CPUs: one C++ pass per
    layer, its int4 products, norms, rotary and attention each computed per row, the
    attention over the row's own keys of the bfloat16 KV cache). Elsewhere within float
    rounding: torch's operators (SDPA pads a step's keys to its longest row) and float32
    weights (torch's matmul sums in an order that follows the row count)."""
    directory = save_tiny_llama(tmp_path / "m", real_model_dir, hidden_size=128,
                                intermediate_size=256)  # fmt: skip
    engine = load(directory, weight_dtype=weights)
    lean = cast(Any, lean_step_of(engine.model))
    assert lean is not None  # the lean forward: torch's operators or exo's decode layer
    assert (lean._decode_layer is not None) == (int4_layout == "native")
    params = request(PROMPTS[0], temperature=0.0, max_tokens=20, speculative=True)
    recorded: list[list[torch.Tensor]] = []
    reference: dict[str, list[int]] = {}
    for speculative in (False, True):
        engine.clear_prefix_cache()
        if speculative:
            speculation(engine).source = ScriptedDrafts(reference, engine.vocab_size)
        state = engine.build_request(params.model_copy(update={"speculative": speculative}),
                                     None, "r0")  # fmt: skip
        recorder = Recording(state.chooser)
        state.chooser = cast(TokenChooser, recorder)
        run(engine, [state], [0])
        reference["r0"] = state.prompt_ids + state.generated_ids
        recorded.append(recorder.logits)
    plain_logits, speculative_logits = recorded
    assert speculation(engine).counters.accepted_tokens >= 5
    assert len(plain_logits) == len(speculative_logits)
    for index, (expected, got) in enumerate(zip(plain_logits, speculative_logits, strict=True)):
        if weights == "int4" and int4_layout == "native":
            assert torch.equal(expected, got), index
        else:
            torch.testing.assert_close(got, expected, atol=FLOAT32_TOLERANCE, rtol=0)
