"""A `.gguf` path replaced in place while the node runs is converted again before its next
load, never served from its old conversion (docs/models.md, "Ollama's store").

Found by a new-user trial (2026-12-06): the file replaced by another GGUF, its instance
deleted, the card added again (the new card said Q4_0), the model asked again: loaded in
0.3 s from the old Q4_K conversion, the old answer. `prepare_model` checks the file's size
and modification time, but the worker kept the first `DownloadCompleted` and `plan` loaded
that directory for every later instance without preparing again. The worker now checks the
source when it loads (`Worker._forget_replaced_sources`).

These tests run the worker's real plan loop; the runner is a supervisor that is never
spawned and records what the worker sends it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import anyio
import pytest

from exo.download.gguf_models import card_for_gguf
from exo.download.pypi_gguf import COMPLETION_MARKER, gguf_file_identity
from exo.shared.local_events import LocalEventSender
from exo.shared.types.common import NodeId
from exo.shared.types.events import ForwarderEvent, IndexedEvent, NodeDownloadProgress
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadPending
from exo.shared.types.state import State
from exo.shared.types.tasks import LoadModel
from exo.testing.builders import make_instance, make_state
from exo.testing.random_gguf import RandomGgufShape, write_random_gguf
from exo.utils.channels import Topic
from exo.worker import main as worker_main
from exo.worker.main import Worker
from exo.worker.runner.messages import RunnerInbound
from exo.worker.runner.supervisor import RunnerSupervisor

pytestmark = pytest.mark.anyio

NODE = NodeId("node-a")
# Seconds the worker gets to prepare (convert a tiny GGUF) and plan a load.
LOAD_DEADLINE_SECONDS = 120.0


class _RecordingRunner(RunnerSupervisor):
    """Rank 0 of `instance` on `NODE`, never spawned: keeps what the worker sends it and
    reads as loading after a `LoadModel`, as a real runner does until it reports."""

    def __init__(self, instance: Instance) -> None:
        runner_id = instance.shard_assignments.rank_zero_runner()
        super().__init__(
            node_id=NODE,
            runner_id=runner_id,
            instance_id=instance.instance_id,
            shard=instance.shard_assignments.runner_to_shard[runner_id],
            emit_event=lambda _event: None,
            publish_chunk=lambda _node, _chunk: None,
            on_change=lambda: None,
        )
        self.sent: list[RunnerInbound] = []

    def send(self, task: RunnerInbound) -> None:
        self.sent.append(task)
        if isinstance(task, LoadModel):
            self.busy_loading = True

    async def shutdown(self) -> None:
        return None

    def loads(self) -> list[LoadModel]:
        return [task for task in self.sent if isinstance(task, LoadModel)]


def _place(worker: Worker, state: list[State], card: ModelCard, name: str) -> _RecordingRunner:
    """The cluster now holds one instance of `card` called `name` (the last one deleted),
    whose runner the worker has created."""
    instance = make_instance(NODE, card=card, instance_id=name)
    state[0] = make_state(instances=[instance])
    runner = _RecordingRunner(instance)
    worker.runners[runner.runner_id] = runner
    return runner


async def _loaded_directory(worker: Worker, runner: _RecordingRunner) -> Path:
    """Run the worker until it tells `runner` to load; the directory it loads."""
    with anyio.fail_after(LOAD_DEADLINE_SECONDS):
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(worker.run)
            while not runner.loads():
                await anyio.sleep(0.05)
            task_group.cancel_scope.cancel()
    (load,) = runner.loads()
    return Path(load.model_dir)


def _weights_digest(directory: Path) -> str:
    digest = hashlib.sha256()
    for weights in sorted(directory.glob("*.safetensors")):
        digest.update(weights.read_bytes())
    return digest.hexdigest()


@pytest.mark.parametrize("replacement", ["unchanged", "same size", "another type"])
async def test_a_gguf_replaced_while_the_node_runs_is_converted_again_before_it_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, replacement: str
) -> None:
    prepared: list[str] = []
    real_prepare = worker_main.prepare_model

    def counting_prepare(card: ModelCard, *args: Any, **kwargs: Any) -> Path:
        prepared.append(str(card.model_id))
        return real_prepare(card, *args, **kwargs)

    monkeypatch.setattr(worker_main, "prepare_model", counting_prepare)
    path = write_random_gguf(tmp_path / "tiny.gguf", RandomGgufShape(), "Q4_0", seed=1)
    first_card = card_for_gguf(path, str(path))
    state = [make_state()]
    applied: Topic[IndexedEvent] = Topic("applied")
    events: Topic[ForwarderEvent] = Topic("local_events")
    local_events = LocalEventSender(NODE, events.sender())
    worker = Worker(
        node_id=NODE,
        current_state=lambda: state[0],
        applied_events=applied.subscribe(),
        local_events=local_events,
        publish_chunk=lambda _node, _chunk: None,
        models_dir=tmp_path / "models",
    )
    first_directory = await _loaded_directory(worker, _place(worker, state, first_card, "first"))
    first_weights = _weights_digest(first_directory)
    assert prepared == [str(path)]

    old_identity = gguf_file_identity(path)
    if replacement == "same size":
        write_random_gguf(path, RandomGgufShape(), "Q4_0", seed=2)
    elif replacement == "another type":
        write_random_gguf(path, RandomGgufShape(), "Q8_0", seed=2)
    new_identity = gguf_file_identity(path)
    assert (new_identity == old_identity) == (replacement == "unchanged")
    # The card added again is read from the file as it is now.
    second_card = card_for_gguf(path, str(path))
    assert second_card.model_id == first_card.model_id
    if replacement == "another type":
        assert second_card.storage_size_bytes != first_card.storage_size_bytes
        assert second_card.gguf_weight_types != first_card.gguf_weight_types
    second = _place(worker, state, second_card, "second")
    second_directory = await _loaded_directory(worker, second)

    marker = json.loads((second_directory / COMPLETION_MARKER).read_text())
    assert marker["gguf_identity"] == new_identity, (
        f"LoadModel of {second_directory}, a conversion of the file as it was before"
    )
    assert len(second.loads()) == 1  # never told to load the old conversion first
    forgotten = [
        event
        for event in local_events.pending()
        if isinstance(event, NodeDownloadProgress) and isinstance(event.status, DownloadPending)
    ]
    if replacement == "unchanged":
        assert prepared == [str(path)]  # loaded again without preparing again
        assert _weights_digest(second_directory) == first_weights
        assert not forgotten
    else:
        assert prepared == [str(path), str(path)]
        assert _weights_digest(second_directory) != first_weights
        assert [event.model_id for event in forgotten] == [first_card.model_id]
