"""Embedding work run in pieces (`EmbeddingWork.run_piece`), as the runner runs it between
decode steps, against the same inputs run whole (`embed`, pieces of no bound), float32,
through the engine's real loading path on tiny random-weight checkpoints: groups of short
inputs within the budget, and an input longer than the budget prefilled chunk by chunk
over its own all-layer scratch cache (Gemma 3's sliding window of 8 tokens cut by the
chunks); rerank scores alike. A dropped input's scratch cache is freed at once, also when
the runner's job cancels its request. The comparisons hold the scratch cache in float32
(`float32_kv`); the default bfloat16 one is checked on its own bound, and an input whose
scratch cache would not fit the memory free is refused before it starts."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.chunks import EmbeddingChunk
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId, TaskId
from exo.shared.types.embeddings import EmbeddingTaskParams
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import Embedding
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV
from exo.worker.engines.torch.embedding.backend import (
    SCRATCH_MEMORY_MARGIN_BYTES,
    ScratchMemoryError,
)
from exo.worker.engines.torch.embedding.decoder import DecoderEmbeddingBackend, DecoderWork
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.model.direct_forward import LEAN_ENV
from exo.worker.runner.embedding_batch import EmbeddingJob

# Chunked against whole inputs in float32 (a chunk's keys and values kept as computed).
pytestmark = pytest.mark.usefixtures("float32_kv")

# Short ragged inputs and two longer than every budget below (token ids: exact lengths).
INPUTS = [
    [17],
    [5, 9, 300, 41, 77, 12, 8],
    [(7 * index) % 900 + 3 for index in range(70)],
    list(range(100, 140)),
    [7, 7, 7],
    [(11 * index) % 800 + 5 for index in range(45)],
]


def _backend(directory: Path, pooling: str, capabilities: tuple[str, ...] = ("embedding",)) -> Any:
    card = card_from_local_directory(directory).model_copy(
        update={"capabilities": capabilities, "embedding_pooling": pooling}
    )
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    return TorchEngine.load(directory, shard, weight_dtype="float32").embedding_backend()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", real_model_dir, 2)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """Gemma 3: sliding-window layers (a window of 8 tokens, cut by every chunk)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-gemma3"), "gemma3", real_model_dir, 2)


def _in_pieces(work: DecoderWork, budget: int) -> tuple[torch.Tensor, list[int]]:
    """The work's result and each piece's tokens."""
    pieces: list[int] = []
    for _ in range(1000):
        if work.done:
            break
        pieces.append(work.run_piece(budget))
    assert work.done
    return work.result(), pieces


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min())


