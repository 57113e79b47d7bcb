"""A runner whose engine left its draft model out (`TorchEngine.draft_left_out`: another
vocabulary, missing files, a bad config) goes ready and says why in its status, which
`/state` shows: trial 38's runner failed its instance instead, three times over."""

from __future__ import annotations

from multiprocessing import Pipe
from pathlib import Path
from typing import Any, cast

import pytest

from exo.shared.types.common import InstanceId, RunnerId
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.testing.builders import make_shard
from exo.worker.engines.torch import engine_factory
from exo.worker.runner import engine_lifecycle
from exo.worker.runner.runner import Runner

REASON = "draft model d cannot draft for m: their vocabularies differ (m serves without it)"


class LoadedWithoutDraft:
    """What `load_serving_engine` returns when the draft failed: the model, no draft."""

    tokenizer = None
    max_concurrent_requests = 2
    kv_cache_tokens = 100
    draft_source = None
    draft_left_out = REASON

    def warmup(self) -> None:
        pass

    def weight_bytes(self) -> int:
        return 1


def test_the_ready_and_running_statuses_say_why_the_draft_was_left_out(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    loaded: list[dict[str, Any]] = []

    def load_serving_engine(*_args: Any, **options: Any) -> LoadedWithoutDraft:
        loaded.append(options)
        return LoadedWithoutDraft()

    monkeypatch.setattr(engine_factory, "load_serving_engine", load_serving_engine)
    monkeypatch.setattr(engine_lifecycle, "check_card", lambda *_args: ())
    inbound_reader, _inbound_writer = Pipe(duplex=False)
    _outbound_reader, outbound_writer = Pipe(duplex=False)
    runner = Runner(RunnerId("runner-1"), make_shard(), inbound_reader, outbound_writer)
    runner._load(tmp_path, InstanceId("instance-1"))
    runner._warm_up()
    assert loaded, "the runner loads through load_serving_engine"
    ready = runner._status
    assert isinstance(ready, RunnerReady)
    assert ready.draft_model is None and ready.draft_left_out == REASON
    runner._generations["task-a"] = cast(Any, "a generation")  # running: any entry
    runner._update_status()
    running = runner._status
    assert isinstance(running, RunnerRunning) and running.draft_left_out == REASON
