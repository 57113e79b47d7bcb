"""Speculative decoding (issue 43): n-gram drafts, exact verification, KV rollback.

Drafts on tiny random-weight models come from `ScriptedDrafts`, which proposes the tokens
plain decoding produced with deliberate mistakes at scripted places, so every path (a draft
all accepted with its bonus token, a rejection at the first or a later token, a request
finishing inside a draft) is taken, deterministically. Every family's greedy equality with
scripted, n-gram and draft-model drafts is `test_speculative_families.py`; the n-gram
source is tested alone here and on the default model (the last test).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.chunks import TokenLogprob
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    attend,
    commit_lengths,
    forward_batch,
    lean_step_of,
)
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.speculation import Speculation
from exo.worker.engines.torch.decoding.detokenizer import StreamingDetokenizer
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser, step_logprobs
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.speculative_drafts import (
    NO_DRAFT,
    Draft,
    DraftRequest,
    NgramDraftSource,
)
from exo.worker.engines.torch.decoding.speculative_policy import (
    PROBE_INTERVAL,
    PROBE_STEPS,
    AutoSwitch,
    DraftLength,
    SpeculationSettings,
    best_draft_length,
    expected_tokens,
)
from exo.worker.engines.torch.decoding.stop_sequences import StopSequenceMatcher
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.conftest import save_tiny_llama

PROMPTS = ("Tell me a story about a dragon", "Hi", "Count: one two three four five")
# |speculative - plain| logits of float32 weights (as test_batching.py's batched - alone).
FLOAT32_TOLERANCE = 5e-4


def speculation(engine: TorchEngine) -> Speculation:
    """The engine's single-rank speculation (drafts, counters, switch)."""
    found = engine.scheduler.speculation
    assert found is not None
    return found


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


# --- the n-gram source --------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_earlier_occurrence() -> None:
    source = NgramDraftSource(max_ngram=3, min_ngram=2)
    # "5 6" occurs at 1 (followed by 7 8) and at 6 (followed by 9 1): the latest wins.
    tokens = [4, 5, 6, 7, 8, 4, 5, 6, 9, 1, 2, 5, 6]
    assert source.propose([DraftRequest("r", tokens, 3)]) == [Draft((9, 1, 2))]
    # The longest suffix with a match wins: "4 5 6" (3 tokens) over "5 6".
    tokens = [4, 5, 6, 7, 8, 1, 5, 6, 9, 3, 4, 5, 6]
    assert source.propose([DraftRequest("s", tokens, 2)]) == [Draft((7, 8))]


def test_ngram_proposes_nothing_without_a_match_and_stops_at_the_text_end() -> None:
    source = NgramDraftSource(max_ngram=3, min_ngram=2)
    assert source.propose([DraftRequest("r", [1, 2, 3, 4, 5], 4)]) == [NO_DRAFT]
    # A repeating pattern: the continuation runs into the suffix and stops at the end.
    assert source.propose([DraftRequest("p", [7, 8, 7, 8], 5)]) == [Draft((7, 8))]
    with pytest.raises(ValueError, match="n-gram sizes"):
        NgramDraftSource(max_ngram=1, min_ngram=2)


def test_ngram_index_grown_step_by_step_proposes_as_a_fresh_one() -> None:
    generator = torch.Generator().manual_seed(3)
    text = torch.randint(0, 6, (300,), generator=generator).tolist()
    grown = NgramDraftSource()
    for length in range(1, len(text) + 1):
        fresh = NgramDraftSource()
        wanted = DraftRequest("r", text[:length], 4)
        assert grown.propose([wanted]) == fresh.propose([wanted]), length
    grown.forget("r")
    assert grown._indexes == {}


# --- the policy ---------------------------------------------------------------------------


