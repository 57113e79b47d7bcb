"""Sharded == unsharded for requests beyond plain sampling (logprobs, penalties, a logit bias,
a JSON or JSON-schema constraint, forced tokens to continue after) and for a conversation's
second turn served from the prefix cache: a 2-rank pipeline and a 2-rank tensor group (gloo
over 127.0.0.1, spawned processes, a tiny random float32 llama) give the single process's
tokens, logprobs and cached token counts. On the pipeline the last rank chooses the tokens
of the requests without penalties, bias or constraint (with their logprobs when asked) and
sends the others' logits (`parallel/last_rank_sampling.py`): the rows it answered each way
are counted."""

from __future__ import annotations

import json
import math
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.shards import ShardMetadata
from exo.testing.rank_processes import run_rank_processes
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.parallel.last_rank_sampling import PipelineTraffic
from exo.worker.engines.torch.tests.test_distributed import (
    GROUP_DEADLINE_S,
    make_shard,
    request,
)
from exo.worker.engines.torch.tests.test_distributed_prefix import Turn, conversation

# Split and single runs compare token for token: float32 KV (`float32_kv`).
pytestmark = pytest.mark.usefixtures("float32_kv")

# A token the logit bias forces (an ordinary one of the tiny model's SmolLM2 vocabulary).
BIASED_TOKEN = 314
BIASED_REQUEST: dict[str, Any] = {
    "temperature": 0.0,
    "max_tokens": 6,
    "logit_bias": {BIASED_TOKEN: 100.0},
}

# Tokens a continued request already generated (ordinary ones of the SmolLM2 vocabulary).
FORCED = (314, 2000, 42)

REQUESTS: tuple[dict[str, Any], ...] = (
    {"temperature": 0.0, "max_tokens": 10, "logprobs": True, "top_logprobs": 3},
    {"temperature": 0.9, "seed": 5, "max_tokens": 10, "logprobs": True, "presence_penalty": 1.0},
    {"temperature": 0.0, "max_tokens": 10, "repetition_penalty": 1.3},
    {"temperature": 0.0, "max_tokens": 12, "response_format": "json_object"},
    BIASED_REQUEST,
    {
        "temperature": 0.0,
        "max_tokens": 16,
        "response_format": "json_schema",
        "json_schema": {"type": "object", "properties": {"a": {"type": "integer"}}},
    },
    {"temperature": 0.0, "max_tokens": 10},  # the fast path again after the others
    # Continued after tokens streamed elsewhere (mid-stream failover): prefilled over the
    # ranks after the prompt, the seeded draw and the penalties advanced over them.
    {"temperature": 0.9, "seed": 5, "max_tokens": 10, "forced_token_ids": FORCED},
    {"temperature": 0.0, "max_tokens": 10, "repetition_penalty": 1.3, "forced_token_ids": FORCED},
)

# One result per request: the tokens, and per token (id, logprob, top ids, top logprobs).
Outcome = tuple[list[int], list[tuple[int, float, list[int], list[float]]]]
# A group's (or the single process's): every request's outcome, the conversation's turns
# (`test_distributed_prefix.conversation`), and rank 0's pipeline traffic.
GroupOutcome = tuple[list[Outcome], list[Turn], PipelineTraffic | None]


def generate_all(engine: TorchEngine) -> list[Outcome]:
    outcomes: list[Outcome] = []
    for fields in REQUESTS:
        pieces = list(engine.generate(request(**fields)))
        tokens = [token for piece in pieces for token in piece.token_ids]
        logprobs = [
            (
                entry.token_id,
                entry.logprob,
                [top.token_id for top in entry.top_logprobs],
                [top.logprob for top in entry.top_logprobs],
            )
            for piece in pieces
            for entry in piece.logprobs
        ]
        outcomes.append((tokens, logprobs))
    return outcomes


