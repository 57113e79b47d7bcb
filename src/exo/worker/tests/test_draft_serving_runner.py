"""The draft runner's loop (`runner/draft_serving.DraftServingRunner`), in-process over a pipe
as its supervisor drives it: idle, loading, loaded (its draft server listening on the
instance's port, answering a client's drafts), warming up, ready (naming its draft model); a
generation task sent to it by mistake fails rather than hangs; a shutdown closes the server
and reports it; a port already taken fails the load with a status saying so."""

from __future__ import annotations

import socket
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import InstanceId, RunnerId
from exo.shared.types.runners import (
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.tasks import LoadModel, Shutdown, StartWarmup, TaskFailed
from exo.testing.builders import make_text_generation_task
from exo.testing.ports import free_port
from exo.testing.tiny_models import save_tiny_checkout
from exo.worker.runner.draft_serving import DraftServingRunner
from exo.worker.runner.messages import (
    RunnerStatusReport,
    TaskStatusReport,
    decode_outbound,
    runner_inbound_adapter,
)
from exo.worker.runner.options import RunnerOptions

INSTANCE = InstanceId("target-instance")
RUNNER = RunnerId("target-instance-draft")
WAIT_S = 60.0  # a bound on each status, not a speed check


class Supervisor:
    """The supervisor's end of a draft runner running on a thread."""

    def __init__(self, model_dir: Path, port: int) -> None:
        card = card_from_local_directory(model_dir)
        shard = ShardMetadata(
            sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
            end_layer=card.n_layers,
        )  # fmt: skip
        to_runner, self._inbound = Pipe()
        self._outbound, from_runner = Pipe()
        self.inbox: Connection = from_runner
        self.sent: Connection = to_runner
        options = RunnerOptions(draft_server_port=port, max_concurrent_requests=2)
        self.runner = DraftServingRunner(RUNNER, shard, self._inbound, self._outbound, options)
        self.thread = threading.Thread(target=self.runner.run, daemon=True)
        self.thread.start()

    def send(self, message: object) -> None:
        self.sent.send_bytes(runner_inbound_adapter.dump_json(message))  # type: ignore[arg-type]

    def next_reports(self) -> list[object]:
        assert self.inbox.poll(WAIT_S), "the runner said nothing"
        return list(decode_outbound(self.inbox.recv_bytes()))

    def statuses_until(self, kind: type[RunnerStatus]) -> list[RunnerStatus]:
        seen: list[RunnerStatus] = []
        while not seen or not isinstance(seen[-1], kind | RunnerFailed):
            for report in self.next_reports():
                if isinstance(report, RunnerStatusReport):
                    seen.append(report.status)
        return seen


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_checkout(tmp_path_factory.mktemp("draft-runner") / "draft")


def test_the_draft_runner_loads_serves_drafts_and_shuts_its_server(model_dir: Path) -> None:
    port = free_port()
    supervisor = Supervisor(model_dir, port)
    assert supervisor.statuses_until(RunnerIdle) == [RunnerIdle()]
    supervisor.send(LoadModel(instance_id=INSTANCE, runner_id=RUNNER, model_dir=str(model_dir)))
    loaded = supervisor.statuses_until(RunnerLoaded)
    assert isinstance(loaded[0], RunnerLoading) and isinstance(loaded[-1], RunnerLoaded)
    with socket.create_connection(("127.0.0.1", port), timeout=5):
        pass  # the draft server listens on the instance's port once loaded
    supervisor.send(StartWarmup(instance_id=INSTANCE, runner_id=RUNNER))
    ready = supervisor.statuses_until(RunnerReady)
    assert isinstance(ready[0], RunnerWarmingUp)
    status = ready[-1]
    assert isinstance(status, RunnerReady)
    assert status.draft_model == str(card_from_local_directory(model_dir).model_id)
    assert status.weight_bytes > 0
    # A generation routed here by mistake fails at once instead of waiting forever.
    task = make_text_generation_task()
    supervisor.send(task)
    (report,) = supervisor.next_reports()
    assert isinstance(report, TaskStatusReport) and report.task_id == task.task_id
    assert isinstance(report.status, TaskFailed)
    supervisor.send(Shutdown(runner_id=RUNNER))
    assert supervisor.statuses_until(RunnerShutdown)[-1] == RunnerShutdown()
    supervisor.thread.join(WAIT_S)
    assert not supervisor.thread.is_alive()
    with pytest.raises(OSError):  # the server closed with the runner
        socket.create_connection(("127.0.0.1", port), timeout=5).close()


def test_a_taken_port_fails_the_load_saying_so(model_dir: Path) -> None:
    with socket.create_server(("0.0.0.0", 0)) as taken:
        port = taken.getsockname()[1]
        supervisor = Supervisor(model_dir, port)
        supervisor.statuses_until(RunnerIdle)
        supervisor.send(LoadModel(instance_id=INSTANCE, runner_id=RUNNER, model_dir=str(model_dir)))
        failed = supervisor.statuses_until(RunnerLoaded)[-1]
        assert isinstance(failed, RunnerFailed)
        assert "draft model loading failed" in (failed.error_message or "")
        supervisor.send(Shutdown(runner_id=RUNNER))
        supervisor.statuses_until(RunnerShutdown)
        supervisor.thread.join(WAIT_S)
