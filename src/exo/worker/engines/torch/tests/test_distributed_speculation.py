"""Speculative decoding on split instances (issue 43): tensor, pipeline and expert x2 and x3
verify a draft's k + 1 positions in one step, with n-gram drafts (no model), scripted
drafts (the plain reply with mistakes at set places: every rejection path,
deterministically) and, on a pipeline x2, a draft model in rank 0's runner. Every case
(float32 weights and KV, gloo over 127.0.0.1, spawned processes): the group's greedy tokens
with drafts equal one process's plain decoding token for token, a seeded sampling
request's equal the group's plain ones (deterministic drafts: the same draws; on a
pipeline also one process's, and its n-gram and scripted draft rows come back from the
last rank as chosen tokens, 20 bytes a row with one logprob alternative, where they were
whole logits rows), with one request that does not draft batched beside the drafting
ones; and the logprobs equal the group's plain ones. A logprob comes from the
last rank's logits, which a wrong key or value on any rank (a rejected draft's position
kept, an accepted one lost when a slot moved) would move: so every rank's KV after
rejections is the KV of plain decoding. Rank 0's own KV is compared directly with plain
decoding's (the prefix cache's entries of the finished requests).

One group runs the default run's x2 jobs (models loaded one after another by both ranks, so
the processes start once: Llama and Qwen3-MoE, the issue's "splits for two families"),
another the slow ones, a third the x3 pipeline and tensor jobs (slow: the issue asks x2 of
the default run, and the group cost 82-92 s of it on the busy 2-core machine), expert x3
in a slow fourth. The pipeline's steps in flight beside a verified draft,
across slot moves, are covered in one process too
(`test_drafts_in_flight_beside_other_steps_keep_their_kv_across_slot_moves`).
"""

from __future__ import annotations

import os
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.testing.rank_processes import run_rank_processes
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.batch_attention import (
    BatchPlan,
    attention_layers,
    commit_lengths,
    forward_batch,
)
from exo.worker.engines.torch.batching.prefix_cache import PrefixCache
from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.engines.torch.batching.scheduler import BatchScheduler, StepLogits
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.batching.speculation import RemoteRow, Speculation
from exo.worker.engines.torch.decoding.speculative_drafts import NgramDraftSource
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.parallel.cache_ops import (
    CacheOpLog,
    RecordingSlotKVCache,
    replay_cache_ops,
)
from exo.worker.engines.torch.parallel.rank_steps import (
    MICRO_BATCH_MIN_ROWS,
    STEP,
    StepHeader,
    micro_batch_count,
)
from exo.worker.engines.torch.tests.speculative_builders import (
    DRAFT_NOISE,
    ScriptedDrafts,
    load,
    noisy_copy,
    request,
    run,
)
from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S, make_shard

# Text that repeats: a tiny random Llama's greedy reply falls into a cycle the n-gram source
# then copies (drafts accepted), and the prompt itself offers matches.
REPEATING = "one two three four five six. one two three four five six. one two three four five"
PROMPTS = (REPEATING, "Hi", REPEATING + " six. seven", "Count: one two three")
MAX_TOKENS = 24
JOIN_AT = [0, 1, 2, 2]
# The second request never drafts: plain rows batched beside draft rows.
PLAIN_INDEX = 1
# The last one samples (seeded): a pipeline's last rank verifies its n-gram and scripted
# drafts with its keys (`last_rank_sampling.py`), as a greedy request's; its
# draft model's drafts come back whole.
SAMPLED_INDEX = 3
SAMPLED: dict[str, Any] = {"temperature": 0.9, "top_p": 0.95, "seed": 7}
# |group with drafts - group plain| logprobs: the same rows' logits, computed by the same
# kernels (a draft row is computed as the decode row it stands for), as
# test_speculative_kernels.py's.
LOGPROB_TOLERANCE = 5e-4


def _params(speculative: bool) -> list[Any]:
    greedy: dict[str, Any] = {
        "temperature": 0.0, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 1,
    }  # fmt: skip
    return [
        request(
            prompt,
            speculative=speculative and index != PLAIN_INDEX,
            **{**greedy, **(SAMPLED if index == SAMPLED_INDEX else {})},
        )
        for index, prompt in enumerate(PROMPTS)
    ]