def _rank_main(
    rank: int, world_size: int, port: int, results: Any, model_dir: str, mode: str
) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        shard = make_shard(Path(model_dir), mode, rank, world_size)
        engine = load_engine(Path(model_dir), shard, weight_dtype="float32")
        engine.warmup()
        if rank == 0:
            outcomes, turns = generate_all(engine), conversation(engine)
            traffic = engine.group.traffic if engine.group is not None else None
            results.put(("outcomes", rank, (outcomes, turns, traffic)))
            engine.shutdown()
        else:
            engine.serve_forever()
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def run_group(model_dir: Path, mode: str, world_size: int = 2) -> GroupOutcome:
    reports = run_rank_processes(_rank_main, (str(model_dir), mode), world_size, GROUP_DEADLINE_S)
    [outcomes] = [value for kind, _rank, value in reports if kind == "outcomes"]
    return outcomes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-features"), "llama", real_model_dir, n_layers=4
    )


@pytest.fixture(scope="module")
def single_process(tiny_dir: Path) -> GroupOutcome:
    card = card_from_local_directory(tiny_dir)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    engine = load_engine(tiny_dir, shard, weight_dtype="float32")
    return generate_all(engine), conversation(engine), None


@pytest.fixture(scope="module", params=["pipeline", "tensor"])
def sharded(request: pytest.FixtureRequest, tiny_dir: Path) -> tuple[str, GroupOutcome]:
    """One 2-rank group per mode, shared by the tests below."""
    return request.param, run_group(tiny_dir, request.param)


def assert_same(sharded: list[Outcome], single: list[Outcome]) -> None:
    assert len(sharded) == len(single) == len(REQUESTS)
    for (tokens, logprobs), (expected_tokens, expected_logprobs), fields in zip(
        sharded, single, REQUESTS, strict=True
    ):
        assert tokens == expected_tokens, fields
        assert (
            len(logprobs) == len(expected_logprobs) == (len(tokens) if "logprobs" in fields else 0)
        )
        for (token, value, top, top_values), (e_token, e_value, e_top, e_top_values) in zip(
            logprobs, expected_logprobs, strict=True
        ):
            assert (token, top) == (e_token, e_top)
            # Tensor parallel sums partial products in another order: equal to ~1e-6.
            assert math.isclose(value, e_value, abs_tol=1e-4)
            for top_value, e_top_value in zip(top_values, e_top_values, strict=True):
                assert math.isclose(top_value, e_top_value, abs_tol=1e-4)


def test_two_ranks_equal_single_process_with_logits_features(
    sharded: tuple[str, GroupOutcome], single_process: GroupOutcome, tiny_dir: Path
) -> None:
    single = single_process[0]
    assert any(tokens for tokens, _logprobs in single)
    # The bias is visible: +100 makes its token the greedy choice at every step.
    biased_tokens, _ = single[REQUESTS.index(BIASED_REQUEST)]
    assert biased_tokens == [BIASED_TOKEN] * BIASED_REQUEST["max_tokens"]
    mode, (outcomes, _turns, traffic) = sharded
    assert_same(outcomes, single)
    if mode != "pipeline":
        return
    # The last rank sent the logits of the requests with penalties, a bias or a constraint
    # only; for the others one token (and its logprobs, for the first request's 3 top).
    assert traffic is not None and traffic.lean_rows > 0 and traffic.full_rows > 0
    vocab_size = json.loads((tiny_dir / "config.json").read_text())["vocab_size"]
    full_values = traffic.full_rows * vocab_size
    assert traffic.lean_rows <= traffic.values - full_values <= (3 + 2 * 3) * traffic.lean_rows


def test_two_ranks_reuse_a_cached_prefix_like_the_single_process(
    sharded: tuple[str, GroupOutcome], single_process: GroupOutcome
) -> None:
    """The second turn of a conversation hits the first turn's cached prefix (every rank
    copies its part of the same entry), with the single process's cached count and the
    cold answer's tokens."""
    single = single_process[1]
    (_, first_cached), (warm_tokens, warm_cached), (cold_tokens, cold_cached) = single
    assert first_cached == 0 and cold_cached == 0
    assert warm_cached > 64  # the first turn's long prompt, from the cache
    assert warm_tokens == cold_tokens
    mode, (_outcomes, turns, _traffic) = sharded
    assert turns == single, mode


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
