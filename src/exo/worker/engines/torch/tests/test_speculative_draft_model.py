"""Speculative decoding with a draft model on the target's node (issue 43): greedy output is
plain decoding's token for token, the draft's and the target's KV follow the verified text,
sampled tokens follow the target's distribution (the general rejection rule), a seed repeats
its output, and a draft of another vocabulary is refused at load (the model then serves
without it, as it does when any draft fails to load).

The target is a tiny random Llama with untied embeddings (a tied one repeats its input
token, which any draft guesses). A draft agreeing with it part of the time is the target's
checkpoint with every weight moved by a little seeded noise (`noisy_copy`): random models of
another size agree on almost nothing. A smaller draft (the target's first layer only) is
checked for exactness too.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from loguru import logger
from safetensors.torch import load_file, save_file

from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch import draft_model
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.decoding.sampling import Sampler, SamplingParams, TokenChooser
from exo.worker.engines.torch.decoding.speculative_drafts import Draft, DraftRequest
from exo.worker.engines.torch.draft_model import (
    DraftModelSource,
    VocabularyMismatchError,
    load_draft_model,
)
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.speculative_builders import (
    PROMPTS,
    BigramModel,
    bare_state,
    chi_square_p_value,
    load,
    plain_references,
    request,
    run,
    speculation,
)

PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades "
    "of salt and wind. Every night the keeper climbed the spiral stairs to light the lamp."
)
# Noise (standard deviation) added to every weight of the target for the draft: with it the
# tiny draft's greedy tokens agree with the target's about a third of the time.
DRAFT_NOISE = 0.003


def noisy_copy(target: Path, directory: Path, noise: float, layers: int | None = None) -> Path:
    """The target's checkpoint with seeded noise on every tensor (and only its first
    `layers` decoder layers, where given)."""
    shutil.copytree(target, directory)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for name, tensor in load_file(target / "model.safetensors").items():
        layer = int(name.split(".")[2]) if name.startswith("model.layers.") else -1
        if layers is not None and layer >= layers:
            continue
        tensors[name] = tensor + noise * torch.randn(tensor.shape, generator=generator)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    if layers is not None:
        config = json.loads((directory / "config.json").read_text())
        config["num_hidden_layers"] = layers
        (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft-model")
    target = save_tiny_model(
        root / "target", "llama", real_model_dir, n_layers=3, tie_word_embeddings=False
    )
    return {
        "target": target,
        "draft": noisy_copy(target, root / "draft", DRAFT_NOISE),
        "smaller": noisy_copy(target, root / "smaller", 0.0, layers=1),
    }


@pytest.fixture(scope="module")
def module_float32_kv() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_KV_CACHE_DTYPE", "float32")
        yield


@pytest.fixture(scope="module")
def engine(model_dirs: dict[str, Path], module_float32_kv: None) -> TorchEngine:
    return load(model_dirs["target"], draft_model=model_dirs["draft"])


def draft_source(engine: TorchEngine) -> DraftModelSource:
    source = speculation(engine).source
    assert isinstance(source, DraftModelSource)
    return source


# --- greedy: token for token --------------------------------------------------------------


def test_greedy_with_a_draft_model_is_plain_decoding_batched_with_plain_requests(
    engine: TorchEngine,
) -> None:
    params = [
        request(PROMPTS[0], temperature=0.0, max_tokens=23, speculative=True),
        request(PROMPTS[1], temperature=0.0, max_tokens=9, speculative=False),
        request(PROMPTS[2], temperature=0.0, max_tokens=17, speculative=True),
    ]
    reference = plain_references(engine, params)
    before = dataclasses.replace(speculation(engine).counters)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 2, 5])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    counters = speculation(engine).counters
    drafted = counters.drafted_tokens - before.drafted_tokens
    accepted = counters.accepted_tokens - before.accepted_tokens
    assert counters.verify_rounds - before.verify_rounds >= 6
    assert 0 < accepted < drafted  # whole drafts, and rejections
    source = draft_source(engine)
    assert source.cache.occupied == 0 and source.held_tokens("r0") == []  # all forgotten


@pytest.mark.slow
def test_a_smaller_draft_model_keeps_greedy_output_exact(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    engine = load(model_dirs["target"], draft_model=model_dirs["smaller"])
    assert draft_source(engine).model.config.num_hidden_layers == 1
    params = [request(prompt, temperature=0.0, max_tokens=12, speculative=True)
              for prompt in PROMPTS]  # fmt: skip
    reference = plain_references(engine, params)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 0, 1])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert speculation(engine).counters.verify_rounds > 0


def test_int4_target_and_draft_keep_greedy_output_exact(
    model_dirs: dict[str, Path], module_float32_kv: None
) -> None:
    """The draft model is held in the target's weight format; verify rows stay decode rows
    on int4 weights, so greedy output is plain decoding's there too."""
    engine = load(model_dirs["target"], draft_model=model_dirs["draft"], weight_dtype="int4")
    assert engine.weight_dtype == "int4"
    assert type(draft_source(engine).model.model.layers[0].mlp.up_proj).__name__ == "Int4Linear"
    params = [request(prompt, temperature=0.0, max_tokens=16, speculative=index != 1)
              for index, prompt in enumerate(PROMPTS)]  # fmt: skip
    reference = plain_references(engine, params)
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    run(engine, states, join_at=[0, 1, 2])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert speculation(engine).counters.accepted_tokens > 0