def _run_requests(engine: TorchEngine, speculative: bool, label: str) -> dict[str, Any]:
    """The prompts, joined at `JOIN_AT`: tokens, logprobs and rank 0's KV of each finished
    request (the prefix cache's entry of its text but the last token), and the logit rows
    a pipeline's last rank answered whole and with a chosen token (of these, the rows
    checked against a draft token, and their float32 values)."""
    engine.clear_prefix_cache()
    traffic = engine.group.traffic if engine.group is not None else None
    counted = ("full_rows", "lean_rows", "lean_draft_rows", "lean_draft_values")
    before = {name: getattr(traffic, name) if traffic is not None else 0 for name in counted}
    states = [
        engine.build_request(one, None, f"{label}-{index}")
        for index, one in enumerate(_params(speculative))
    ]
    pieces = run(engine, states, JOIN_AT)
    texts = [state.prompt_ids + state.generated_ids for state in states]
    cache = engine.scheduler.prefix_cache
    assert cache is not None
    kv: list[torch.Tensor] = []
    for text in texts:
        hit = cache.lookup(text, limit=len(text))
        assert hit is not None and hit.length == len(text) - 1, label
        kv.append(hit.kv.clone())
    return {
        "tokens": texts,
        "logprobs": [_logprobs(pieces[state.request_id]) for state in states],
        "kv": kv,
        **{
            name: getattr(traffic, name) - before[name] if traffic is not None else 0
            for name in counted
        },
    }


def _logprobs(pieces: list[GeneratedPiece]) -> list[float]:
    return [entry.logprob for piece in pieces for entry in piece.logprobs]


@dataclass(frozen=True)
class Job:
    """One model split `mode` x2, generated with plainly then with each draft source."""

    name: str
    model_dir: str
    mode: str  # "pipeline" | "tensor" | "expert"
    sources: tuple[str, ...]  # "ngram" | "scripted" | "draft_model"
    draft_dir: str | None = None


def _rank_main(rank: int, world_size: int, port: int, results: Any, jobs: list[Job]) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    os.environ["EXO_KV_CACHE_DTYPE"] = "float32"
    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        for job in jobs:
            shard = make_shard(Path(job.model_dir), job.mode, rank, world_size)
            draft = Path(job.draft_dir) if job.draft_dir is not None else None
            engine = load_engine(
                Path(job.model_dir), shard, weight_dtype="float32", max_concurrent_requests=4,
                draft_model=draft,  # rank 1 leaves it out: rank 0 drafts
            )  # fmt: skip
            assert (engine.draft_source is not None) == (rank == 0 and draft is not None)
            engine.warmup()
            if rank == 0:
                results.put(("outcome", job.name, _rank_zero_runs(engine, job)))
                engine.shutdown()
            else:
                engine.serve_forever()
        results.put(("done", "", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))


def _rank_zero_runs(engine: TorchEngine, job: Job) -> dict[str, Any]:
    """Plain, then with each of the job's draft sources (counters per source)."""
    engine.eos_token_ids = frozenset({-1})  # random weights: stop by length
    speculation = engine.scheduler.speculation
    assert speculation is not None
    speculation.step_cost = lambda rows: None  # draft lengths never follow the clock
    loaded = speculation.source  # the draft model where the job has one, else n-gram
    outcome: dict[str, Any] = {"plain": _run_requests(engine, False, "plain")}
    for source in job.sources:
        if source == "scripted":
            reference = {
                f"{source}-{index}": tokens
                for index, tokens in enumerate(outcome["plain"]["tokens"])
            }
            speculation.source = ScriptedDrafts(reference, engine.vocab_size)
        elif source == "draft_model":
            assert loaded is engine.draft_source is not None
            speculation.source = loaded
        else:
            assert isinstance(loaded, NgramDraftSource)
            speculation.source = loaded
        before = dataclass_values(speculation.counters)
        outcome[source] = _run_requests(engine, True, source)
        after = dataclass_values(speculation.counters)
        outcome[source]["counters"] = {key: after[key] - before[key] for key in after}
    return outcome


