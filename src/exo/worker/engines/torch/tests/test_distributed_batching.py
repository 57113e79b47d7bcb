"""Batched equals alone on a split instance: 2-rank pipeline and 2-rank tensor groups (gloo
over 127.0.0.1, spawned processes, a tiny random float32 model of each family: llama by
default, the others under `-m slow`) run 4 requests with different prompt lengths (one
prefilled in chunks), sampling settings with seeds, penalties, logprobs and a stop string,
submitted together, at staggered steps, and with one cancelled mid-way; each request's tokens
equal those it gets alone. Teacher forcing (each request fed its solo tokens inside the
batch) bounds the logits' difference from the solo run: `LOGIT_TOLERANCE`. Rank 1 is loaded
with fewer slots than rank 0 (and takes rank 0's at warm-up). Both modes run in one group
(one spawn, one load per mode)."""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.testing.rank_processes import run_rank_processes
from exo.testing.tiny_models import ARCHITECTURES, save_tiny_model
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S, make_shard

# Measured (tiny llama, float32, CPU, two runs): the teacher-forced batched logits differ from
# the solo run's by at most 3.0-3.6e-7 (pipeline) and 3.3-4.2e-7 (tensor): batched GEMMs over
# more rows and the all-reduce sum in other orders. The bound leaves ~200x room.
LOGIT_TOLERANCE = 1e-4
MAX_STEPS = 400
LONG_PROMPT = "Count the colours of the rainbow, slowly, one by one, then say why. " * 4

# (prompt, sampling fields): prompt lengths ~10 to ~80 tokens (the last > the 32-token
# prefill chunk); request 3's stop string is taken from its own solo text at run time.
SPECS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("Hi.", {"temperature": 0.0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3}),
    (
        "Name three colours.",
        {
            "temperature": 0.9,
            "seed": 5,
            "max_tokens": 12,
            "presence_penalty": 0.5,
            "frequency_penalty": 0.3,
        },
    ),
    (
        LONG_PROMPT,
        {"temperature": 0.8, "top_k": 20, "seed": 9, "max_tokens": 12, "repetition_penalty": 1.3},
    ),
    ("Why is the sky blue? Answer briefly.", {"temperature": 0.0, "max_tokens": 16}),
)
STOP_REQUEST = 3
CANCELLED_REQUEST = 1
CANCEL_AFTER_PIECES = 3


def params_for(index: int, stop: str | None) -> TextGenerationTaskParams:
    prompt, fields = SPECS[index]
    extra: dict[str, Any] = {"stop": (stop,)} if stop is not None and index == STOP_REQUEST else {}
    return TextGenerationTaskParams(
        model=ModelId("m"), messages=(ChatMessage(role="user", content=prompt),), **fields,
        **extra,
    )  # fmt: skip


class RecordingChooser:
    """Wraps a request's `TokenChooser`: keeps each step's raw logits and, when `forced`
    is given, returns those tokens instead of the sampled ones (teacher forcing)."""

    def __init__(self, inner: Any, forced: list[int] | None, log: list[torch.Tensor]) -> None:
        self._inner = inner
        self._forced = forced
        self._log = log

    @property
    def needs_logits(self) -> bool:
        return True  # it records them (a pipeline's last rank then sends them)

    def choose(self, logits: torch.Tensor) -> int:
        self._log.append(logits.detach().float().cpu().clone())
        token = int(self._inner.choose(logits))
        return token if self._forced is None else self._forced[len(self._log) - 1]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@dataclass
class Run:
    pieces: list[GeneratedPiece] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return [token for piece in self.pieces for token in piece.token_ids]

    @property
    def logprobs(self) -> list[float]:
        return [entry.logprob for piece in self.pieces for entry in piece.logprobs]

    @property
    def finish_reason(self) -> str | None:
        return self.pieces[-1].finish_reason if self.pieces else None


def drive(
    engine: TorchEngine,
    submit_at: dict[int, int],
    stop: str | None,
    forced: dict[int, list[int]] | None = None,
    cancel_after: tuple[int, int] | None = None,
) -> dict[int, Run]:
    """Submit request `i` before step `submit_at[i]`, cancel request `cancel_after[0]` once
    it streamed `cancel_after[1]` pieces, step until idle (at most `MAX_STEPS`)."""
    runs = {index: Run() for index in submit_at}
    build_request = engine.build_request

    def recorded_build_request(*args: Any, **kwargs: Any) -> Any:
        state = build_request(*args, **kwargs)
        index = int(state.request_id.removeprefix("r"))
        tokens = None if forced is None else forced[index]
        state.chooser = RecordingChooser(state.chooser, tokens, runs[index].logits)  # type: ignore[assignment]
        return state

    vars(engine)["build_request"] = recorded_build_request
    try:
        for step in range(MAX_STEPS):
            for index, at in submit_at.items():
                if at == step:
                    engine.submit(params_for(index, stop), request_id=f"r{index}")
            if cancel_after is not None and len(runs[cancel_after[0]].pieces) == cancel_after[1]:
                assert engine.cancel(f"r{cancel_after[0]}")
                cancel_after = None
            for request_id, output in engine.step():
                if isinstance(output, Exception):
                    raise output
                runs[int(request_id.removeprefix("r"))].pieces.append(output)
            if step >= max(submit_at.values()) and not engine.has_work:
                return runs
    finally:
        del vars(engine)["build_request"]
    raise AssertionError(f"not idle after {MAX_STEPS} steps")