def test_kv_after_a_rejection_equals_plain_decodings_for_target_and_draft(
    engine: TorchEngine,
) -> None:
    params = request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True)
    plain = engine.build_request(params.model_copy(update={"speculative": False}), None, "p0")
    engine.clear_prefix_cache()
    run(engine, [plain], [0])
    text = plain.prompt_ids + plain.generated_ids
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is not None
    plain_kv = scheduler.prefix_cache.lookup(text, limit=len(text))
    assert plain_kv is not None
    engine.clear_prefix_cache()
    source = draft_source(engine)
    # A second source over the same draft weights: its KV of a text is a fresh prefill's.
    fresh = DraftModelSource(
        source.model, _empty_like(source), source._windows, source.vocab_size, "fresh",
        source._device,
    )  # fmt: skip
    state = engine.build_request(params, None, "k0")
    scheduler.add(state)
    rejections = 0
    while engine.has_work:
        counters = speculation(engine).counters
        drafted, accepted = counters.drafted_tokens, counters.accepted_tokens
        engine.step()
        if state.finished:
            break
        if counters.drafted_tokens - drafted == counters.accepted_tokens - accepted:
            continue
        rejections += 1
        (running,) = scheduler._running
        kv = scheduler._cache.read(running.slot, running.computed)
        torch.testing.assert_close(
            kv, plain_kv.kv[:, :, :, : running.computed], atol=1e-5, rtol=1e-5
        )
        # The draft rolls back to the verified text at its next proposal; its KV is then
        # a fresh prefill's of that text.
        source.propose([DraftRequest("k0", running.tokens, 1)])
        held = source.held_tokens("k0")
        assert held == running.tokens
        fresh.forget("k0")
        fresh.propose([DraftRequest("k0", held, 1)])
        assert fresh.held_tokens("k0") == held
        slot = source._sequences["k0"].slot
        torch.testing.assert_close(
            source.cache.read(slot, len(held)),
            fresh.cache.read(fresh._sequences["k0"].slot, len(held)),
            atol=1e-5,
            rtol=1e-5,
        )
    assert rejections >= 2
    assert state.prompt_ids + state.generated_ids == text
    engine.store_finished()