def dataclass_values(counters: Any) -> dict[str, int]:
    return {name: int(getattr(counters, name)) for name in counters.__slots__}


def _single_plain(model_dir: Path) -> dict[str, Any]:
    """One process's plain decoding of the same requests (warmed up as the ranks are)."""
    engine = load(model_dir)
    engine.warmup()
    engine.eos_token_ids = frozenset({-1})
    return _run_requests(engine, False, "single")


@dataclass
class GroupRun:
    jobs: dict[str, Job] = field(default_factory=dict)
    outcomes: dict[str, dict[str, Any]] = field(default_factory=dict)
    single: dict[str, dict[str, Any]] = field(default_factory=dict)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("split-speculation")
    llama = save_tiny_model(
        root / "llama", "llama", real_model_dir, n_layers=2, tie_word_embeddings=False
    )
    # Seed 0's reply is one token repeated (n-gram drafts accepted); seed 1's varies (the
    # scripted drafts' rejections matter).
    moe_repeating = save_tiny_model(root / "moe0", "qwen3_moe", real_model_dir, n_layers=2)
    moe_varied = save_tiny_model(
        root / "moe1", "qwen3_moe", real_model_dir, n_layers=2, seed=1,
        tie_word_embeddings=False,
    )  # fmt: skip
    # 3 layers, and heads, KV heads and MLP width divisible by 3: pipeline and tensor x3.
    llama_three = save_tiny_model(
        root / "llama3", "llama", real_model_dir, n_layers=3, tie_word_embeddings=False,
        hidden_size=96, num_attention_heads=6, num_key_value_heads=3, intermediate_size=192,
    )  # fmt: skip
    return {
        "llama": str(llama),
        "llama-three": str(llama_three),
        "llama-draft": str(noisy_copy(llama, root / "llama-draft", DRAFT_NOISE)),
        "moe-repeating": str(moe_repeating),
        "moe-varied": str(moe_varied),
    }


def _group_run(jobs: list[Job], world_size: int = 2) -> GroupRun:
    """One process's plain decoding of each job's model, then the jobs on a group of
    `world_size` ranks."""
    result = GroupRun(jobs={job.name: job for job in jobs})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("EXO_KV_CACHE_DTYPE", "float32")
        for model in {job.model_dir for job in jobs}:
            result.single[model] = _single_plain(Path(model))
    for kind, name, value in run_rank_processes(_rank_main, (jobs,), world_size, GROUP_DEADLINE_S):
        if kind == "outcome":
            result.outcomes[name] = value
    return result


@pytest.fixture(scope="module")
def group_run(models: dict[str, str]) -> GroupRun:
    """The default run's jobs: one per split kind, n-gram drafts (scripted ones too on the
    pipeline, whose verification is new: rejections at every place)."""
    return _group_run(
        [
            Job("tensor", models["llama"], "tensor", ("ngram",)),
            Job("pipeline", models["llama"], "pipeline", ("ngram", "scripted")),
            Job("expert", models["moe-repeating"], "expert", ("ngram",)),
            # A second family's pipeline and tensor x2 (issue 43: the splits for two
            # families): Qwen3-MoE's per-head q/k norms and routed experts.
            Job("pipeline-moe", models["moe-repeating"], "pipeline", ("ngram",)),
            Job("tensor-moe", models["moe-repeating"], "tensor", ("ngram",)),
        ]
    )


@pytest.fixture(scope="module")
def slow_group_run(models: dict[str, str]) -> GroupRun:
    draft = models["llama-draft"]
    return _group_run(
        [
            Job("tensor-scripted", models["llama"], "tensor", ("scripted",)),
            Job("pipeline-draft", models["llama"], "pipeline", ("draft_model",), draft),
            Job("expert-scripted", models["moe-varied"], "expert", ("scripted",)),
        ]
    )


