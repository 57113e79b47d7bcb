"""The worker's pure decision: given the cluster state and what this node's runners are
doing, which single task comes next. The worker loop carries the task out and calls
`plan` again; `None` means there is nothing to do until something changes."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId, TaskId
from exo.shared.types.instances import Instance
from exo.shared.types.nodes import DownloadCompleted, DownloadFailed, DownloadStatus
from exo.shared.types.runners import (
    RunnerConnected,
    RunnerConnecting,
    RunnerFailed,
    RunnerIdle,
    RunnerLoaded,
    RunnerLoading,
    RunnerReady,
    RunnerRunning,
    RunnerShutdown,
    RunnerStatus,
    RunnerWarmingUp,
)
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    CreateRunner,
    DownloadModel,
    LoadModel,
    Shutdown,
    StartWarmup,
    Task,
    TaskPending,
)


@dataclass(frozen=True, slots=True)
class LocalRunner:
    """What the worker knows first-hand about one of its runners."""

    instance_id: InstanceId
    status: RunnerStatus
    in_flight: frozenset[TaskId]
    loading: bool = False
    """A LoadModel or StartWarmup was sent and its status has not come back yet."""


def plan(
    node_id: NodeId,
    state: State,
    runners: Mapping[RunnerId, LocalRunner],
    downloads: Mapping[ModelId, DownloadStatus],
    retry_after: Mapping[str, float],
    now: float,
    reported: frozenset[InstanceId] = frozenset(),
) -> Task | None:
    """Decide this node's next task.

    Args:
        node_id: this node.
        state: the cluster state as of the last applied event.
        runners: this node's live runner supervisors.
        downloads: this node's model download statuses (first-hand, not via the log).
        retry_after: monotonic time (s) before which a runner id or model id must not be
            retried after a failure.
        now: monotonic time (s).
        reported: instances this node reported after dropping its history (a healed
            split) that the master has not indexed yet: their runners are kept.
    """
    state = _placed_instances_only(state)
    # In priority order, each step run only when those before it found nothing: a later
    # step may assume the earlier ones passed (e.g. every runner here is still assigned).
    steps: tuple[Callable[[], Task | None], ...] = (
        lambda: _shut_down_orphans(node_id, state, runners, reported),
        lambda: _cancel_abandoned(state, runners),
        lambda: _create_runners(node_id, state, runners, retry_after, now),
        lambda: _download(node_id, state, runners, downloads, retry_after, now),
        lambda: _load_and_warm_up(node_id, state, runners, downloads),
        lambda: _forward_generation(state, runners),
    )
    for step in steps:
        task = step()
        if task is not None:
            return task
    return None


def _placed_instances_only(state: State) -> State:
    """The state without instances waiting for room after a node loss: their old
    assignment names a lost node, so their runners here stop and none start."""
    waiting = {i for i, u in state.unavailable_instances.items() if u.waiting_for_room}
    if not waiting:
        return state
    placed = {k: v for k, v in state.instances.items() if k not in waiting}
    return state.model_copy(update={"instances": placed})


def _shut_down_orphans(
    node_id: NodeId,
    state: State,
    runners: Mapping[RunnerId, LocalRunner],
    reported: frozenset[InstanceId] = frozenset(),
) -> Task | None:
    for runner_id, runner in runners.items():
        instance = state.instances.get(runner.instance_id)
        if instance is None and runner.instance_id in reported:
            continue
        if (
            instance is None
            or runner_id not in _assigned_here(instance, node_id)
            or isinstance(runner.status, RunnerFailed | RunnerShutdown)
        ):
            return Shutdown(runner_id=runner_id)
        if runner_id == instance.draft_runner_on(node_id):
            continue  # a draft runner is no member of the group: nothing of it breaks
        if not isinstance(runner.status, RunnerIdle) and _group_broken(state, instance, runner_id):
            # Our process group lost a member: every rank starts over together.
            return Shutdown(runner_id=runner_id)
    return None


def _assigned_here(instance: Instance, node_id: NodeId) -> tuple[RunnerId, ...]:
    """The runners `instance` assigns to `node_id`: its rank's, or its draft runner
    (`InstanceDraft.runner`: a spare node's, which holds no rank)."""
    rank = instance.shard_assignments.runner_for_node(node_id)
    draft = instance.draft_runner_on(node_id)
    return tuple(runner_id for runner_id in (rank, draft) if runner_id is not None)


def _group_broken(state: State, instance: Instance, own_runner: RunnerId) -> bool:
    for runner_id in instance.shard_assignments.runner_to_shard:
        if runner_id == own_runner:
            continue
        status = state.runners.get(runner_id)
        if status is None or isinstance(status, RunnerFailed | RunnerShutdown):
            return True
    return False


def _other_ranks(
    state: State, instance: Instance, own_runner: RunnerId
) -> list[RunnerStatus | None]:
    return [
        state.runners.get(runner_id)
        for runner_id in instance.shard_assignments.runner_to_shard
        if runner_id != own_runner
    ]


def _cancel_abandoned(state: State, runners: Mapping[RunnerId, LocalRunner]) -> Task | None:
    # A task the runner holds that the state no longer has was cancelled or failed.
    for runner_id, runner in runners.items():
        for task_id in sorted(runner.in_flight):
            if task_id not in state.tasks:
                return CancelTask(runner_id=runner_id, task_id=task_id)
    return None


def _create_runners(
    node_id: NodeId,
    state: State,
    runners: Mapping[RunnerId, LocalRunner],
    retry_after: Mapping[str, float],
    now: float,
) -> Task | None:
    for instance_id, instance in sorted(state.instances.items()):
        for runner_id in _assigned_here(instance, node_id):
            if runner_id in runners or retry_after.get(runner_id, 0.0) > now:
                continue
            return CreateRunner(instance_id=instance_id, runner_id=runner_id)
    return None


def _download(
    node_id: NodeId,
    state: State,
    runners: Mapping[RunnerId, LocalRunner],
    downloads: Mapping[ModelId, DownloadStatus],
    retry_after: Mapping[str, float],
    now: float,
) -> Task | None:
    """A runner's model files first, then those of the draft model it loads beside it
    (`Instance.draft` on this node, when placement counted it: it has a card), whole; a
    draft runner's, the draft model's."""
    for runner_id, runner in sorted(runners.items()):
        instance = state.instances.get(runner.instance_id)
        if instance is None:
            continue  # a runner of a deleted instance: being shut down
        wanted = runner_shards(instance, runner_id, node_id)
        if not wanted:
            continue  # a runner of a re-placed instance: being shut down
        for shard in wanted:
            model_id = shard.model_card.model_id
            status = downloads.get(model_id)
            if status is None or (
                isinstance(status, DownloadFailed) and retry_after.get(model_id, 0.0) <= now
            ):
                return DownloadModel(instance_id=instance.instance_id, shard=shard)
    return None


def runner_shards(instance: Instance, runner_id: RunnerId, node_id: NodeId) -> list[ShardMetadata]:
    """What runner `runner_id` of `instance` on `node_id` loads, in loading order: its rank's
    shard, then the draft model it loads beside it (rank 0 on the draft's node); a draft
    runner, the draft model whole; a runner the instance no longer assigns here, nothing."""
    own = instance.shard_assignments.runner_to_shard.get(runner_id)
    draft = _draft_to_fetch(instance, node_id)
    if own is not None and instance.shard_assignments.runner_for_node(node_id) == runner_id:
        return [own] if draft is None else [own, draft]
    if draft is not None and runner_id == instance.draft_runner_on(node_id):
        return [draft]
    return []


def _draft_to_fetch(instance: Instance, node_id: NodeId) -> ShardMetadata | None:
    """The whole-model shard of the instance's draft model where this node loads it and
    its files come from a card (a `--draft-model` directory is on the node already)."""
    draft = instance.draft
    if draft is None or draft.model_card is None or draft.node_id != node_id:
        return None
    card = draft.model_card
    return ShardMetadata(
        model_card=card, sharding="pipeline", device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip


_CONNECTED_OR_LATER = (
    RunnerConnected,
    RunnerLoading,
    RunnerLoaded,
    RunnerWarmingUp,
    RunnerReady,
    RunnerRunning,
)
_LOADED_OR_LATER = (RunnerLoaded, RunnerWarmingUp, RunnerReady, RunnerRunning)


def _others_downloaded(state: State, instance: Instance, node_id: NodeId) -> bool:
    return all(
        isinstance(state.downloads.get(other, {}).get(instance.model_id), DownloadCompleted)
        for other in instance.shard_assignments.node_to_runner
        if other != node_id
    )


def _load_and_warm_up(
    node_id: NodeId,
    state: State,
    runners: Mapping[RunnerId, LocalRunner],
    downloads: Mapping[ModelId, DownloadStatus],
) -> Task | None:
    """Single rank: load, warm up. Several ranks, in lockstep: once every rank's files are
    there, all connect; once all are connected, all load; once all loaded, all warm up."""
    for runner_id, runner in sorted(runners.items()):
        instance = state.instances.get(runner.instance_id)
        if instance is None or runner.loading:
            continue
        if runner_id == instance.draft_runner_on(node_id):
            task = _load_draft_runner(instance, runner_id, runner, downloads)
            if task is not None:
                return task
            continue
        download = downloads.get(instance.model_id)
        if not isinstance(download, DownloadCompleted):
            continue
        draft = _draft_to_fetch(instance, node_id)
        if draft is not None and not isinstance(
            downloads.get(draft.model_card.model_id), DownloadCompleted | DownloadFailed
        ):
            continue  # the runner loads its draft model with the target (failed: without)
        others = _other_ranks(state, instance, runner_id)
        rendezvous = instance.rendezvous
        match runner.status:
            case RunnerIdle() if rendezvous is None:
                return LoadModel(
                    instance_id=instance.instance_id, runner_id=runner_id, model_dir=download.path
                )
            case RunnerIdle() if (
                rendezvous is not None
                and _others_downloaded(state, instance, node_id)
                and all(
                    isinstance(status, RunnerIdle | RunnerConnecting | RunnerConnected)
                    for status in others
                )
            ):
                return ConnectToGroup(
                    instance_id=instance.instance_id,
                    runner_id=runner_id,
                    backend=rendezvous.backend,
                    master_addr=rendezvous.addresses.get(node_id, "127.0.0.1"),
                    master_port=rendezvous.port,
                    link_addresses=_link_addresses(instance, node_id),
                )
            case RunnerConnected() if all(
                isinstance(status, _CONNECTED_OR_LATER) for status in others
            ):
                return LoadModel(
                    instance_id=instance.instance_id, runner_id=runner_id, model_dir=download.path
                )
            case RunnerLoaded() if all(isinstance(status, _LOADED_OR_LATER) for status in others):
                return StartWarmup(instance_id=instance.instance_id, runner_id=runner_id)
            case _:
                continue
    return None


def _load_draft_runner(
    instance: Instance,
    runner_id: RunnerId,
    runner: LocalRunner,
    downloads: Mapping[ModelId, DownloadStatus],
) -> Task | None:
    """A draft runner on its own: it loads the draft model once its files are here and
    warms up, whatever the instance's ranks are doing (they draft without it meanwhile)."""
    draft = instance.draft
    assert draft is not None
    download = downloads.get(draft.model_id)
    if not isinstance(download, DownloadCompleted):
        return None
    match runner.status:
        case RunnerIdle():
            return LoadModel(
                instance_id=instance.instance_id, runner_id=runner_id, model_dir=download.path
            )
        case RunnerLoaded():
            return StartWarmup(instance_id=instance.instance_id, runner_id=runner_id)
        case _:
            return None


def _forward_generation(state: State, runners: Mapping[RunnerId, LocalRunner]) -> Task | None:
    for runner_id, runner in sorted(runners.items()):
        if not isinstance(runner.status, RunnerReady | RunnerRunning):
            continue
        instance = state.instances.get(runner.instance_id)
        if instance is None or instance.shard_assignments.rank_zero_runner() != runner_id:
            continue
        if not all(
            isinstance(status, RunnerReady | RunnerRunning)
            for status in _other_ranks(state, instance, runner_id)
        ):
            continue
        # state.tasks keeps creation order, so this is first come, first served.
        for task in state.tasks.values():
            if (
                task.instance_id == runner.instance_id
                and isinstance(task.status, TaskPending)
                and task.task_id not in runner.in_flight
            ):
                return task
    return None


def _link_addresses(instance: Instance, node_id: NodeId) -> dict[int, str]:
    """Where this node's rank reaches each lower rank other than 0, by rank
    (`Rendezvous.link_addresses`; a rank links to the lower ranks, rank 0 at the
    rendezvous address)."""
    assert instance.rendezvous is not None
    reaches = instance.rendezvous.link_addresses.get(node_id, {})
    assignments = instance.shard_assignments
    ranks = {
        node: assignments.runner_to_shard[runner].device_rank
        for node, runner in assignments.node_to_runner.items()
        if runner in assignments.runner_to_shard
    }
    own = ranks.get(node_id, 0)
    return {
        ranks[other]: address for other, address in reaches.items() if 0 < ranks.get(other, 0) < own
    }