def test_a_long_texts_draft_catches_up_one_chunk_per_step_with_the_kv_of_one_prefill(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A step prefills at most `DRAFT_PREFILL_CHUNK` draft positions in all: a short
    request drafts at once, a long one catches up with what is left of each step's budget
    and drafts once its KV caught up: the draft and the KV of one whole prefill."""
    source = draft_source(engine)
    whole = DraftModelSource(
        source.model, _empty_like(source), source._windows, source.vocab_size, "whole",
        source._device,
    )  # fmt: skip
    text = engine.tokenizer.encode(PASSAGE)
    assert len(text) > 33
    wanted = [DraftRequest("long", text, 3), DraftRequest("short", text[:9], 2)]
    expected = whole.propose(wanted)  # the whole text in one pass (a chunk of 512)
    monkeypatch.setattr(draft_model, "DRAFT_PREFILL_CHUNK", 16)
    steps = 0
    while True:
        positions = source.positions_computed
        got = source.propose(wanted)
        steps += 1
        # The first pass's positions: the step's total less one per later draft token.
        later = sum(max(0, len(draft.tokens) - 1) for draft in got)
        assert source.positions_computed - positions - later <= 16
        assert got[1].tokens == expected[1].tokens  # the short request drafts every step
        if got[0].tokens:
            break
        assert steps < len(text)
    assert got[0].tokens == expected[0].tokens
    # 16 - 9 positions at the first step, then 15 a step (beside the short one's token).
    assert steps == 1 + -(-(len(text) - 7) // 15)
    for request_id in ("long", "short"):
        held = source.held_tokens(request_id)
        assert held == whole.held_tokens(request_id)
        torch.testing.assert_close(
            source.cache.read(source._sequences[request_id].slot, len(held)),
            whole.cache.read(whole._sequences[request_id].slot, len(held)),
            atol=1e-5,
            rtol=1e-5,
        )
        source.forget(request_id)
        whole.forget(request_id)
    assert source.cache.occupied == 0


def test_a_long_prompts_draft_prefill_is_bounded_per_step_and_greedy_stays_exact(
    engine: TorchEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long prompt joining a speculating batch: no draft forward pass of any step
    computes more than the chunk, the long request speculates once its draft caught up,
    and every request's greedy output is plain decoding's."""
    chunk = 8
    monkeypatch.setattr(draft_model, "DRAFT_PREFILL_CHUNK", chunk)
    params = [
        request(PROMPTS[0], temperature=0.0, max_tokens=24, speculative=True),
        request(PASSAGE, temperature=0.0, max_tokens=24, speculative=True),
    ]
    reference = plain_references(engine, params)
    source = draft_source(engine)
    passes: list[int] = []
    forward = source._forward

    def counted(sequences: list[Any], feeds: list[list[int]]) -> torch.Tensor:
        passes.append(sum(len(feed) for feed in feeds))
        return forward(sequences, feeds)

    monkeypatch.setattr(source, "_forward", counted)
    before = speculation(engine).counters.verify_rounds
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    assert len(states[1].prompt_ids) > 4 * chunk
    run(engine, states, join_at=[0, 0])
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
    assert passes and max(passes) <= chunk
    assert speculation(engine).counters.verify_rounds - before >= 4


def test_a_failing_draft_source_leaves_decoding_plain(engine: TorchEngine) -> None:
    source = draft_source(engine)
    forgotten: list[str] = []

    class Failing:
        name = "failing"

        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            raise RuntimeError("the draft model broke")

        def forget(self, request_id: str) -> None:
            forgotten.append(request_id)

    params = request(PROMPTS[0], temperature=0.0, max_tokens=10, speculative=True)
    reference = plain_references(engine, [params])
    speculation(engine).source = Failing()
    try:
        state = engine.build_request(params, None, "r0")
        run(engine, [state], [0])
    finally:
        speculation(engine).source = source
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    assert forgotten.count("r0") >= 9  # every step's proposal failed, then the release


def test_the_drafting_time_counts_in_the_step_time_the_switch_measures(
    engine: TorchEngine,
) -> None:
    """A draft model's forward passes are part of a speculating step's cost: the step time
    the automatic switch observes includes the proposal's."""
    source = draft_source(engine)
    observed: list[tuple[int, float]] = []
    spec = speculation(engine)

    class Slow:
        name = "slow"

        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            time.sleep(0.05)  # at least 50 ms, whatever the machine
            return source.propose(requests)

        def forget(self, request_id: str) -> None:
            source.forget(request_id)

    def step_measured(
        requests: int, rows: int, emitted: int, seconds: float, draft_seconds: float
    ) -> None:
        observed.append((rows, seconds + draft_seconds))

    spec.source = Slow()
    spec.step_measured = step_measured  # type: ignore[method-assign]
    try:
        state = engine.build_request(
            request(PROMPTS[1], temperature=0.0, max_tokens=6, speculative=True), None, "t0"
        )
        run(engine, [state], [0])
    finally:
        spec.source = source
        del spec.step_measured
    drafted = [seconds for rows, seconds in observed if rows > 1]
    assert drafted and all(seconds >= 0.05 for seconds in drafted)
    assert spec.take_draft_seconds() == 0.0  # each step took its own


def _empty_like(source: DraftModelSource) -> SlotKVCache:
    """An empty KV cache of `source`'s geometry and slots."""
    cache = source.cache
    keys = cache.keys[0]
    return SlotKVCache(
        len(cache.keys), keys.shape[1], keys.shape[3], keys.dtype, keys.device, cache.slots,
        cache.latent_values, cache.windows,
    )  # fmt: skip


# --- sampling: the general rejection rule -------------------------------------------------


def test_sampled_tokens_with_draft_distributions_follow_the_target_chi_square() -> None:
    """A draft distribution q unlike the target's p (another random bigram table): two
    tokens after token 0, each step drafting two tokens drawn from q, over 6,000 seeds.
    The pairs follow p(x1) p(x2 | x1) (36 cells) and the first draft token is accepted with
    probability sum_t min(p(t), q(t)) (Leviathan et al. 2023, the acceptance rate)."""
    vocab, samples = 6, 6_000
    target_model, draft_model = BigramModel(vocab, seed=5), BigramModel(vocab, seed=11)
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None)
    target = torch.softmax(target_model.table / 0.8, dim=-1).double()  # [last, next]
    proposal = torch.softmax(draft_model.table, dim=-1)  # [last, next] float32
    counts = [0] * (vocab * vocab)
    accepted_first = 0
    drafts = torch.Generator().manual_seed(0)
    for seed in range(samples):
        state = bare_state(dataclasses.replace(params, seed=seed))
        first_round = True
        while not state.finished:
            fed = state.generated_ids[-1] if state.generated_ids else 0
            draft = [int(torch.multinomial(proposal[fed], 1, generator=drafts))]
            draft.append(int(torch.multinomial(proposal[draft[0]], 1, generator=drafts)))
            _pieces, accepted = state.accept_drafts(
                target_model.rows(fed, draft), draft, proposal[[fed, draft[0]]]
            )
            if first_round:
                accepted_first += int(accepted >= 1)
                first_round = False
        first, second = state.generated_ids
        counts[first * vocab + second] += 1
    expected = [
        samples * float(target[0, a] * target[a, b]) for a in range(vocab) for b in range(vocab)
    ]
    assert chi_square_p_value(counts, expected) > 1e-3
    rate = float(torch.minimum(target[0], proposal[0].double()).sum())
    bound = 4 * math.sqrt(rate * (1 - rate) / samples)
    assert abs(accepted_first / samples - rate) < bound