@pytest.fixture(scope="module")
def three_rank_run(models: dict[str, str]) -> GroupRun:
    """Pipeline and tensor x3 with n-gram drafts (one 3-rank group)."""
    return _group_run(
        [
            Job("pipeline-x3", models["llama-three"], "pipeline", ("ngram",)),
            Job("tensor-x3", models["llama-three"], "tensor", ("ngram",)),
        ],
        world_size=3,
    )


@pytest.fixture(scope="module")
def slow_three_rank_run(models: dict[str, str]) -> GroupRun:
    """Expert x3 with n-gram drafts (the MoE's 4 experts over 3 ranks: 1, 1, 2)."""
    return _group_run(
        [Job("expert-x3", models["moe-repeating"], "expert", ("ngram",))], world_size=3
    )


def _check(run: GroupRun, name: str) -> None:
    job = run.jobs[name]
    outcome = run.outcomes[name]
    single = run.single[job.model_dir]
    plain = outcome["plain"]
    # Tensor and expert ranks sum in another order than one process: a seeded draw may
    # move (`test_distributed._greedy`); greedy tokens may not. A pipeline computes as one.
    compared = [
        index for index in range(len(PROMPTS)) if index != SAMPLED_INDEX or job.mode == "pipeline"
    ]
    for index in compared:
        assert plain["tokens"][index] == single["tokens"][index], f"{name}: plain {index}"
    for source in job.sources:
        speculated = outcome[source]
        # A draft model's drafts of a sampling request are drawn: its output follows the
        # target's distribution (test_speculative_acceptance.py's chi-square), not plain
        # decoding's draws.
        same = [
            index
            for index in range(len(PROMPTS))
            if index != SAMPLED_INDEX or source != "draft_model"
        ]
        for index in same:
            assert speculated["tokens"][index] == plain["tokens"][index], (name, source, index)
            got, wanted = speculated["logprobs"][index], plain["logprobs"][index]
            assert len(got) == len(wanted) == MAX_TOKENS
            torch.testing.assert_close(
                torch.tensor(got), torch.tensor(wanted), atol=LOGPROB_TOLERANCE, rtol=0
            )
            torch.testing.assert_close(
                speculated["kv"][index], plain["kv"][index], atol=1e-5, rtol=1e-5
            )
        counters = speculated["counters"]
        assert counters["accepted_tokens"] > 0, (name, source, counters)
        # More than one token per decoding request and step, on average.
        assert counters["decode_tokens"] > counters["decode_rounds"], (name, source, counters)
        if source == "scripted":  # rejections at the first and a later draft token
            assert counters["accepted_tokens"] < counters["drafted_tokens"]
            assert counters["verify_rounds"] >= 6
        if job.mode == "pipeline":
            assert plain["full_rows"] == 0
            if source == "draft_model":  # the sampling request's drafts came back whole
                assert speculated["full_rows"] > 0
            else:  # every request's draft rows came back as chosen tokens (and logprobs)
                assert speculated["full_rows"] == 0 < speculated["lean_draft_rows"]
                sent_back = 4 * speculated["lean_draft_values"] / speculated["lean_draft_rows"]
                assert sent_back == 4 * (3 + 2 * 1) < 1024  # bytes per draft row: top_logprobs 1


def test_tensor_split_speculates_with_ngram_drafts_as_plain_decoding(group_run: GroupRun) -> None:
    _check(group_run, "tensor")


def test_pipeline_split_verifies_drafts_in_one_step_as_plain_decoding(
    group_run: GroupRun,
) -> None:
    _check(group_run, "pipeline")


def test_expert_split_speculates_with_ngram_drafts_as_plain_decoding(group_run: GroupRun) -> None:
    _check(group_run, "expert")


@pytest.mark.parametrize("name", ["pipeline-moe", "tensor-moe"])
def test_a_second_familys_splits_speculate_with_ngram_drafts_as_plain_decoding(
    group_run: GroupRun, name: str
) -> None:
    _check(group_run, name)


@pytest.mark.slow  # a second 2-rank group: about 30 s on a busy 2-core machine
@pytest.mark.parametrize("name", ["tensor-scripted", "pipeline-draft", "expert-scripted"])
def test_splits_verify_scripted_and_draft_model_drafts_as_plain_decoding(
    slow_group_run: GroupRun, name: str
) -> None:
    _check(slow_group_run, name)


