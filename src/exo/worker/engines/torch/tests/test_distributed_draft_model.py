"""A draft model on a tensor-parallel instance (issue 43): rank 0 loads the draft and drafts,
the 2-rank group verifies k + 1 positions per drafting request in one step, and greedy
output equals the group's plain decoding token for token (gloo over 127.0.0.1, spawned
processes, a tiny random float32 Llama and its noisy copy as the draft, float32 KV), with
requests drafting beside one that does not. Rank 1 loads no draft. The other ranks hold a
verified draft's positions as rank 0 does (`CACHE_COMMIT`): without it a slot moved when
another request left kept only the fed position's KV there, and the output diverged.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.testing.rank_processes import run_rank_processes
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.slot_kv_cache import SlotKVCache
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.parallel.cache_ops import (
    CACHE_COMMIT,
    CACHE_FREE,
    CacheOpLog,
    RecordingSlotKVCache,
    replay_cache_ops,
)
from exo.worker.engines.torch.tests.speculative_builders import (
    DRAFT_NOISE,
    PROMPTS,
    noisy_copy,
    request,
    run,
)
from exo.worker.engines.torch.tests.test_distributed import GROUP_DEADLINE_S, make_shard


def _greedy_runs(engine: TorchEngine) -> dict[str, Any]:
    """Rank 0: the prompts greedy, plain then speculating (one request plain beside them)."""
    engine.eos_token_ids = frozenset({-1})  # random weights: stop by length
    speculation = engine.scheduler.speculation
    assert speculation is not None and speculation.source is engine.draft_source
    speculation.step_cost = lambda rows: None  # draft lengths never follow the clock
    texts: dict[str, list[list[int]]] = {}
    for mode in (False, True):
        params = [
            request(prompt, temperature=0.0, max_tokens=16, speculative=mode and index != 1)
            for index, prompt in enumerate(PROMPTS)
        ]
        engine.clear_prefix_cache()
        states = [engine.build_request(one, None, f"{mode}-{i}") for i, one in enumerate(params)]
        run(engine, states, join_at=[0, 1, 2])
        texts[str(mode)] = [state.prompt_ids + state.generated_ids for state in states]
    counters = speculation.counters
    return {
        "plain": texts["False"],
        "speculative": texts["True"],
        "verify_rounds": counters.verify_rounds,
        "accepted": counters.accepted_tokens,
        "drafted": counters.drafted_tokens,
    }


def _rank_main(
    rank: int, world_size: int, port: int, results: Any, target: str, draft: str
) -> None:
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group

    os.environ["EXO_KV_CACHE_DTYPE"] = "float32"
    torch.set_num_threads(1)
    try:
        init_group("gloo", rank, 2, "127.0.0.1", port, timeout_s=60)
        shard = make_shard(Path(target), "tensor", rank, 2)
        engine = load_engine(
            Path(target), shard, weight_dtype="float32", max_concurrent_requests=4,
            draft_model=Path(draft),  # rank 1 leaves it out (`draft_runs_on`)
        )  # fmt: skip
        assert (engine.draft_source is not None) == (rank == 0)
        engine.warmup()
        if rank == 0:
            results.put(("outcome", rank, _greedy_runs(engine)))
            engine.shutdown()
        else:
            engine.serve_forever()
        results.put(("done", rank, None))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def test_a_verified_drafts_positions_are_held_on_every_rank_and_survive_a_slot_move() -> None:
    shape = (1, 1, 2)  # layers, kv heads, head dim
    recording = RecordingSlotKVCache(
        *shape, torch.float32, torch.device("cpu"), 4, log=CacheOpLog()
    )
    replica = SlotKVCache(*shape, torch.float32, torch.device("cpu"), 4)
    for _ in range(2):
        recording.allocate()
    replay_cache_ops(replica, recording.log.take())
    for cache in (recording, replica):  # a step fed position 3 and 2 draft positions of slot 1
        cache.keys[0][1, :, :6] = 7.0
        cache.commit(1, 4)  # `commit_lengths`: the fed position only
    recording.commit_verified(1, 6)  # both drafts accepted
    recording.free(0)  # slot 1 moves into slot 0
    ops = recording.log.take()
    assert [op[:3] for op in ops] == [(CACHE_COMMIT, 1, 6), (CACHE_FREE, 0, 0)]
    replay_cache_ops(replica, ops)
    assert replica.lengths == recording.lengths and replica.lengths[0] == 6
    assert torch.equal(replica.keys[0][0, :, :6], recording.keys[0][0, :, :6])
    assert replica.keys[0][0, 0, 5, 0].item() == 7.0  # the accepted draft's key moved too


@pytest.mark.slow  # two spawned ranks: about 20 s on a busy 2-core machine
def test_tensor_split_greedy_with_a_draft_model_is_plain_decoding(
    tmp_path: Path, real_model_dir: Path
) -> None:
    target = save_tiny_model(
        tmp_path / "target", "llama", real_model_dir, n_layers=2, tie_word_embeddings=False
    )
    draft = noisy_copy(target, tmp_path / "draft", DRAFT_NOISE)
    reports = run_rank_processes(_rank_main, (str(target), str(draft)), 2, GROUP_DEADLINE_S)
    [outcome] = [value for kind, _, value in reports if kind == "outcome"]
    assert outcome["speculative"] == outcome["plain"]
    assert outcome["verify_rounds"] >= 4
    assert 0 < outcome["accepted"] <= outcome["drafted"]


@pytest.fixture(autouse=True)
def _no_group_in_test_process() -> Any:
    yield
    assert not torch.distributed.is_initialized()