def test_a_seed_gives_plain_text_with_certain_drafts_and_repeats_with_drawn_ones() -> None:
    """What docs/api.md promises for one `seed` (trial 38 found the old sentence too broad):
    drafts verified as certain tokens (prompt lookup; a draft model on a spare node, which
    sends its likeliest tokens) give plain decoding's very tokens; drafts drawn from q (a
    draft model in rank 0's process) repeat run to run with the same drafts, but are
    another draw of the same distribution (the chi-square test above): their acceptance
    test takes the request's random numbers in another order."""
    target, draft_model = BigramModel(6, seed=5), BigramModel(6, seed=11)
    proposal = torch.softmax(draft_model.table, dim=-1)  # [last, next] q
    params = SamplingParams(temperature=0.8, top_p=1.0, top_k=0, min_p=0.0, seed=None)

    def plain(seeded: SamplingParams) -> list[int]:
        state = bare_state(seeded, max_tokens=6)
        while not state.finished:
            state.accept(target.table[state.generated_ids[-1] if state.generated_ids else 0])
        return state.generated_ids

    def speculative(seeded: SamplingParams, drawn: torch.Generator | None) -> list[int]:
        state = bare_state(seeded, max_tokens=6)
        while not state.finished:
            fed = state.generated_ids[-1] if state.generated_ids else 0
            if drawn is None:  # the draft model's likeliest tokens, verified as certain
                first = int(draft_model.table[fed].argmax())
                draft, q = [first, int(draft_model.table[first].argmax())], None
            else:
                first = int(torch.multinomial(proposal[fed], 1, generator=drawn))
                draft = [first, int(torch.multinomial(proposal[first], 1, generator=drawn))]
                q = proposal[[fed, first]]
            state.accept_drafts(target.rows(fed, draft), draft, q)
        return state.generated_ids

    other_text = 0
    for seed in range(30):
        seeded = dataclasses.replace(params, seed=seed)
        expected = plain(seeded)
        assert speculative(seeded, None) == expected, seed
        once = speculative(seeded, torch.Generator().manual_seed(seed))
        assert speculative(seeded, torch.Generator().manual_seed(seed)) == once, seed
        other_text += once != expected
    assert other_text > 0, "drawn drafts gave plain decoding's text: say so in docs/api.md"


