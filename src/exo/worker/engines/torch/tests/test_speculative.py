"""Speculative decoding (issue 43): n-gram drafts, exact verification, KV rollback.

Drafts on tiny random-weight models come from `ScriptedDrafts`, which proposes the tokens
plain decoding produced with deliberate mistakes at scripted places, so every path (a draft
all accepted with its bonus token, a rejection at the first or a later token, a request
finishing inside a draft) is taken, deterministically. Every family's greedy equality with
scripted, n-gram and draft-model drafts is `test_speculative_families.py`; the n-gram
source and the draft length policy are `test_speculative_policy.py`, the acceptance rule on
a bare request state `test_speculative_acceptance.py`, verify rows as decode rows
`test_speculative_kernels.py`; the n-gram source on the default model is the last test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.worker.engines.torch.batching.batch_attention import BatchPlan, forward_batch
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.decoding.speculative_policy import PROBE_STEPS, SpeculationSettings
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    ScriptedDrafts,
    load,
    plain_references,
    request,
    run,
    speculation,
)


def test_seeded_sampling_with_penalties_and_bias_is_identical_with_drafts(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    comma = engine.tokenizer.encode(",", add_special_tokens=False)[0]
    params = [
        request(
            PROMPTS[0],
            temperature=0.9,
            top_p=0.95,
            top_k=40,
            seed=7,
            max_tokens=20,
            frequency_penalty=0.5,
            presence_penalty=0.3,
            logit_bias={comma: 3.0},
            speculative=True,
        ),
        request(
            PROMPTS[2],
            temperature=1.2,
            seed=3,
            max_tokens=15,
            speculative=True,
            repetition_penalty=1.3,
        ),
    ]
    reference = plain_references(engine, params)
    speculation(engine).source = ScriptedDrafts(reference, engine.vocab_size)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 0])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert speculation(engine).counters.accepted_tokens > 0


def test_stop_string_logprobs_and_usage_are_those_of_plain_decoding(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    plain_params = request(PROMPTS[0], temperature=0.0, max_tokens=30, logprobs=True,
                           top_logprobs=2, speculative=False)  # fmt: skip
    plain = engine.build_request(plain_params, None, "r0")
    run(engine, [plain], [0])
    text = engine.tokenizer.decode(plain.generated_ids)
    stop = text[len(text) // 2 : len(text) // 2 + 3]  # a stop string in mid-reply
    outcomes = []
    for speculative in (False, True):
        engine.clear_prefix_cache()
        params = plain_params.model_copy(update={"stop": (stop,), "speculative": speculative})
        if speculative:
            speculation(engine).source = ScriptedDrafts(
                {"r0": plain.prompt_ids + plain.generated_ids}, engine.vocab_size
            )
        state = engine.build_request(params, None, "r0")
        pieces = run(engine, [state], [0])["r0"]
        outcomes.append(
            (
                "".join(piece.text for piece in pieces),
                [entry for piece in pieces for entry in piece.logprobs],
                pieces[-1].usage,
                pieces[-1].finish_reason,
                pieces[-1].stop_sequence,
            )
        )
    (plain_text, plain_logprobs, *plain_end), (text, logprobs, *end) = outcomes
    assert text == plain_text and end == plain_end and end[2] == stop
    assert len(logprobs) == len(plain_logprobs)
    for got, expected in zip(logprobs, plain_logprobs, strict=True):
        assert got.token == expected.token
        assert got.logprob == pytest.approx(expected.logprob, abs=1e-3)
    assert speculation(engine).counters.verify_rounds > 0


def test_kv_after_a_rejection_equals_plain_decodings_and_the_slot_is_rolled_back(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    params = request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True)
    plain = engine.build_request(params.model_copy(update={"speculative": False}), None, "r0")
    run(engine, [plain], [0])  # its KV (all but the last token's) goes to the prefix cache
    reference = {"r0": plain.prompt_ids + plain.generated_ids}
    assert engine.scheduler.prefix_cache is not None
    plain_kv = engine.scheduler.prefix_cache.lookup(reference["r0"], limit=len(reference["r0"]))
    assert plain_kv is not None and plain_kv.length == len(reference["r0"]) - 1
    engine.clear_prefix_cache()
    speculation(engine).source = ScriptedDrafts(reference, engine.vocab_size)
    state = engine.build_request(params, None, "r0")
    engine.scheduler.add(state)
    scheduler = engine.scheduler
    checked = 0
    while engine.has_work:
        drafted = speculation(engine).counters.drafted_tokens
        accepted = speculation(engine).counters.accepted_tokens
        engine.step()
        if state.finished:
            break
        counters = speculation(engine).counters
        rejected = (counters.drafted_tokens - drafted) > (counters.accepted_tokens - accepted)
        (running,) = scheduler._running
        cache = scheduler._cache
        # The slot holds exactly the verified positions: the text less its last token.
        assert cache.lengths[running.slot] == running.computed == len(running.tokens) - 1
        if rejected:
            kv = cache.read(running.slot, running.computed)
            torch.testing.assert_close(
                kv, plain_kv.kv[:, :, :, : running.computed], atol=1e-5, rtol=1e-5
            )
            checked += 1
    assert checked >= 3
    engine.store_finished()
    # The prefix cache holds verified tokens only: the whole reply's KV hits again.
    assert scheduler.prefix_cache is not None
    hit = scheduler.prefix_cache.lookup(reference["r0"], limit=len(reference["r0"]))
    assert hit is not None and hit.length == plain_kv.length
    torch.testing.assert_close(hit.kv, plain_kv.kv, atol=1e-5, rtol=1e-5)


def test_a_constraint_rejects_draft_tokens_its_grammar_forbids(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    params = request(PROMPTS[1], temperature=0.0, max_tokens=12, response_format="json_object")
    reference = plain_references(engine, [params])
    # Drafts of plain prose: every one is outside the grammar at its first token.
    prose = engine.tokenizer.encode(" hello there friend", add_special_tokens=False)

    class ProseDrafts(ScriptedDrafts):
        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            return [Draft(tuple(prose[: wanted.max_tokens])) for wanted in requests]

    speculation(engine).source = ProseDrafts(reference, engine.vocab_size)
    state = engine.build_request(params.model_copy(update={"speculative": True}), None, "r0")
    run(engine, [state], [0])
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    counters = speculation(engine).counters
    assert counters.drafted_tokens > 0 and counters.accepted_tokens == 0


def test_drafts_never_exceed_the_decode_row_bound_nor_the_token_budget(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    params = [
        request(prompt, temperature=0.0, max_tokens=10, speculative=True) for prompt in PROMPTS
    ]
    reference = plain_references(engine, params)

    class Watching(ScriptedDrafts):
        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            for wanted in requests:  # room for the draft and the token after it
                assert (
                    wanted.max_tokens
                    <= len(self.reference[wanted.request_id]) - len(wanted.tokens) - 1
                )
            return super().propose(requests)

    rows: list[int] = []  # decode rows of each step with drafts

    def watched_forward(model: Any, plan: BatchPlan, *arguments: torch.Tensor) -> torch.Tensor:
        logits = forward_batch(model, plan, *arguments)
        if plan.repeated_slots:
            rows.append(len(plan.decode_slots))
            assert not plan.prefill  # drafts only in decode-only steps
        return logits

    scheduler = engine.scheduler
    speculation(engine).source = Watching(reference, engine.vocab_size)
    scheduler._forward = watched_forward
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 0, 0])
    assert rows and max(rows) == speculation(engine).max_decode_rows
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"]


def test_requests_off_or_auto_off_never_draft(tiny_model_dir: Path) -> None:
    engine = load(tiny_model_dir, speculation=SpeculationSettings(default="auto"))
    params = [request(PROMPTS[0], temperature=0.0, max_tokens=8)]
    reference = plain_references(engine, params)
    drafts = ScriptedDrafts(reference, engine.vocab_size)
    speculation(engine).source = drafts
    speculation(engine).auto_switch.enabled = False
    speculation(engine).auto_switch._steps = PROBE_STEPS  # past the first probe: none here
    state = engine.build_request(params[0], None, "r0")
    run(engine, [state], [0])
    assert drafts.rounds == 0
    speculation(engine).auto_switch.enabled = True
    state = engine.build_request(params[0].model_copy(update={"speculative": False}), None, "r1")
    drafts.reference["r1"] = reference["r0"]
    run(engine, [state], [0])
    assert drafts.rounds == 0
    state = engine.build_request(params[0], None, "r2")  # "auto", switch on
    drafts.reference["r2"] = reference["r0"]
    run(engine, [state], [0])
    assert drafts.rounds > 0


# --- the default model, n-gram drafts --------------------------------------------------------

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades "
    "of salt and wind. Every night the keeper climbed the spiral stairs, one hundred and "
    "twelve steps, to light the great lamp. Ships passing in the dark relied on its steady "
    "beam to steer clear of the rocks below."
)
REPEAT = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"


def test_the_default_model_copies_a_passage_in_fewer_steps_with_the_same_text(
    real_engine: TorchEngine,
) -> None:
    """The default model (int4 weights, exo's kernels) repeats a passage greedily: with
    n-gram drafts it writes the same text, in fewer steps (tokens per step > 1), most
    drafts accepted."""
    texts = []
    for speculative in (False, True):
        before = dataclasses.replace(speculation(real_engine).counters)
        params = request(REPEAT, temperature=0.0, max_tokens=80, speculative=speculative)
        texts.append("".join(piece.text for piece in real_engine.generate(params)))
        after = speculation(real_engine).counters
    assert texts[1] == texts[0] and PASSAGE[:60] in texts[0]
    rounds = after.decode_rounds - before.decode_rounds
    tokens = after.decode_tokens - before.decode_tokens
    drafted = after.drafted_tokens - before.drafted_tokens
    accepted = after.accepted_tokens - before.accepted_tokens
    assert tokens / rounds > 1.5, (tokens, rounds)
    assert drafted > 0 and accepted / drafted >= 0.6, (accepted, drafted)