def test_draft_length_grows_after_full_acceptance_and_shrinks_after_a_rejection() -> None:
    length = DraftLength(minimum=1, maximum=6, current=3)
    length.update(drafted=3, accepted=3)
    assert length.current == 5
    length.update(drafted=5, accepted=5)
    assert length.current == 6  # capped
    for _ in range(10):
        length.update(drafted=6, accepted=0)
    assert length.current == 1  # floored
    length.update(drafted=0, accepted=0)  # no draft: unchanged
    assert length.current == 1
    with pytest.raises(ValueError, match="draft length bounds"):
        SpeculationSettings(draft_min=4, draft_max=3)
    assert SpeculationSettings(default=False).mode_of(None) is False
    assert SpeculationSettings(default=False).mode_of("auto") == "auto"


def test_auto_switch_turns_off_where_drafts_cost_more_than_they_gain_and_probes() -> None:
    switch = AutoSwitch()
    assert not switch.allows(1)  # no plain step measured yet: a reference step
    switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)  # a plain step: 100 tok/s
    assert switch.allows(1) and not switch.probing
    # Drafts of 6: the step costs 1.5x and yields 1.2 tokens: 80 tok/s.
    for _ in range(20):
        switch.observe(requests=1, rows=7, emitted=1, seconds=0.015)
    assert not switch.enabled and switch.gain is not None and switch.gain < 1

    def steps(count: int) -> list[bool]:  # `count` steps, the plain ones measured
        allowed = []
        for _ in range(count):
            allowed.append(switch.allows(1))
            if not allowed[-1]:
                switch.observe(requests=1, rows=1, emitted=1, seconds=0.010)
        return allowed

    # Off: the last PROBE_STEPS steps of PROBE_INTERVAL draft, then probes back off.
    allowed = steps(PROBE_INTERVAL)
    assert allowed.count(True) == PROBE_STEPS and all(allowed[-PROBE_STEPS:])
    allowed = steps(2 * PROBE_INTERVAL)
    assert allowed.count(True) == PROBE_STEPS and all(allowed[-PROBE_STEPS:])
    # The probes find the text copyable now: 5 tokens per 1.5x step.
    for _ in range(20):
        switch.observe(requests=1, rows=7, emitted=5, seconds=0.015)
    assert switch.enabled and switch.allows(1)


def test_the_draft_length_is_the_one_with_the_most_tokens_per_second_of_step_time() -> None:
    assert expected_tokens(0.5, 0) == 1.0 and expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert expected_tokens(1.0, 4) == 5.0

    def linear(rows: int) -> float:  # a step costs 10 ms, and 5 ms more per row
        return 0.010 + 0.005 * rows

    # Likely drafts pay for long rows; unlikely ones for none.
    assert best_draft_length(0.95, 6, 1, linear) == 6
    assert best_draft_length(0.2, 6, 1, linear) == 0
    assert 0 < best_draft_length(0.6, 6, 1, linear) < 6
    assert best_draft_length(0.2, 6, 1, lambda rows: None) == 6  # nothing measured: try
    length = DraftLength(minimum=1, maximum=6)
    assert length.acceptance is None
    length.update(drafted=4, accepted=4)
    length.update(drafted=4, accepted=2)
    assert length.acceptance == pytest.approx((0.9 * 4 + 2) / (0.9 * 4 + 2 + 1))


def test_drafting_stops_where_its_rows_cost_more_than_they_bring(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    params = [request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative="auto")]
    reference = plain_references(engine, params)
    drafts = ScriptedDrafts(reference, engine.vocab_size)
    speculation(engine).source = drafts
    # A step's time grows faster than its rows: no draft, even one always accepted (the
    # first round's), brings tokens as fast as plain steps.
    speculation(engine).step_cost = lambda rows: float(rows) ** 1.5
    speculation(engine).auto_switch._steps = PROBE_STEPS  # past the first probe: none here
    state = engine.build_request(params[0], None, "r0")
    run(engine, [state], [0])
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    # The first draft (no acceptance known yet) is verified, then none.
    assert drafts.rounds == 1
    # A request that asks for speculation drafts whatever the costs.
    forced = engine.build_request(params[0].model_copy(update={"speculative": True}), None, "r1")
    drafts.reference["r1"] = reference["r0"]
    run(engine, [forced], [0])
    assert forced.generated_ids == state.generated_ids and drafts.rounds > 4


