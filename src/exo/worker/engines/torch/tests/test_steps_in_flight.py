"""Steps in flight (`BatchScheduler.max_in_flight`, what a pipeline's rank 0 runs): with
several steps launched before the oldest is sampled, every request still gets the tokens
it gets alone, and a request cancelled or pre-empted while its token is in flight leaves
the others unchanged.

A single-rank engine stands in for the pipeline: its forward pass runs at launch (as rank
0's layers do), its logits are taken up to `max_in_flight` steps later. The multi-process
pipeline runs the same scheduler in `test_distributed_batching.py`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.test_batching import (
    PROMPTS,
    feature_requests,
    outcome,
    request,
    solo_outcomes,
    tiny_llama,
)


def run_in_flight(
    engine: TorchEngine, params: list[Any], join_at: list[int], cancel: dict[int, str] | None = None
) -> tuple[dict[str, list[GeneratedPiece]], int]:
    """Submit `params[i]` as `r{i}` before step `join_at[i]` (cancelling `cancel[step]`
    before that step: no piece of it may come after); step until all finish. Returns the
    pieces and the most steps left in flight between two `step` calls (`max_in_flight` - 1
    once steps overlap: a step that fills the pipeline samples its oldest)."""
    engine.clear_prefix_cache()
    states = [engine.build_request(one, request_id=f"r{i}") for i, one in enumerate(params)]
    pieces: dict[str, list[GeneratedPiece]] = {state.request_id: [] for state in states}
    most = 0
    cancelled: set[str] = set()
    for step in range(3_000):
        for state, join in zip(states, join_at, strict=True):
            if join == step:
                engine.scheduler.add(state)
        if cancel and step in cancel:
            assert engine.cancel(cancel[step])
            cancelled.add(cancel[step])
        for request_id, output in engine.step():
            assert isinstance(output, GeneratedPiece), (request_id, output)
            assert request_id not in cancelled, "a piece after the request was cancelled"
            pieces[request_id].append(output)
        most = max(most, engine.scheduler.in_flight)
        if step >= max(join_at) and not engine.has_work:
            engine.store_finished()  # as a runner does once the last pieces are out
            return pieces, most
    raise AssertionError("the requests did not finish within 3,000 steps")


@pytest.mark.parametrize("in_flight", [2, 3])
def test_every_feature_gives_its_solo_output_with_steps_in_flight(
    tiny_card: Any, tiny_model_dir: Path, in_flight: int
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    params = feature_requests(engine)
    alone = solo_outcomes(engine, params)
    engine.scheduler.max_in_flight = in_flight
    pieces, most = run_in_flight(engine, params, join_at=[0, 0, 1, 2, 2, 4, 5])
    assert most == in_flight - 1  # the steps did overlap
    for index, expected in enumerate(alone):
        assert outcome(pieces[f"r{index}"]) == expected, params[index]
    assert engine.scheduler.running_ids == [] and engine.scheduler.in_flight == 0


def test_a_request_cancelled_while_its_token_is_in_flight_leaves_the_others(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    params = [request(prompt, temperature=1.0, seed=7, max_tokens=8) for prompt in PROMPTS]
    engine.scheduler.max_in_flight = 2
    full, _most = run_in_flight(engine, params, join_at=[0, 0, 0])
    # Every step from the 4th on has steps in flight; cancel r1 at each of a few of them.
    for at in (4, 5, 6, 7):
        cut, _most = run_in_flight(engine, params, join_at=[0, 0, 0], cancel={at: "r1"})
        assert outcome(cut["r0"]) == outcome(full["r0"])
        assert outcome(cut["r2"]) == outcome(full["r2"])
        assert cut["r1"] == full["r1"][: len(cut["r1"])]
        assert not cut["r1"] or cut["r1"][-1].finish_reason is None
        assert engine.scheduler.kv_tokens() == 0 and engine.scheduler.in_flight == 0


def test_preemption_with_steps_in_flight_gives_the_same_tokens(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    # As test_batching's pre-emption test: all three fit at first, not to the end.
    engine = tiny_llama(tiny_card, tiny_model_dir, kv_cache_tokens=120)
    params = [request(prompt, temperature=1.0, seed=i, max_tokens=16) for i, prompt in
              enumerate(PROMPTS)]  # fmt: skip
    alone = solo_outcomes(engine, params)
    engine.scheduler.max_in_flight = 2
    pieces, most = run_in_flight(engine, params, join_at=[0, 0, 0])
    assert most == 1 and engine.scheduler.preemptions > 0
    for index, expected in enumerate(alone):
        assert outcome(pieces[f"r{index}"]) == expected


def test_decoding_requests_are_spread_over_the_steps_in_flight(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    engine.scheduler.max_in_flight = 2
    rows: list[int] = []
    inner = engine.scheduler._forward

    def counting(*arguments: Any) -> Any:
        from exo.worker.engines.torch.batching.batch_attention import forward_batch

        rows.append(len(arguments[1].decode_slots))
        return (inner or forward_batch)(*arguments)

    engine.scheduler._forward = counting
    params = [request("Hi", temperature=0.0, max_tokens=12) for _ in range(4)]
    run_in_flight(engine, params, join_at=[0, 0, 0, 0])
    # Once all four decode, each step carries two of them (ceil(4 / 2)).
    assert max(rows) == 2 and rows.count(2) >= 10
