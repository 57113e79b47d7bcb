"""An exception in `plan` (a bug: it is meant to be total) is logged at ERROR with its
traceback and the worker plans again at the next change, instead of the exception ending
the node; a failure that lasts is logged again at most once per
`PLAN_FAILURE_LOG_SECONDS`, and its end is logged."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import pytest
from loguru import logger

from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import ForwarderEvent, IndexedEvent
from exo.shared.types.tasks import Task
from exo.testing.builders import make_state
from exo.utils.channels import Topic
from exo.worker import main as worker_main
from exo.worker.main import PLAN_FAILURE_LOG_SECONDS, Worker

if TYPE_CHECKING:
    from loguru import Record

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")
DEADLINE_SECONDS = 10.0


class FailingPlan:
    """Raises `KeyError('runner-1')` for the first `failures` calls, then plans nothing."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Task | None:
        self.calls += 1
        if self.calls <= self.failures:
            raise KeyError("runner-1")
        return None


@pytest.fixture
def records() -> Iterator[list[Record]]:
    """The log records at INFO and above, as loguru's dicts."""
    caught: list[Record] = []
    handler = logger.add(lambda message: caught.append(message.record), level="INFO")
    try:
        yield caught
    finally:
        logger.remove(handler)


async def test_an_exception_in_plan_is_logged_and_the_worker_plans_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, records: list[Record]
) -> None:
    failing = FailingPlan(failures=4)
    monkeypatch.setattr(worker_main, "plan", failing)
    now = [0.0]
    worker = Worker(
        node_id=NODE,
        current_state=make_state,
        applied_events=Topic[IndexedEvent]("applied").subscribe(),
        local_events=LocalEventSender(NODE, Topic[ForwarderEvent]("local").sender()),
        publish_chunk=lambda _node, _chunk: None,
        models_dir=tmp_path,
        clock=lambda: now[0],
    )

    async def planned(calls: int) -> None:
        """Wake the worker until `plan` was called `calls` times."""
        with anyio.fail_after(DEADLINE_SECONDS):
            while failing.calls < calls:
                worker._notify()
                await anyio.sleep(0.01)

    def errors() -> list[Record]:
        return [record for record in records if record["level"].name == "ERROR"]

    with anyio.fail_after(DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(worker.run)
            await planned(2)  # failed twice, and still planning
            (first,) = errors()
            assert "planning failed (KeyError: 'runner-1')" in first["message"]
            assert first["exception"] is not None  # with its traceback
            now[0] += PLAN_FAILURE_LOG_SECONDS
            await planned(3)  # the same failure a minute on: logged again, once
            assert len(errors()) == 2 and "still fails" in errors()[1]["message"]
            assert "3 times" in errors()[1]["message"]
            await planned(5)  # the fourth failure, then a plan
            assert len(errors()) == 2
            assert any("works again after 4 failures" in r["message"] for r in records)
            task_group.cancel_scope.cancel()