# Gemma 3 (sliding-window layers) marked slow: Qwen3 is the default run's decoder family.
@pytest.mark.parametrize(
    ("family", "pooling"),
    [("qwen3", "last"), ("qwen3", "mean"), pytest.param("gemma3", "mean", marks=pytest.mark.slow)],
)
@pytest.mark.parametrize("budget", [6, 16])
def test_pieces_equal_the_inputs_run_whole(
    request: pytest.FixtureRequest, family: str, pooling: str, budget: int
) -> None:
    """Within 1e-6 cosine (and 1e-5 per value), not bit for bit: a chunk after the first
    attends in two calls merged by their log-sum-exps, and the matmuls run over other row
    counts, so sums are ordered differently."""
    backend: DecoderEmbeddingBackend = _backend(request.getfixturevalue(f"{family}_dir"), pooling)
    assert backend.runs_exo_forward  # the lean step: long inputs are chunked
    whole = backend.embed(INPUTS)
    result, pieces = _in_pieces(backend.start_embedding(INPUTS), budget)
    assert max(pieces) <= budget and sum(pieces) == sum(len(ids) for ids in INPUTS)
    # The long inputs were chunked: more pieces than groups of whole inputs would need.
    assert len(pieces) >= -(-70 // budget) + -(-45 // budget)
    assert _cosine(result, whole) > 1 - 1e-6
    torch.testing.assert_close(result, whole, atol=1e-5, rtol=1e-5)
    # Different inputs differ: the agreement is not one of a degenerate model.
    assert _cosine(whole[2:3], whole[5:6]) < 0.999


def test_rerank_pieces_equal_the_documents_scored_whole(qwen3_dir: Path) -> None:
    backend = _backend(qwen3_dir, "last", ("rerank",))
    pairs = [("What is the capital of China?", "Beijing " * count) for count in (1, 30, 4)]
    whole = backend.score_pairs(pairs)
    work = backend.start_scoring(pairs)
    assert whole is not None and work is not None
    scores, pieces = _in_pieces(work, 16)
    assert len(pieces) > len(pairs)  # every prompt (instructions included) was chunked
    torch.testing.assert_close(scores, whole, atol=1e-6, rtol=0)


def test_a_dropped_input_frees_its_scratch_cache_and_the_rest_still_finish(
    qwen3_dir: Path,
) -> None:
    backend = _backend(qwen3_dir, "mean")
    whole = backend.embed(INPUTS)
    work = backend.start_embedding(INPUTS)
    assert work.run_piece(8) == 8  # the first chunk of the 70-token input (row 2)
    chunked = work._chunked
    assert chunked is not None and chunked[0] == 2
    cache = weakref.ref(chunked[1]._cache)
    del chunked
    work.drop([2])
    gc.collect()
    assert cache() is None  # nothing holds its keys and values any more
    result, pieces = _in_pieces(work, 8)
    assert sum(pieces) == sum(len(ids) for ids in INPUTS) - 70
    kept = [0, 1, 3, 4, 5]
    assert _cosine(result[kept], whole[kept]) > 1 - 1e-6


def test_a_cancelled_request_frees_its_chunked_input_and_the_job_answers_the_rest(
    qwen3_dir: Path,
) -> None:
    """Through the runner's `EmbeddingJob`: a cancel between pieces drops the long input
    being chunked (its scratch cache freed at once, no answer for it), and the other
    request sharing the work gets the vector it gets alone."""
    backend = _backend(qwen3_dir, "mean")
    long, short = (
        Embedding(
            task_id=TaskId(name),
            command_id=CommandId(name),
            instance_id=InstanceId("i"),
            origin_node_id=NodeId("n"),
            params=EmbeddingTaskParams(model=ModelId("m"), inputs=(tuple(ids),)),
        )
        for name, ids in (("long", INPUTS[2]), ("short", INPUTS[1]))
    )
    job = EmbeddingJob(backend, [long, short])
    assert job.run_piece(16) == 16  # the long input's first chunk
    work = job._works[0].work
    assert isinstance(work, DecoderWork) and work._chunked is not None
    cache = weakref.ref(work._chunked[1]._cache)
    assert job.cancel(TaskId("long")) is long
    gc.collect()
    assert cache() is None
    for _ in range(10):
        if job.done:
            break
        job.run_piece(16)
    ((task, answer),) = job.take_answers()
    assert task is short and isinstance(answer, EmbeddingChunk)
    alone = torch.nn.functional.normalize(backend.embed([INPUTS[1]]), dim=-1)
    assert _cosine(torch.tensor(answer.vectors), alone) > 1 - 1e-6
    assert job.cancel(TaskId("short")) is None  # answered: nothing to cancel


def test_transformers_forward_runs_a_long_input_whole_in_its_own_piece(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the lean step (`EXO_LEAN_FORWARD=0`) an input longer than the budget cannot
    be chunked: it is one piece of its own; the short ones still go in groups within the
    budget (padded), and the vectors equal the whole run's."""
    monkeypatch.setenv(LEAN_ENV, "0")
    backend = _backend(qwen3_dir, "last")
    assert not backend.runs_exo_forward
    whole = backend.embed(INPUTS)
    result, pieces = _in_pieces(backend.start_embedding(INPUTS), 16)
    assert pieces == [70, 45, 40, 7 + 3, 1]  # the inputs over 16 tokens whole, one each
    assert _cosine(result, whole) > 1 - 1e-6


@pytest.mark.parametrize("family", ["qwen3", pytest.param("gemma3", marks=pytest.mark.slow)])
def test_a_bfloat16_scratch_cache_stays_within_its_bound(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The runner's default KV dtype on CPU, bfloat16, for the chunked inputs' scratch
    cache: half of float32's bytes (`scratch_bytes`), and the chunked results within 1e-4
    cosine of the whole inputs' (measured: ~2e-6 on these tiny models)."""
    monkeypatch.setenv(KV_CACHE_DTYPE_ENV, "bfloat16")
    backend: DecoderEmbeddingBackend = _backend(request.getfixturevalue(f"{family}_dir"), "mean")
    assert backend._lean is not None and backend._lean.kv_dtype == torch.bfloat16
    whole = backend.embed(INPUTS)
    result, _ = _in_pieces(backend.start_embedding(INPUTS), 16)
    assert _cosine(result, whole) > 1 - 1e-4
    monkeypatch.setenv(KV_CACHE_DTYPE_ENV, "float32")
    float32 = _backend(request.getfixturevalue(f"{family}_dir"), "mean")
    assert float32.scratch_bytes(4096) == 2 * backend.scratch_bytes(4096)


def test_a_chunked_input_the_free_memory_cannot_hold_is_refused(
    qwen3_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`scratch_bytes` grows with the input (every layer's keys and values per token on a
    model without windows); with less memory free than a 70-token input's cache and the
    margin, starting its chunks raises ScratchMemoryError saying both sizes, and the work
    holds no scratch cache."""
    import exo.worker.engines.torch.embedding.backend as backend_module

    backend: DecoderEmbeddingBackend = _backend(qwen3_dir, "mean")
    per_token = backend.scratch_bytes(1)
    assert per_token > 0 and backend.scratch_bytes(70) == 70 * per_token
    free = SCRATCH_MEMORY_MARGIN_BYTES + 69 * per_token
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda: free)
    work = backend.start_embedding([INPUTS[2]])  # 70 tokens, chunked at a budget of 16
    with pytest.raises(ScratchMemoryError, match="an input of 70 tokens needs"):
        work.run_piece(16)
    assert work._chunked is None
    monkeypatch.setattr(backend_module, "free_memory_bytes", lambda: free + per_token)
    result, _ = _in_pieces(backend.start_embedding([INPUTS[2]]), 16)
    assert _cosine(result, backend.embed([INPUTS[2]])) > 1 - 1e-6
