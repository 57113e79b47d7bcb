"""A model whose files cannot be made into a model for good (a GGUF that fails to convert)
is reported once as a permanent `DownloadFailed` and not retried until another instance of
it is placed; a passing failure (a download) is retried with backoff as before."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo.download.pypi_wheels import ModelPreparationError
from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId, RunnerId
from exo.shared.types.events import ForwarderEvent, IndexedEvent
from exo.shared.types.nodes import DownloadFailed
from exo.shared.types.runners import RunnerIdle
from exo.shared.types.state import State
from exo.shared.types.tasks import DownloadModel
from exo.testing.builders import SMOLLM2, make_instance, make_state
from exo.utils.channels import Topic
from exo.worker import main as worker_main
from exo.worker.main import Worker
from exo.worker.plan import LocalRunner, plan

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")
FIRST = make_instance(NODE, instance_id="instance-1")
SECOND = make_instance(NODE, instance_id="instance-2")
NOW = 1000.0
AN_HOUR_LATER = NOW + 3600.0


def _worker(state: list[State], tmp_path: Path) -> Worker:
    applied: Topic[IndexedEvent] = Topic("applied")
    events: Topic[ForwarderEvent] = Topic("local_events")
    return Worker(
        node_id=NODE,
        current_state=lambda: state[0],
        applied_events=applied.subscribe(),
        local_events=LocalEventSender(NODE, events.sender()),
        publish_chunk=lambda _node, _chunk: None,
        models_dir=tmp_path / "models",
        clock=lambda: NOW,
    )


def _next_task(worker: Worker, state: State, now: float) -> Any:
    """The plan of `worker` at `now` with one idle runner for each instance of `state`."""
    runners = {
        instance.shard_assignments.rank_zero_runner(): LocalRunner(
            instance_id=instance.instance_id, status=RunnerIdle(), in_flight=frozenset()
        )
        for instance in state.instances.values()
    }
    retry_after = worker._retry_after  # pyright: ignore[reportPrivateUsage]
    return plan(NODE, state, runners, worker.downloads, retry_after, now)


@pytest.mark.parametrize("permanent", [True, False])
async def test_a_permanent_failure_waits_for_a_new_instance(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, permanent: bool
) -> None:
    calls: list[str] = []

    def failing_prepare(card: Any, *_args: Any, **_kwargs: Any) -> Path:
        calls.append(str(card.model_id))
        raise ModelPreparationError("the GGUF has no blk.1.ffn_up_exps.weight", permanent)

    monkeypatch.setattr(worker_main, "prepare_model", failing_prepare)
    state = [make_state(instances=[FIRST])]
    worker = _worker(state, tmp_path)
    shard = FIRST.shard_assignments.runner_to_shard[RunnerId("instance-1-rank0")]
    await worker._download(shard.model_card, shard)  # pyright: ignore[reportPrivateUsage]
    status = worker.downloads[SMOLLM2]
    assert isinstance(status, DownloadFailed) and status.permanent is permanent
    assert "blk.1.ffn_up_exps.weight" in status.error_message and calls == [SMOLLM2]
    later = _next_task(worker, state[0], AN_HOUR_LATER)
    if not permanent:  # retried once its backoff has passed
        assert isinstance(later, DownloadModel)
        return
    assert later is None  # not an hour later either
    # Another instance of the model (placed again, the file perhaps fixed) tries once more.
    state[0] = make_state(instances=[FIRST, SECOND])
    worker._retry_given_up_for_new_instances()  # pyright: ignore[reportPrivateUsage]
    assert isinstance(_next_task(worker, state[0], NOW), DownloadModel)