# --- exact verification, one request's state alone ----------------------------------------


class BigramModel:
    """A small-vocabulary "model": the next token's logits depend on the last token only
    (`table[last]`), so the target distribution of a sequence is known exactly."""

    def __init__(self, vocab: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.table = torch.randn(vocab, vocab, generator=generator) * 1.5  # [last, next]

    def rows(self, fed: int, draft: Sequence[int]) -> torch.Tensor:
        """The verify step's logits: after `fed`, then after each draft token."""
        return self.table[[fed, *draft]]


def bare_state(params: SamplingParams, max_tokens: int = 2) -> RequestState:
    """A request of a one-token prompt over `BigramModel`'s vocabulary (tokens as "<i>")."""
    return RequestState(
        request_id="r",
        prompt_ids=[0],
        max_new_tokens=max_tokens,
        chooser=TokenChooser(Sampler(params)),
        top_logprobs=0,
        detokenizer=StreamingDetokenizer(lambda ids: "".join(f"<{i}>" for i in ids), [0]),
        stop_matcher=StopSequenceMatcher(()),
        eos_token_ids=frozenset(),
        logprob_of=lambda logits, token, top: TokenLogprob(
            token=f"<{token}>",
            token_id=token,
            logprob=step_logprobs(cast(torch.Tensor, logits), token, top).logprob,
        ),
    )


def chi_square_p_value(observed: list[int], expected: list[float]) -> float:
    """Upper tail of Pearson's chi-square (Wilson-Hilferty normal approximation)."""
    statistic = sum((o - e) ** 2 / e for o, e in zip(observed, expected, strict=True) if e > 0)
    freedom = sum(1 for e in expected if e > 0) - 1
    z = ((statistic / freedom) ** (1 / 3) - (1 - 2 / (9 * freedom))) / math.sqrt(2 / (9 * freedom))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_sampled_tokens_follow_the_target_distribution_chi_square() -> None:
    """Two tokens after token 0, drafted greedily (the likeliest next tokens, accepted
    part of the time): over 6,000 seeds the pairs follow p(x1) p(x2 | x1) (36 cells), and
    the first draft token is accepted with probability p(draft)."""
    vocab, samples = 6, 6_000
    model = BigramModel(vocab, seed=5)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    target = torch.softmax(model.table / 0.8, dim=-1).double()  # [last, next]
    draft = [int(target[0].argmax()), int(target[int(target[0].argmax())].argmax())]
    counts = [0] * (vocab * vocab)
    accepted_first = 0
    for seed in range(samples):
        state = bare_state(dataclasses.replace(params, seed=seed))
        pieces, accepted = state.accept_drafts(model.rows(0, draft), draft)
        accepted_first += int(accepted >= 1)
        while not state.finished:  # a rejection: the next step drafts the likeliest token
            fed = state.generated_ids[-1]
            guess = [int(target[fed].argmax())]
            pieces, _ = state.accept_drafts(model.rows(fed, guess), guess)
        first, second = state.generated_ids
        counts[first * vocab + second] += 1
        assert pieces[-1].finish_reason == "length"
    expected = [
        samples * float(target[0, a] * target[a, b]) for a in range(vocab) for b in range(vocab)
    ]
    assert chi_square_p_value(counts, expected) > 1e-3
    share = accepted_first / samples
    bound = 4 * math.sqrt(float(target[0, draft[0]]) * (1 - float(target[0, draft[0]])) / samples)
    assert abs(share - float(target[0, draft[0]])) < bound


def test_a_seed_gives_the_tokens_of_plain_decoding_whatever_the_draft() -> None:
    model = BigramModel(8, seed=1)
    for seed, draft in itertools.product(range(40), ([1, 2, 3], [5, 5, 5, 5], [0])):
        params = SamplingParams(temperature=1.0, top_p=0.9, top_k=0, min_p=0.0, seed=seed)
        plain = bare_state(params, max_tokens=6)
        last = 0
        while not plain.finished:
            plain.accept(model.table[last])
            last = plain.generated_ids[-1]
        speculative = bare_state(params, max_tokens=6)
        while not speculative.finished:
            fed = speculative.generated_ids[-1] if speculative.generated_ids else 0
            speculative.accept_drafts(model.rows(fed, draft), draft)
        assert speculative.generated_ids == plain.generated_ids, (seed, draft)


# --- the engine: drafts with scripted mistakes --------------------------------------------


class ScriptedDrafts:
    """Proposes the continuation plain decoding produced for each request (`reference`:
    request id -> its prompt and generated tokens), with a wrong token at index
    `round % 3` of every draft whose round number is not a multiple of 3 (round 0, 3, ...:
    all correct), so drafts are accepted whole, cut at their first token and cut later."""

    def __init__(self, reference: dict[str, list[int]], vocab: int) -> None:
        self.reference = reference
        self.vocab = vocab
        self.rounds = 0
        self.forgotten: list[str] = []

    @property
    def name(self) -> str:
        return "scripted"

    def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
        drafts = []
        for wanted in requests:
            expected = self.reference[wanted.request_id]
            assert list(wanted.tokens) == expected[: len(wanted.tokens)], "text diverged"
            draft = expected[len(wanted.tokens) : len(wanted.tokens) + wanted.max_tokens]
            if draft and self.rounds % 3:
                wrong = min(self.rounds % 3 - 1, len(draft) - 1)
                draft[wrong] = (draft[wrong] + 1) % self.vocab
            self.rounds += 1
            drafts.append(Draft(tuple(draft)))
        return drafts

    def forget(self, request_id: str) -> None:
        self.forgotten.append(request_id)


def run(engine: TorchEngine, states: list[RequestState], join_at: list[int]) -> dict[str, Any]:
    """Submit `states[i]` before step `join_at[i]`; step until all finish."""
    pieces: dict[str, list[GeneratedPiece]] = {state.request_id: [] for state in states}
    for step in range(1_000):
        for state, join in zip(states, join_at, strict=True):
            if join == step:
                engine.scheduler.add(state)
        for request_id, output in engine.step():
            assert isinstance(output, GeneratedPiece), (request_id, output)
            pieces[request_id].append(output)
        if step >= max(join_at) and not engine.has_work:
            engine.store_finished()
            return pieces
    raise AssertionError("the batch did not finish within 1,000 steps")


def plain_references(
    engine: TorchEngine, params: list[TextGenerationTaskParams]
) -> dict[str, list[int]]:
    """Each request alone, without drafts: request id -> prompt and generated tokens."""
    reference: dict[str, list[int]] = {}
    for index, one in enumerate(params):
        engine.clear_prefix_cache()
        state = engine.build_request(
            one.model_copy(update={"speculative": False}), None, f"r{index}"
        )
        run(engine, [state], [0])
        reference[f"r{index}"] = state.prompt_ids + state.generated_ids
    engine.clear_prefix_cache()
    return reference


def load(directory: Path, **options: Any) -> TorchEngine:
    card = card_from_local_directory(directory)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    options.setdefault("weight_dtype", "float32")
    engine = TorchEngine.load(directory, shard, **options)
    engine.eos_token_ids = frozenset({-1})  # random weights: stop by length or stop string
    speculation(engine).step_cost = lambda rows: None  # draft lengths never follow the clock
    return engine


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


# --- the same kernels: verify rows are decode rows, bit for bit ---------------------------


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