class EvenTokens:
    """A constraint allowing even token ids only."""

    is_complete = False

    def allowed(self, token_id: int) -> bool:
        return token_id % 2 == 0

    def allowed_tokens(self) -> list[int]:
        return [token for token in range(6) if token % 2 == 0]

    def advance(self, token_id: int) -> None:
        pass


def test_a_drawn_draft_token_the_grammar_forbids_is_always_rejected() -> None:
    model = BigramModel(6, seed=2)
    uniform = torch.full((6,), 1 / 6)
    for seed in range(200):
        params = SamplingParams(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed)
        state = bare_state(params, max_tokens=4)
        state.chooser = TokenChooser(Sampler(params), constraint=EvenTokens())
        fed = 0
        while not state.finished:
            draft = [1, 3]  # odd: forbidden
            _pieces, accepted = state.accept_drafts(
                model.rows(fed, draft), draft, uniform.expand(2, 6)
            )
            assert accepted == 0
            fed = state.generated_ids[-1]
        assert all(token % 2 == 0 for token in state.generated_ids)


def test_seeded_sampling_with_a_draft_model_repeats_its_output(engine: TorchEngine) -> None:
    # top-k keeps the filters cheap (a top-p nucleus of a random model's flat distribution
    # holds most of the vocabulary).
    params = request(PROMPTS[2], temperature=0.9, top_k=40, seed=5, max_tokens=20,
                     speculative=True, frequency_penalty=0.4)  # fmt: skip
    outputs = []
    before = dataclasses.replace(speculation(engine).counters)
    for attempt in range(2):
        engine.clear_prefix_cache()
        state = engine.build_request(params, None, f"s{attempt}")
        run(engine, [state], [0])
        outputs.append(state.generated_ids)
    assert outputs[0] == outputs[1] and len(outputs[0]) == 20
    counters = speculation(engine).counters
    assert counters.verify_rounds > before.verify_rounds
    assert counters.accepted_tokens > before.accepted_tokens


# --- loading ------------------------------------------------------------------------------