@dataclass
class Outcome:
    """What rank 0 of one mode saw (all plain data, sent back over a queue)."""

    stop: str
    stop_reason: str | None
    solo: dict[int, list[int]]
    solo_logprobs: list[float]
    together: dict[int, list[int]]
    together_logprobs: list[float]
    staggered: dict[int, list[int]]
    cancelled: dict[int, list[int]]
    forced_max_difference: float
    forced_steps: int


def check_batching(engine: TorchEngine) -> Outcome:
    """Rank 0's runs: each request alone, then the batched variants."""
    everyone = range(len(SPECS))
    # Request 3's stop string: three characters from the middle of its text without one.
    free = drive(engine, {STOP_REQUEST: 0}, None)[STOP_REQUEST]
    text = "".join(piece.text for piece in free.pieces)
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert len(stop) == 3, text
    solo = {index: drive(engine, {index: 0}, stop)[index] for index in everyone}
    together = drive(engine, dict.fromkeys(everyone, 0), stop)
    staggered = drive(engine, {index: 2 * index for index in everyone}, stop)
    cancelled = drive(
        engine,
        dict.fromkeys(everyone, 0),
        stop,
        cancel_after=(CANCELLED_REQUEST, CANCEL_AFTER_PIECES),
    )
    forced = drive(
        engine, dict.fromkeys(everyone, 0), stop, forced={i: solo[i].tokens for i in everyone}
    )
    differences = [
        float((batched - alone).abs().max())
        for index in everyone
        for batched, alone in zip(forced[index].logits, solo[index].logits, strict=True)
    ]
    assert all(len(forced[i].logits) == len(solo[i].logits) for i in everyone)
    return Outcome(
        stop, solo[STOP_REQUEST].finish_reason,
        {i: run.tokens for i, run in solo.items()}, solo[0].logprobs,
        {i: run.tokens for i, run in together.items()}, together[0].logprobs,
        {i: run.tokens for i, run in staggered.items()},
        {i: run.tokens for i, run in cancelled.items()},
        max(differences), len(differences),
    )  # fmt: skip


def _rank_main(rank: int, world_size: int, port: int, results: Any, model_dir: str) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=60)
        for mode in ("pipeline", "tensor"):
            shard = make_shard(Path(model_dir), mode, rank, 2)
            # Each node may have its own --max-concurrent-requests: rank 1's 2 would not hold
            # the 4 requests rank 0 (8) runs at once; warm-up makes every rank take rank 0's.
            engine = load_engine(
                Path(model_dir), shard, weight_dtype="float32",
                max_concurrent_requests=8 if rank == 0 else 2,
            )  # fmt: skip
            engine.warmup()
            assert engine.max_concurrent_requests == 8
            if rank == 0:
                results.put(("outcome", mode, check_batching(engine)))
                engine.shutdown()
            else:
                engine.serve_forever()
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


# Llama in the default run; every other family under `-m slow` (one 2-rank group each).
FAMILY_PARAMS = [
    pytest.param(name, marks=() if name == "llama" else pytest.mark.slow, id=name)
    for name in ARCHITECTURES
]


@pytest.fixture(scope="module", params=FAMILY_PARAMS)
def outcomes(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    real_model_dir: Path,
) -> dict[str, Outcome]:
    architecture: str = request.param
    model_dir = save_tiny_model(
        tmp_path_factory.mktemp(f"tiny-{architecture}-batching"), architecture, real_model_dir,
        n_layers=4,
    )  # fmt: skip
    reports = run_rank_processes(_rank_main, (str(model_dir),), 2, GROUP_DEADLINE_S)
    return {key: value for kind, key, value in reports if kind == "outcome"}


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_batched_requests_equal_each_alone(outcomes: dict[str, Outcome], mode: str) -> None:
    outcome = outcomes[mode]
    assert outcome.stop_reason == "stop", outcome.stop  # the stop string took effect alone
    assert all(outcome.solo.values())
    assert outcome.together == outcome.solo
    assert outcome.staggered == outcome.solo
    assert len(outcome.together_logprobs) == len(outcome.solo_logprobs) > 0
    for batched, alone in zip(outcome.together_logprobs, outcome.solo_logprobs, strict=True):
        assert abs(batched - alone) < LOGIT_TOLERANCE


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_teacher_forced_logits_within_tolerance(outcomes: dict[str, Outcome], mode: str) -> None:
    outcome = outcomes[mode]
    assert outcome.forced_steps >= sum(len(tokens) for tokens in outcome.solo.values())
    print(f"{mode}: max |batched - solo| logit = {outcome.forced_max_difference:.3g}")
    assert outcome.forced_max_difference < LOGIT_TOLERANCE


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_cancelling_one_request_leaves_the_others_unchanged(
    outcomes: dict[str, Outcome], mode: str
) -> None:
    outcome = outcomes[mode]
    for index, tokens in outcome.cancelled.items():
        solo = outcome.solo[index]
        if index == CANCELLED_REQUEST:
            assert CANCEL_AFTER_PIECES <= len(tokens) < len(solo)
            assert tokens == solo[: len(tokens)]
        else:
            assert tokens == solo, index


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
