"""Sharded == unsharded for requests that need the logits on rank 0 (logprobs, penalties, a
logit bias, a JSON or JSON-schema constraint): a 2-rank pipeline (the last rank then sends
logits instead of a token) and a 2-rank tensor group give the single process's tokens and
logprobs."""

from __future__ import annotations

import math
import queue
import time
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as multiprocessing

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.shards import ShardMetadata
from exo.testing.ports import free_port
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.tests.test_distributed import (
    GROUP_DEADLINE_S,
    make_shard,
    request,
)

# Split and single runs compare token for token: float32 KV (`float32_kv`).
pytestmark = pytest.mark.usefixtures("float32_kv")

# A token the logit bias forces (an ordinary one of the tiny model's SmolLM2 vocabulary).
BIASED_TOKEN = 314
BIASED_REQUEST: dict[str, Any] = {
    "temperature": 0.0,
    "max_tokens": 6,
    "logit_bias": {BIASED_TOKEN: 100.0},
}

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
)

# One result per request: the tokens, and per token (id, logprob, top ids, top logprobs).
Outcome = tuple[list[int], list[tuple[int, float, list[int], list[float]]]]


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
    rank: int, world_size: int, port: int, model_dir: str, mode: str, results: Any
) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, world_size, "127.0.0.1", port, timeout_s=60)
        shard = make_shard(Path(model_dir), mode, rank, world_size)
        engine = load_engine(Path(model_dir), shard, weight_dtype="float32")
        engine.warmup()
        if rank == 0:
            results.put(("outcomes", rank, generate_all(engine)))
            engine.shutdown()
        else:
            engine.serve_forever()
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def run_group(model_dir: Path, mode: str, world_size: int = 2) -> list[Outcome]:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(
            target=_rank_main, args=(rank, world_size, port, str(model_dir), mode, results)
        )
        for rank in range(world_size)
    ]
    outcomes: list[Outcome] = []
    try:
        for process in processes:
            process.start()
        deadline = time.monotonic() + GROUP_DEADLINE_S
        done = 0
        while done < world_size:
            try:
                kind, rank, value = results.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                pytest.fail(f"the {world_size}-rank group did not finish in {GROUP_DEADLINE_S} s")
            if kind == "error":
                pytest.fail(f"rank {rank} failed:\n{value}")
            if kind == "outcomes":
                outcomes = value
            done += kind == "done"
    finally:
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
    return outcomes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-llama-features"), "llama", real_model_dir, n_layers=4
    )


@pytest.fixture(scope="module")
def single_process(tiny_dir: Path) -> list[Outcome]:
    card = card_from_local_directory(tiny_dir)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    return generate_all(load_engine(tiny_dir, shard, weight_dtype="float32"))


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


@pytest.mark.parametrize("mode", ["pipeline", "tensor"])
def test_two_ranks_equal_single_process_with_logits_features(
    tiny_dir: Path, single_process: list[Outcome], mode: str
) -> None:
    assert any(tokens for tokens, _logprobs in single_process)
    # The bias is visible: +100 makes its token the greedy choice at every step.
    biased_tokens, _ = single_process[REQUESTS.index(BIASED_REQUEST)]
    assert biased_tokens == [BIASED_TOKEN] * BIASED_REQUEST["max_tokens"]
    assert_same(run_group(tiny_dir, mode), single_process)


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