def test_a_draft_model_with_another_vocabulary_is_refused_at_load(
    tmp_path: Path, model_dirs: dict[str, Path], real_model_dir: Path
) -> None:
    other = tmp_path / "other-vocabulary"
    shutil.copytree(model_dirs["smaller"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = sorted(vocabulary, key=vocabulary.get)[100:102]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    target = load(model_dirs["target"])
    with pytest.raises(VocabularyMismatchError) as refused:
        load_draft_model(
            other, target.tokenizer, "the-target", target.vocab_size, 2, torch.float32,
            weight_dtype="float32",
        )  # fmt: skip
    assert str(other) in str(refused.value) and "the-target" in str(refused.value)
    assert "2 tokens with other ids" in str(refused.value)


def test_a_draft_that_fails_to_load_leaves_the_model_serving_without_it(
    tmp_path: Path, model_dirs: dict[str, Path]
) -> None:
    """Another vocabulary (trial 38: a card can be wrong, a custom draft unchecked) or a
    directory that is no model: the target loads and serves (prompt-lookup drafts, its
    greedy output plain decoding's), says why in `draft_left_out` and logs it as one
    warning, without a traceback."""
    other = tmp_path / "other-vocabulary"
    shutil.copytree(model_dirs["smaller"], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocabulary = tokenizer["model"]["vocab"]
    first, second = sorted(vocabulary, key=vocabulary.get)[100:102]
    vocabulary[first], vocabulary[second] = vocabulary[second], vocabulary[first]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    (no_weights / "config.json").write_text("{}")
    params = request(PROMPTS[0], max_tokens=12, temperature=0.0, speculative=True)
    plain = load(model_dirs["target"])
    reference = plain.build_request(params, None, "plain")
    run(plain, [reference], [0])
    for draft, expected in ((other, "vocabularies differ"), (no_weights, "could not be loaded")):
        records: list[Any] = []
        sink = logger.add(records.append, level="WARNING")
        try:
            engine = load(model_dirs["target"], draft_model=draft)
        finally:
            logger.remove(sink)
        assert engine.draft_source is None
        assert engine.draft_left_out is not None and expected in engine.draft_left_out
        assert "serves without it" in engine.draft_left_out
        (record,) = [message.record for message in records]
        assert record["level"].name == "WARNING" and record["exception"] is None
        assert record["message"] == engine.draft_left_out
        state = engine.build_request(params, None, "served")
        run(engine, [state], [0])
        assert state.generated_ids == reference.generated_ids


def test_draft_model_option_reaches_the_engine_through_the_runners_loading_path(
    model_dirs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--draft-model` parses to the node's options and the runner's; the runner's loading
    entry resolves it as a requested model (a local directory here) and the engine drafts
    from it; a split instance's ranks load none; a catalog draft whose files are not on the
    node (its download failed) is left out and the model served without it; one that is
    there is named by its model id."""
    from exo.node_options import parse_args
    from exo.shared.models.cards import card_from_local_directory
    from exo.shared.types.shards import ShardMetadata
    from exo.worker.engines.torch.engine_factory import load_serving_engine
    from exo.worker.runner.options import RunnerOptions

    draft = str(model_dirs["smaller"])
    assert parse_args([]).draft_model is None
    assert parse_args(["--draft-model", draft]).draft_model == draft
    assert RunnerOptions(draft_model=draft).draft_model == draft
    card = card_from_local_directory(model_dirs["target"])
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    engine = load_serving_engine(model_dirs["target"], shard, draft_model=draft)
    assert isinstance(engine, TorchEngine)
    assert isinstance(engine.draft_source, DraftModelSource)
    assert engine.draft_source.name == draft
    assert draft_source(engine) is engine.draft_source
    plain = load_serving_engine(model_dirs["target"], shard)
    assert isinstance(plain, TorchEngine) and plain.draft_source is None
    unknown = load_serving_engine(model_dirs["target"], shard, draft_model="no/such-model")
    assert isinstance(unknown, TorchEngine) and unknown.draft_source is None
    assert unknown.draft_left_out is not None and "unknown model" in unknown.draft_left_out
    from exo.worker.engines.torch import engine_factory

    monkeypatch.setattr(engine_factory, "models_dir", lambda: tmp_path)  # holds nothing
    missing = load_serving_engine(
        model_dirs["target"], shard, draft_model="HuggingFaceTB/SmolLM2-1.7B-Instruct"
    )
    assert isinstance(missing, TorchEngine) and missing.draft_source is None
    assert missing.draft_left_out is not None
    # A catalog draft found on the node is named by its model id (`RunnerReady.draft_model`,
    # metrics, logs), as a draft running on a spare node is, not by its directory.
    catalog_draft = "HuggingFaceTB/SmolLM2-135M-Instruct"
    monkeypatch.setattr(
        engine_factory, "draft_model_directory", lambda name, _: model_dirs["smaller"]
    )
    named = load_serving_engine(model_dirs["target"], shard, draft_model=catalog_draft)
    assert isinstance(named, TorchEngine) and isinstance(named.draft_source, DraftModelSource)
    assert named.draft_source.name == catalog_draft