# One 3-rank group for the two (with expert x3 as a third job: 23 s on the quiet 2-core
# machine, 74 s while other work ran; 2026-12-06). Slow: 82-92 s of the default run on the
# busy machine (2026-12-07), where the issue asks for x2 splits only.
@pytest.mark.slow
@pytest.mark.parametrize("name", ["pipeline-x3", "tensor-x3"])
def test_three_rank_splits_speculate_with_ngram_drafts_as_plain_decoding(
    three_rank_run: GroupRun, name: str
) -> None:
    _check(three_rank_run, name)


@pytest.mark.slow  # a second 3-rank group
def test_three_rank_expert_split_speculates_with_ngram_drafts_as_plain_decoding(
    slow_three_rank_run: GroupRun,
) -> None:
    _check(slow_three_rank_run, "expert-x3")


# --- steps in flight beside a draft, one process ------------------------------------------


def _deferred_scheduler(engine: TorchEngine, source: Any) -> BatchScheduler:
    """The engine's model under a scheduler that launches its steps (their forward pass
    runs at once, their logits are taken a step later, as a pipeline's rank 0 sees them)
    with two in flight, and speculates with `source`."""
    model = engine.model
    scheduler = engine.scheduler  # the single-rank one: its cache geometry and windows
    cache = scheduler._cache
    fresh = SlotKVCache(
        len(cache.keys), int(cache.keys[0].shape[1]), int(cache.keys[0].shape[3]),
        cache.keys[0].dtype, cache.keys[0].device, cache.slots, cache.latent_values,
        cache.windows,
    )  # fmt: skip
    launched_rows: list[list[RemoteRow | None]] = []

    def launch(
        model: Any,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor,
        requests: list[RemoteRow | None],
    ) -> Any:
        launched_rows.append(requests)
        logits = forward_batch(model, plan, input_ids, position_ids, logit_rows)
        rows: StepLogits = list(logits)
        return lambda: rows

    deferred = BatchScheduler(
        model, fresh, cache.windows, attention_layers(model), engine.kv_cache_tokens,
        PrefixCache(engine.kv_cache_tokens), engine.device, launch=launch, max_in_flight=2,
        speculation=Speculation(SpeculationSettings(default=False), source),
    )  # fmt: skip
    deferred.launched_rows = launched_rows  # type: ignore[attr-defined]
    return deferred


def test_drafts_in_flight_beside_other_steps_keep_their_kv_across_slot_moves(
    tiny_model_dir: Path, float32_kv: None
) -> None:
    engine = load(tiny_model_dir)
    # The first two finish while the third has a draft in flight: its slot moves.
    lengths = (8, 8, 24)
    params = [
        request(prompt, temperature=0.0, max_tokens=length, logprobs=True, speculative=True)
        for prompt, length in zip(PROMPTS[:3], lengths, strict=True)
    ]
    params[1] = params[1].model_copy(update=SAMPLED)
    reference: dict[str, list[int]] = {}
    plain_logprobs: dict[str, list[float]] = {}
    for index, one in enumerate(params):
        engine.clear_prefix_cache()
        state = engine.build_request(one.model_copy(update={"speculative": False}), None, "p")
        pieces = run(engine, [state], [0])
        reference[f"r{index}"] = state.prompt_ids + state.generated_ids
        plain_logprobs[f"r{index}"] = _logprobs(pieces["p"])
    drafts = ScriptedDrafts(reference, engine.vocab_size)
    scheduler = engine._scheduler = _deferred_scheduler(engine, drafts)
    cache = scheduler._cache
    free = cache.free
    moved_in_flight: list[int] = []

    def watched_free(slot: int) -> int | None:
        last = cache.occupied - 1
        for launched in scheduler._in_flight:
            for running, drafted in zip(launched.sampled, launched.drafts, strict=True):
                if slot != last and running.slot == last and drafted.tokens:
                    moved_in_flight.append(last)
        return free(slot)

    cache.free = watched_free  # type: ignore[method-assign]
    states = [engine.build_request(one, None, f"r{index}") for index, one in enumerate(params)]
    pieces = run(engine, states, [0, 0, 0])
    assert moved_in_flight  # a slot moved while its draft was in flight
    for index, state in enumerate(states):
        assert state.prompt_ids + state.generated_ids == reference[f"r{index}"], index
        torch.testing.assert_close(
            torch.tensor(_logprobs(pieces[state.request_id])),
            torch.tensor(plain_logprobs[f"r{index}"]),
            atol=LOGPROB_TOLERANCE, rtol=0,
        )  # fmt: skip
    speculation = engine._scheduler.speculation
    assert speculation is not None
    counters = speculation.counters
    assert 0 < counters.accepted_tokens < counters.drafted_tokens
    # Launched steps are timed for the automatic switch (from launch to logits).
    assert speculation.auto_switch.step_seconds(1) is not None
    launched = engine._scheduler.launched_rows  # type: ignore[attr-defined]
    # Every draft row was launched to be chosen by the other rank, the sampling request's
    # (scripted drafts: deterministic) with its next keys in row order.
    drafted: set[str] = set()
    for step in launched:
        assert all(row is not None for row in step)
        groups: dict[str, list[RemoteRow]] = {}
        for row in step:
            groups.setdefault(row.state.request_id, []).append(row)
        for request_id, group in groups.items():
            assert [row.ahead for row in group] == list(range(len(group)))
            assert [row.draft_token >= 0 for row in group[:-1]] == [True] * (len(group) - 1)
            assert group[-1].draft_token == -1
            if len(group) > 1:
                drafted.add(request_id)
    assert {"r0", "r1"} <= drafted  # greedy and sampling


