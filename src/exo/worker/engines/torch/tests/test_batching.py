"""Continuous batching: a request decoded in a batch gets the logits it gets alone.

Teacher forcing: each request first runs alone, recording its tokens and the logits of
every step; then all run together (joining at staggered steps, different prompt lengths),
each fed its solo tokens, and the logits of every step are compared. Batching changes the
floating-point reduction order (and the int4 layers' kernel above `fused_max_rows`), so
they agree within a tolerance, measured on these models and stated here per weight format.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.batching.chunk_sizer import PrefillChunkSizer
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.batching.scheduler import (
    PREFILL_TOKENS_PER_IDLE_STEP,
    PREFILL_TOKENS_PER_STEP,
)
from exo.worker.engines.torch.decoding.sampling import TokenChooser
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_requests import RequestHandle

# Largest |batched - alone| logit difference allowed. Measured on float32 tiny models (logits
# up to ~4): below 2e-6 on a 2-core AVX512 Xeon; up to 1.06e-4 on an AVX2 Zen 3 (gemma3 on
# two threads, gpt_oss on one or two; transformers' own forward differs as much there: its
# float32 matmuls sum in an order that follows the row and thread counts). int4 below 2e-2.
# A batching bug (a wrong row, mask or position) moves logits by far more.
FLOAT32_TOLERANCE = 5e-4
INT4_TOLERANCE = 0.1

PROMPTS = ("Hi", "Tell me a story about a dragon and a knight", "Count: one two three four")


def request(content: str, **fields: Any) -> TextGenerationTaskParams:
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=content),), **fields
    )


class RecordingChooser:
    """Wraps a request's chooser, keeping a copy of every step's logits and token."""

    def __init__(self, inner: TokenChooser) -> None:
        self.inner = inner
        self.logits: list[torch.Tensor] = []
        self.tokens: list[int] = []

    @property
    def needs_logits(self) -> bool:
        return self.inner.needs_logits

    @property
    def is_complete(self) -> bool:
        return self.inner.is_complete

    def choose(self, logits: torch.Tensor) -> int:
        self.logits.append(logits.detach().clone())
        self.tokens.append(self.inner.choose(logits))
        return self.tokens[-1]

    def observe(self, token_id: int) -> None:
        self.inner.observe(token_id)


class ForcedChooser(RecordingChooser):
    """Records the logits but takes the given tokens (teacher forcing)."""

    def __init__(self, inner: TokenChooser, tokens: list[int]) -> None:
        super().__init__(inner)
        self.tokens = tokens

    def choose(self, logits: torch.Tensor) -> int:
        self.logits.append(logits.detach().clone())
        return self.tokens[len(self.logits) - 1]


def run_batch(
    engine: TorchEngine,
    states: list[RequestState],
    join_at: list[int],
    on_step: Callable[[int], None] | None = None,
) -> dict[str, list[GeneratedPiece]]:
    """Submit `states[i]` before step `join_at[i]`; step until all finish."""
    pieces: dict[str, list[GeneratedPiece]] = {state.request_id: [] for state in states}
    for step in range(2_000):
        for state, join in zip(states, join_at, strict=True):
            if join == step:
                engine.scheduler.add(state)
        if on_step is not None:
            on_step(step)
        for request_id, output in engine.step():
            assert isinstance(output, GeneratedPiece), (request_id, output)
            pieces[request_id].append(output)
        if step >= max(join_at) and not engine.has_work:
            engine.store_finished()  # as a runner does once the last pieces are out
            return pieces
    raise AssertionError("the batch did not finish within 2,000 steps")


def solo_and_batched(
    engine: TorchEngine, params: list[TextGenerationTaskParams], join_at: list[int]
) -> tuple[list[RecordingChooser], list[ForcedChooser], dict[str, list[GeneratedPiece]]]:
    """Run each request alone (recording), then all together, forced to the solo tokens."""
    solo: list[RecordingChooser] = []
    for index, one in enumerate(params):
        engine.clear_prefix_cache()
        state = engine.build_request(one, request_id=f"solo-{index}")
        recorder = RecordingChooser(state.chooser)
        state.chooser = cast(TokenChooser, recorder)
        run_batch(engine, [state], [0])
        solo.append(recorder)
    engine.clear_prefix_cache()
    forced: list[ForcedChooser] = []
    states: list[RequestState] = []
    for index, (one, recorder) in enumerate(zip(params, solo, strict=True)):
        state = engine.build_request(one, request_id=f"batched-{index}")
        chooser = ForcedChooser(state.chooser, recorder.tokens)
        state.chooser = cast(TokenChooser, chooser)
        states.append(state)
        forced.append(chooser)
    pieces = run_batch(engine, states, join_at)
    return solo, forced, pieces


def max_difference(solo: list[RecordingChooser], forced: list[ForcedChooser]) -> float:
    worst = 0.0
    for alone, batched in zip(solo, forced, strict=True):
        assert len(alone.logits) == len(batched.logits)
        for expected, got in zip(alone.logits, batched.logits, strict=True):
            worst = max(worst, float((expected - got).abs().max()))
    return worst


@pytest.fixture(scope="module")
def family_engines(
    tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path
) -> dict[str, TorchEngine]:
    """One 4-layer float32 engine per family (sliding window 4, shorter than the
    prompts: the windowed layers' masks are exercised)."""
    engines: dict[str, TorchEngine] = {}
    for name in ARCHITECTURES:
        directory = save_tiny_model(
            tmp_path_factory.mktemp(f"batch-{name}"), name, real_model_dir, n_layers=4,
            sliding_window=4,
        )  # fmt: skip
        card = card_from_local_directory(directory)
        shard = ShardMetadata(
            sharding="pipeline",
            model_card=card,
            device_rank=0,
            world_size=1,
            start_layer=0,
            end_layer=card.n_layers,
        )
        engines[name] = TorchEngine.load(directory, shard, weight_dtype="float32")
    return engines


@pytest.mark.parametrize("family", ARCHITECTURES)
def test_every_family_decodes_the_same_batched_as_alone(
    family_engines: dict[str, TorchEngine], family: str
) -> None:
    engine = family_engines[family]
    engine.eos_token_ids = frozenset({-1})  # random weights: run every step
    params = [request(prompt, temperature=0.0, max_tokens=4) for prompt in PROMPTS]
    solo, forced, _pieces = solo_and_batched(engine, params, join_at=[0, 1, 2])
    assert max_difference(solo, forced) < FLOAT32_TOLERANCE


# --- the tiny Llama (2 layers, context 256) ------------------------------------------------


def tiny_llama(tiny_card: Any, tiny_model_dir: Path, **options: Any) -> TorchEngine:
    shard = ShardMetadata(
        sharding="pipeline", model_card=tiny_card, device_rank=0, world_size=1, start_layer=0,
        end_layer=tiny_card.n_layers,
    )  # fmt: skip
    options.setdefault("weight_dtype", "float32")
    engine = TorchEngine.load(tiny_model_dir, shard, **options)
    engine.eos_token_ids = frozenset({-1})  # random weights: stop by length or stop string
    return engine


def feature_requests(engine: TorchEngine) -> list[TextGenerationTaskParams]:
    """Requests exercising every per-request feature, each different."""
    comma = engine.tokenizer.encode(",", add_special_tokens=False)[0]
    return [
        request("Hi", temperature=0.0, max_tokens=7),
        request(PROMPTS[1], temperature=1.0, seed=11, max_tokens=9, top_p=0.9, top_k=50),
        request(
            PROMPTS[2],
            temperature=0.8,
            seed=5,
            max_tokens=8,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            repetition_penalty=1.3,
        ),
        request("Logprobs", temperature=0.0, max_tokens=6, logprobs=True, top_logprobs=2),
        request("JSON please", temperature=0.0, max_tokens=12, response_format="json_object"),
        request("Stop", temperature=1.0, seed=3, max_tokens=30, stop=("e", "a")),
        request("Bias", temperature=0.0, max_tokens=5, logit_bias={comma: 100.0}),
    ]


def outcome(pieces: list[GeneratedPiece]) -> tuple[Any, ...]:
    """What a client sees of a generation (logprobs rounded: batching moves them ~1e-7)."""
    logprobs = [round(entry.logprob, 4) for piece in pieces for entry in piece.logprobs]
    final = pieces[-1]
    return (
        "".join(piece.text for piece in pieces),
        [token for piece in pieces for token in piece.token_ids],
        logprobs, final.finish_reason, final.stop_sequence, final.usage,
    )  # fmt: skip


def solo_outcomes(engine: TorchEngine, params: list[TextGenerationTaskParams]) -> list[Any]:
    """Each request's `outcome` when it runs alone (the prefix cache emptied before each);
    the cache is emptied again at the end."""
    alone = []
    for one in params:
        engine.clear_prefix_cache()
        alone.append(outcome(list(engine.generate(one))))
    engine.clear_prefix_cache()
    return alone


def test_every_feature_gives_the_same_output_in_a_batch(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    params = feature_requests(engine)
    alone = solo_outcomes(engine, params)
    states = [engine.build_request(one, request_id=f"r{index}") for index, one in enumerate(params)]
    pieces = run_batch(engine, states, join_at=[0, 0, 1, 2, 2, 4, 5])
    for index, expected in enumerate(alone):
        assert outcome(pieces[f"r{index}"]) == expected, params[index]
    assert alone[5][3] == "stop" and alone[5][4] in ("e", "a")  # the stop string was hit
    assert alone[4][0].lstrip().startswith("{")  # the JSON constraint applied


def test_cancelling_one_request_leaves_the_others_and_frees_its_kv(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    params = [request(prompt, temperature=1.0, seed=7, max_tokens=8) for prompt in PROMPTS]

    def states() -> list[RequestState]:
        engine.clear_prefix_cache()
        return [engine.build_request(one, request_id=f"r{i}") for i, one in enumerate(params)]

    full = run_batch(engine, states(), join_at=[0, 0, 0])
    held: list[int] = []

    cached: list[int] = []

    def cancel_middle(step: int) -> None:
        if step == 4:
            assert engine.scheduler.prefix_cache is not None
            held.append(engine.scheduler.kv_tokens())
            cached.append(engine.scheduler.prefix_cache.tokens)
            assert engine.cancel("r1")
            held.append(engine.scheduler.kv_tokens())
            cached.append(engine.scheduler.prefix_cache.tokens)

    cut = run_batch(engine, states(), join_at=[0, 0, 0], on_step=cancel_middle)
    assert outcome(cut["r0"]) == outcome(full["r0"])
    assert outcome(cut["r2"]) == outcome(full["r2"])
    assert cut["r1"] == full["r1"][: len(cut["r1"])] and cut["r1"][-1].finish_reason is None
    # Its KV (prompt and the tokens so far) left the running set at once, into the prefix
    # cache: the same request again reuses its prompt.
    prompt_tokens = len(engine.render_prompt(params[1]).token_ids)
    assert held[0] - held[1] > prompt_tokens
    assert cached[1] - cached[0] == held[0] - held[1]
    assert engine.scheduler.running_ids == [] and not engine.cancel("r1")
    again = list(engine.generate(params[1]))
    usage = again[-1].usage
    assert usage is not None and usage.cached_tokens == prompt_tokens - 1


def teacher_forced(
    engine: TorchEngine, params: TextGenerationTaskParams, tokens: list[int], request_id: str
) -> tuple[ForcedChooser, list[GeneratedPiece]]:
    state = engine.build_request(params, request_id=request_id)
    chooser = ForcedChooser(state.chooser, tokens)
    state.chooser = cast(TokenChooser, chooser)
    return chooser, run_batch(engine, [state], [0])[request_id]


def test_prefix_cache_reuses_a_conversation_and_keeps_the_logits(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    first = request(PROMPTS[1], temperature=0.0, max_tokens=10)
    answer = "".join(piece.text for piece in engine.generate(first))
    messages = (
        *first.messages,
        ChatMessage(role="assistant", content=answer),
        ChatMessage(role="user", content="And then?"),
    )
    second = first.model_copy(update={"messages": messages})
    engine.clear_prefix_cache()
    cold = RecordingChooser(engine.build_request(second).chooser)
    state = engine.build_request(second, request_id="cold")
    state.chooser = cast(TokenChooser, cold)
    cold_pieces = run_batch(engine, [state], [0])["cold"]
    assert cold_pieces[-1].usage is not None and cold_pieces[-1].usage.cached_tokens == 0
    # The first turn again, then the second: its shared prefix comes from the cache.
    list(engine.generate(first))
    warm, warm_pieces = teacher_forced(engine, second, cold.tokens, "warm")
    usage = warm_pieces[-1].usage
    assert usage is not None
    assert len(engine.render_prompt(first).token_ids) <= usage.cached_tokens
    assert usage.cached_tokens < usage.prompt_tokens
    assert max_difference([cold], [warm]) < FLOAT32_TOLERANCE


def test_prefix_cache_eviction_under_a_small_budget_stays_correct(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir, kv_cache_tokens=120)
    params = [request(prompt * 3, temperature=0.0, max_tokens=8) for prompt in PROMPTS]
    engine.clear_prefix_cache()
    cold = [outcome(list(engine.generate(one))) for one in params]
    cache = engine.scheduler.prefix_cache
    assert cache is not None and cache.tokens <= 120 and len(cache) < len(params)
    for _round in range(2):  # hits, misses and evictions interleaved
        for one, expected in zip(params, cold, strict=True):
            got = outcome(list(engine.generate(one)))
            assert got[:5] == expected[:5]
            assert cache.tokens <= 120


def test_preemption_under_a_small_kv_budget_gives_the_same_tokens(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    # The three prompts take 30, 39 and 36 tokens: all three fit at first, not to the end.
    engine = tiny_llama(tiny_card, tiny_model_dir, kv_cache_tokens=120)
    params = [request(prompt, temperature=1.0, seed=i, max_tokens=16) for i, prompt in
              enumerate(PROMPTS)]  # fmt: skip
    alone = solo_outcomes(engine, params)
    states = [engine.build_request(one, request_id=f"r{i}") for i, one in enumerate(params)]
    pieces = run_batch(engine, states, join_at=[0, 0, 0])
    assert engine.scheduler.preemptions > 0
    for index, expected in enumerate(alone):
        assert outcome(pieces[f"r{index}"]) == expected


def test_int4_batched_logits_stay_within_the_int4_tolerance(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir, weight_dtype="int4")
    params = [request(prompt, temperature=0.0, max_tokens=6) for prompt in PROMPTS]
    solo, forced, _pieces = solo_and_batched(engine, params, join_at=[0, 1, 1])
    assert max_difference(solo, forced) < INT4_TOLERANCE


def test_a_long_prompt_is_prefilled_in_chunks_while_a_stream_keeps_decoding(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    engine = tiny_llama(tiny_card, tiny_model_dir)
    stream = engine.build_request(request("Hi", temperature=0.0, max_tokens=200), None, "s")
    engine.scheduler.add(stream)
    while not stream.generated_ids:
        engine.step()
    long_request = engine.build_request(request("word " * 120, max_tokens=1), None, "long")
    prompt_tokens = len(long_request.prompt_ids)
    engine.scheduler.add(long_request)
    handle = RequestHandle("long", prompt_tokens, long_request)
    assert handle.prefill_progress is None  # not admitted yet
    steps, done = 0, 0
    while not long_request.generated_ids:
        before = len(stream.generated_ids)
        engine.step()
        steps += 1
        assert len(stream.generated_ids) == before + 1  # one token every step
        # The prompt's progress (`PrefillProgressChunk`): first one step without prompt
        # tokens (the stream's decode step measured alone), then the initial chunk (no prompt
        # token's cost measured yet), then a chunk as measured each step.
        progress = handle.prefill_progress
        assert progress is not None and progress[1] == prompt_tokens
        chunk = progress[0] - done
        if steps == 1:
            assert chunk == 0
        elif steps == 2:
            assert chunk == min(PREFILL_TOKENS_PER_STEP, prompt_tokens)
        else:
            assert 1 <= chunk <= PREFILL_TOKENS_PER_IDLE_STEP
        done = progress[0]
    assert done == prompt_tokens
    # The chunks were sized from this engine's measured steps (one decode row each).
    sizer = engine.scheduler.chunk_sizer
    assert isinstance(sizer, PrefillChunkSizer) and sizer.decode_seconds(1) is not None
    assert engine.cancel("s")


def _step_until_finished(engine: TorchEngine, request_id: str) -> None:
    for _ in range(200):
        for finished_id, output in engine.step():
            assert isinstance(output, GeneratedPiece)
            if finished_id == request_id and output.finish_reason is not None:
                return
    raise AssertionError(f"{request_id} did not finish within 200 steps")


def test_a_finished_requests_kv_enters_the_prefix_cache_after_its_last_piece(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    """The step that streams a request's last piece leaves its KV in the slot; the copy into
    the prefix cache (`store_finished`, or the next step) comes after, and a later request
    with the same conversation reuses it."""
    engine = tiny_llama(tiny_card, tiny_model_dir)
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is not None
    state = engine.build_request(request(PROMPTS[1], temperature=0.0, max_tokens=3), None, "a")
    scheduler.add(state)
    _step_until_finished(engine, "a")
    held = scheduler.kv_tokens()
    assert held == len(state.prompt_ids) + 2  # the last token's KV is never computed
    assert scheduler.prefix_cache.tokens == 0 and not engine.has_work
    engine.store_finished()
    assert scheduler.kv_tokens() == 0 and scheduler.prefix_cache.tokens == held
    engine.store_finished()  # nothing left: a no-op
    assert scheduler.prefix_cache.tokens == held
    again = list(engine.generate(request(PROMPTS[1], temperature=0.0, max_tokens=3)))
    usage = again[-1].usage
    assert usage is not None and usage.cached_tokens == len(state.prompt_ids) - 1


def test_a_finished_request_whose_slot_moves_before_the_copy_stores_its_own_kv(
    tiny_card: Any, tiny_model_dir: Path
) -> None:
    """Three requests in slots 0, 1, 2; the one in slot 2 finishes, then the one in slot 0
    is cancelled before the copy: slot 2's KV moves into slot 0, and the prefix cache gets
    the finished request's KV (as when it ran alone), not the cancelled one's."""
    engine = tiny_llama(tiny_card, tiny_model_dir)
    scheduler = engine.scheduler
    assert scheduler.prefix_cache is not None
    short = request(PROMPTS[2], temperature=0.0, max_tokens=2)
    solo = engine.build_request(short, None, "solo")
    scheduler.add(solo)
    _step_until_finished(engine, "solo")
    engine.store_finished()
    solo_tokens = solo.prompt_ids + solo.generated_ids[:-1]
    match = scheduler.prefix_cache.lookup([*solo_tokens, 0], limit=len(solo_tokens))
    assert match is not None and match.length == len(solo_tokens)
    expected = match.kv.clone()
    engine.clear_prefix_cache()
    for request_id, params in (
        ("long-a", request(PROMPTS[0], temperature=0.0, max_tokens=10)),
        ("long-b", request(PROMPTS[1], temperature=0.0, max_tokens=10)),
        ("short", short),
    ):
        scheduler.add(engine.build_request(params, None, request_id))
    _step_until_finished(engine, "short")
    assert engine.cancel("long-a")  # frees slot 0: slot 2 (the finished request) moves in
    engine.store_finished()
    match = scheduler.prefix_cache.lookup([*solo_tokens, 0], limit=len(solo_tokens))
    assert match is not None and match.length == len(solo_tokens)
    assert torch.allclose(match.kv, expected, atol=1e-5, rtol=0)
    while engine.has_work:
        engine.step()
    engine.store_finished()
    assert scheduler.kv_tokens() == 0