def test_a_slot_moved_before_its_draft_is_verified_keeps_the_draft_positions() -> None:
    shape = (1, 1, 2)  # layers, kv heads, head dim
    recording = RecordingSlotKVCache(
        *shape, torch.float32, torch.device("cpu"), 4, log=CacheOpLog()
    )
    replica = SlotKVCache(*shape, torch.float32, torch.device("cpu"), 4)
    for _ in range(2):
        recording.allocate()
    replay_cache_ops(replica, recording.log.take())
    # A step fed slot 1's position 3 and two draft positions (4, 5), on every rank.
    slots, positions = [1, 1, 1], [5, 4, 3]
    for cache in (recording, replica):
        cache.keys[0][1, :, :6] = 7.0
        commit_lengths(BatchPlan(cache, [None], slots, positions, [], {}))
        assert cache.reached[1] == 4  # the draft moves no trim before it is verified
    recording.free(0)  # another request leaves while the draft is in flight: 1 moves to 0
    recording.commit_verified(0, 6)  # both drafts accepted
    replay_cache_ops(replica, recording.log.take())
    for cache in (recording, replica):
        assert cache.lengths[0] == 6 and cache.reached[0] == 6
        assert torch.equal(cache.keys[0][0, 0, :6, 0], torch.full((6,), 7.0))
    recording.allocate()
    replay_cache_ops(replica, recording.log.take())
    # Rejected: the slot holds the fed position only, as if the draft never was.
    for cache in (recording, replica):
        cache.keys[0][1, :, :3] = 1.0
        commit_lengths(BatchPlan(cache, [None], slots, positions, [], {}))
    recording.commit_verified(1, 4)
    replay_cache_ops(replica, recording.log.take())
    assert recording.lengths == replica.lengths and recording.lengths[1] == 4


def test_a_step_with_a_drafts_rows_is_never_split_into_micro_batches() -> None:
    rows = MICRO_BATCH_MIN_ROWS
    slots = (0,) * 3 + tuple(range(1, rows - 2))  # slot 0: a fed token and two drafts
    positions = (12, 11, 10) + (5,) * (rows - 3)
    step = StepHeader(STEP, (), slots, positions, (), (1,) * rows, positions, (0, 1, 2))
    assert micro_batch_count(step, 2) == 1
    plain = StepHeader(STEP, (), tuple(range(rows)), (5,) * rows, (), (1,) * rows, (5,) * rows)
    assert micro_batch_count(plain, 2) == 2


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
