"""The worker: carries out `plan()`'s tasks on this node."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import anyio
from anyio.abc import TaskGroup
from loguru import logger

from exo.download.console import ConsoleProgress
from exo.download.fetch import DownloadCancelledError
from exo.download.locations import delete_downloaded_model
from exo.download.model_lock import ModelBusyError
from exo.download.peers import HUB_ASSUMED_MBPS, peers_holding
from exo.download.pypi_gguf import ModelPreparationError, holds_current_source, prepare_model
from exo.shared.local_events import LocalEventSender
from exo.shared.models.kv_cache_memory import kv_cache_tokens_for_dtype
from exo.shared.types.chunks import Chunk
from exo.shared.types.common import InstanceId, ModelId, NodeId, RunnerId
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.events import (
    DownloadControlled,
    Event,
    IndexedEvent,
    InstanceReported,
    NodeDownloadProgress,
    RunnerDeleted,
    RunnerStatusUpdated,
    TaskStatusUpdated,
)
from exo.shared.types.instances import Instance, InstanceDraft
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import (
    DownloadCompleted,
    DownloadFailed,
    DownloadOngoing,
    DownloadPending,
    DownloadStatus,
)
from exo.shared.types.runners import KVCacheUse, RunnerFailed, RunnerReady
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.state import State
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    CreateRunner,
    DownloadModel,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    Task,
    TaskFailed,
    TextGeneration,
)
from exo.utils.channels import Subscription
from exo.worker.plan import LocalRunner, plan, runner_shards
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.supervisor import RunnerSupervisor

PLAN_IDLE_WAKE_SECONDS = 0.5
# A planner failing again with the same error is logged again (without its traceback) at
# most this often, so a failure that lasts does not flood the log every idle wake.
PLAN_FAILURE_LOG_SECONDS = 60.0
# How long a delete waits for the model's cancelled download to stop writing.
CANCEL_WAIT_SECONDS = 10.0
# Retry delays after consecutive failures: 1 s, 2 s, 4 s, ... capped at 30 s.
BACKOFF_BASE_SECONDS = 1.0
BACKOFF_MAX_SECONDS = 30.0


def backoff_seconds(consecutive_failures: int) -> float:
    exponent = max(0, consecutive_failures - 1)
    return float(min(BACKOFF_MAX_SECONDS, BACKOFF_BASE_SECONDS * 2**exponent))


@dataclass(slots=True)
class _PlanFailure:
    """The error `plan` keeps raising (its type and message), since when it was last
    logged, and how often it was raised since it first was."""

    error: str
    logged_at: float
    count: int = 1


class Worker:
    """Plans from the node's replica of the state and executes one task at a time.

    `plan` is pure and should be total; when it raises all the same (a bug, such as a state
    it did not foresee), the error is logged at ERROR with its traceback and planning goes
    on at the next change of the state (or after `PLAN_IDLE_WAKE_SECONDS`), so that one
    bad decision does not end the node: its API, its master role and the runners already
    serving stay up, and a state the next events repair is planned from as usual.
    """

    def __init__(
        self,
        node_id: NodeId,
        current_state: Callable[[], State],
        applied_events: Subscription[IndexedEvent],
        local_events: LocalEventSender,
        publish_chunk: Callable[[NodeId, Chunk], None],
        models_dir: Path,
        offline: bool = False,
        log_level: str = "INFO",
        clock: Callable[[], float] = time.monotonic,
        caught_up: Callable[[], bool] = lambda: True,
        resyncing: Callable[[], bool] = lambda: False,
        peer_credential: str | None = None,
        runner_options: RunnerOptions | None = None,
    ) -> None:
        self.node_id = node_id
        self._current_state = current_state
        self._applied_events = applied_events
        self._local_events = local_events
        self._publish_chunk = publish_chunk
        self._models_dir = models_dir
        self._offline = offline
        self._log_level = log_level
        # The node options each runner and its engine run with.
        self._runner_options = runner_options or RunnerOptions()
        self._clock = clock
        self.runners: dict[RunnerId, RunnerSupervisor] = {}
        self.downloads: dict[ModelId, DownloadStatus] = {}
        self._download_cancels: dict[ModelId, threading.Event] = {}
        # Presented to other nodes' file routes; None: never fetch from peers.
        self._peer_credential = peer_credential
        # The Hub's speed as this node's last download from it measured (Mbit/s): peers
        # whose measured link is slower are not asked first.
        self._hub_mbps = HUB_ASSUMED_MBPS
        # Download bars on the node's console, when it is a terminal.
        self._console_progress = ConsoleProgress() if sys.stderr.isatty() else None
        self._failures: dict[str, int] = {}
        self._retry_after: dict[str, float] = {}
        # Models whose preparation failed for good (`DownloadFailed.permanent`) → the
        # instances of the model then: not retried until another instance of it is placed.
        self._given_up: dict[ModelId, frozenset[InstanceId]] = {}
        self._changed = anyio.Event()
        self._task_group: TaskGroup | None = None
        self._plan_failure: _PlanFailure | None = None
        # A node that restarts from its own log must not act on it (start a runner for
        # an instance the cluster removed since) before it holds the master's history.
        self._caught_up = caught_up
        # A node that dropped its history (a healed split) holds no state to act on
        # until it has the master's: its runners stay as they are meanwhile.
        self._resyncing = resyncing

    def _notify(self) -> None:
        self._changed.set()

    async def run(self) -> None:
        try:
            async with anyio.create_task_group() as task_group:
                self._task_group = task_group
                task_group.start_soon(self._event_loop)
                task_group.start_soon(self._plan_loop)
        finally:
            with anyio.CancelScope(shield=True):
                await self.shutdown_runners()

    async def shutdown_runners(self) -> None:
        for runner_id, supervisor in list(self.runners.items()):
            await supervisor.shutdown()
            self.runners.pop(runner_id, None)

    @property
    def state(self) -> State:
        return self._current_state()

    async def _event_loop(self) -> None:
        async for indexed_event in self._applied_events:
            event = indexed_event.event
            if isinstance(event, DownloadControlled) and event.node_id == self.node_id:
                await self._control_download(event)
            self._notify()

    async def _control_download(self, event: DownloadControlled) -> None:
        """`POST /download/start` / `cancel`, `DELETE /download/...` addressed to this node."""
        assert self._task_group is not None
        model_id = event.card.model_id
        cancel = self._download_cancels.get(model_id)
        match event.action:
            case "start":
                if cancel is None:
                    self.downloads[model_id] = DownloadOngoing(message="preparing")
                    self._task_group.start_soon(self._download, event.card, None)
            case "cancel":
                if cancel is not None:
                    cancel.set()
            case "delete":
                if cancel is not None:
                    cancel.set()
                    with anyio.move_on_after(CANCEL_WAIT_SECONDS):
                        while model_id in self._download_cancels:
                            await anyio.sleep(0.05)
                try:
                    removed = await anyio.to_thread.run_sync(
                        delete_downloaded_model, self._models_dir, str(model_id)
                    )
                except ModelBusyError as error:  # a pull through the API holds the files
                    logger.warning(f"the files of {model_id} were not deleted: {error}")
                    return
                logger.info(f"deleted the files of {model_id}: {[str(p) for p in removed]}")
                self.downloads.pop(model_id, None)
                self._local_events.emit(
                    NodeDownloadProgress(
                        node_id=self.node_id, model_id=model_id, status=DownloadPending()
                    )
                )

    def _local_view(self) -> dict[RunnerId, LocalRunner]:
        return {
            runner_id: LocalRunner(
                instance_id=supervisor.instance_id,
                status=supervisor.status,
                in_flight=frozenset(supervisor.in_flight),
                loading=supervisor.busy_loading,
            )
            for runner_id, supervisor in self.runners.items()
        }

    async def _plan_loop(self) -> None:
        while not self._caught_up():
            with anyio.move_on_after(PLAN_IDLE_WAKE_SECONDS):
                await self._changed.wait()
            self._changed = anyio.Event()
        logger.debug("worker: holding the cluster's current state; planning")
        while True:
            self._changed = anyio.Event()
            if self._resyncing():
                with anyio.move_on_after(PLAN_IDLE_WAKE_SECONDS):
                    await self._changed.wait()
                continue
            try:
                task = self._next_task()
            except Exception as error:  # a bug in `plan`: see the class docstring
                self._plan_failed(error)
                task = None
            if task is None:
                with anyio.move_on_after(PLAN_IDLE_WAKE_SECONDS):
                    await self._changed.wait()
                continue
            logger.debug(f"worker: {task!r}")
            await self._execute(task)

    def _next_task(self) -> Task | None:
        """`plan` over this node's view now."""
        self._retry_given_up_for_new_instances()
        task = plan(
            self.node_id,
            self.state,
            self._local_view(),
            self.downloads,
            self._retry_after,
            self._clock(),
            reported=frozenset(
                event.instance.instance_id
                for event in self._local_events.pending()
                if isinstance(event, InstanceReported)
            ),
        )
        if self._plan_failure is not None:
            logger.info(f"worker: planning works again after {self._plan_failure.count} failures")
            self._plan_failure = None
        return task

    def _plan_failed(self, error: Exception) -> None:
        """Log `plan`'s `error` at ERROR: with its traceback the first time and whenever
        the error changes, else at most once per `PLAN_FAILURE_LOG_SECONDS` with a count."""
        description = f"{type(error).__name__}: {error}"
        now = self._clock()
        failure = self._plan_failure
        if failure is None or failure.error != description:
            logger.opt(exception=error).error(
                f"worker: planning failed ({description}); this node plans again when the "
                "state changes"
            )
            self._plan_failure = _PlanFailure(description, now)
            return
        failure.count += 1
        if now - failure.logged_at >= PLAN_FAILURE_LOG_SECONDS:
            logger.error(f"worker: planning still fails ({description}): {failure.count} times")
            failure.logged_at = now

    def _runner_options_for(self, instance: Instance, runner_id: RunnerId) -> RunnerOptions:
        """This node's runner options for runner `runner_id` of `instance`
        (`runner_options_for`, `draft_link_options`)."""
        options = runner_options_for(self._runner_options, instance.kv_cache_tokens, instance.draft)
        return draft_link_options(options, instance, runner_id)

    async def _execute(self, task: Task) -> None:
        assert self._task_group is not None
        match task:
            case CreateRunner(instance_id=instance_id, runner_id=runner_id):
                instance = self.state.instances[instance_id]
                supervisor = RunnerSupervisor(
                    node_id=self.node_id,
                    runner_id=runner_id,
                    instance_id=instance_id,
                    shard=runner_shards(instance, runner_id, self.node_id)[0],
                    emit_event=self._on_runner_event,
                    publish_chunk=self._publish_chunk,
                    on_change=self._notify,
                    log_level=self._log_level,
                    options=self._runner_options_for(instance, runner_id),
                )
                self.runners[runner_id] = supervisor  # a shutdown meanwhile finds it
                await supervisor.start()
                self._task_group.start_soon(supervisor.run)
            case DownloadModel(shard=shard):
                model_id = shard.model_card.model_id
                self.downloads[model_id] = DownloadOngoing(message="preparing")
                self._task_group.start_soon(self._download, shard.model_card, shard)
            case LoadModel(instance_id=instance_id, runner_id=runner_id):
                if self._forget_replaced_sources(instance_id, runner_id):
                    return  # planned again: prepared anew, then loaded
                self.runners[runner_id].send(task)
            case ConnectToGroup(runner_id=runner_id) | StartWarmup(runner_id=runner_id):
                self.runners[runner_id].send(task)
            case TextGeneration(instance_id=instance_id) | Embedding(instance_id=instance_id):
                instance = self.state.instances[instance_id]
                runner_id = instance.shard_assignments.rank_zero_runner()
                self.runners[runner_id].send(task)
            case CancelTask(runner_id=runner_id, task_id=task_id):
                supervisor = self.runners[runner_id]
                supervisor.send(task)
                # The runner reports the cancellation; stop planning it again meanwhile.
                supervisor.in_flight.pop(task_id, None)
            case Shutdown(runner_id=runner_id):
                supervisor = self.runners.pop(runner_id)
                failed = isinstance(supervisor.status, RunnerFailed)
                await supervisor.shutdown()
                self._local_events.emit(RunnerDeleted(runner_id=runner_id))
                owner = self.state.instances.get(supervisor.instance_id)
                if (
                    failed
                    and owner is not None
                    and (
                        runner_id in owner.shard_assignments.runner_to_shard
                        or runner_id == owner.draft_runner_on(self.node_id)
                    )
                ):
                    # Retried later with backoff; a runner of a deleted or re-placed
                    # instance is not retried, so it is no failure to count.
                    self._record_failure(runner_id)

    def _forget_replaced_sources(self, instance_id: InstanceId, runner_id: RunnerId) -> bool:
        """Before runner `runner_id` of `instance_id` loads: forget the completed
        preparation of each model it loads whose source changed since (`holds_current_source`:
        a `.gguf` path replaced in place, checked by size and modification time), so `plan`
        prepares it again (converted anew) before the load. `plan` stays pure and cheap: this
        check runs once per load, not per plan.

        Returns:
            Whether a preparation was forgotten (the load must wait for it).
        """
        instance = self.state.instances.get(instance_id)
        if instance is None:
            return False
        forgotten = False
        for shard in runner_shards(instance, runner_id, self.node_id):
            card = shard.model_card
            status = self.downloads.get(card.model_id)
            if not isinstance(status, DownloadCompleted):
                continue
            if holds_current_source(card, Path(status.path)):
                continue
            logger.info(
                f"{card.model_id}: its file changed since {status.path} was made from it; "
                "preparing it again before loading"
            )
            del self.downloads[card.model_id]
            self._local_events.emit(
                NodeDownloadProgress(
                    node_id=self.node_id, model_id=card.model_id, status=DownloadPending()
                )
            )
            forgotten = True
        if forgotten:
            self._notify()
        return forgotten

    def kv_cache_use(self) -> list[KVCacheUse]:
        """This node's runners' KV caches as each last reported (runners that have served
        nothing yet are left out)."""
        return [
            KVCacheUse(
                str(runner_id),
                str(supervisor.shard.model_card.model_id),
                report.running_tokens,
                report.prefix_cache_tokens,
                report.budget_tokens,
            )
            for runner_id, supervisor in self.runners.items()
            if (report := supervisor.kv_cache) is not None
        ]

    def record_download(self, model_id: ModelId, status: DownloadStatus) -> None:
        """The API changed the model's files on this node (Ollama's pull and delete):
        remember it first-hand, as after a download of our own, and tell the cluster.
        A status other than completed makes the next placement prepare the files again."""
        if isinstance(status, DownloadCompleted):
            self.downloads[model_id] = status
        elif not isinstance(self.downloads.get(model_id), DownloadOngoing):
            self.downloads.pop(model_id, None)
        self._local_events.emit(
            NodeDownloadProgress(node_id=self.node_id, model_id=model_id, status=status)
        )
        self._notify()

    def _measure_hub(self, progress: DownloadProgress) -> None:
        """Remember the Hub's speed from a download that came from it alone."""
        fetched = [file for file in progress.files if file.source != "local"]
        from_hub_alone = fetched and all(file.source == "hub" for file in fetched)
        if from_hub_alone and progress.speed_bytes_per_second > 0:
            self._hub_mbps = progress.speed_bytes_per_second * 8 / 1e6

    def _on_runner_event(self, event: Event) -> None:
        if isinstance(event, RunnerStatusUpdated) and isinstance(event.status, RunnerReady):
            self._failures.pop(event.runner_id, None)
        self._local_events.emit(event)

    def _record_failure(self, key: str) -> None:
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        delay = backoff_seconds(failures)
        self._retry_after[key] = self._clock() + delay
        logger.warning(f"worker: {key} failed {failures} time(s); retrying in {delay:.0f}s")

    def _give_up(self, model_id: ModelId) -> None:
        """Stop retrying `model_id`'s preparation (a permanent failure) for the instances
        placed now; a later instance of it tries once more (the file may be fixed)."""
        self._given_up[model_id] = frozenset(
            instance.instance_id for instance in self.state.instances_of_model(model_id)
        )
        self._retry_after[model_id] = float("inf")

    def _retry_given_up_for_new_instances(self) -> None:
        for model_id, instance_ids in list(self._given_up.items()):
            current = {instance.instance_id for instance in self.state.instances_of_model(model_id)}
            if current - instance_ids:
                del self._given_up[model_id]
                self._retry_after.pop(model_id, None)

    def _fail_waiting_tasks(self, model_id: ModelId, message: str) -> None:
        """Requests for instances of `model_id` that this node must serve (rank 0 here)
        cannot start until the model is ready: fail them now rather than leave them
        waiting on a retry that may never succeed."""
        for task in self.state.tasks.values():
            instance = self.state.instances.get(task.instance_id)
            if instance is None or instance.model_id != model_id:
                continue
            rank_zero = instance.shard_assignments.rank_zero_runner()
            if instance.shard_assignments.runner_for_node(self.node_id) != rank_zero:
                continue
            self._local_events.emit(
                TaskStatusUpdated(task_id=task.task_id, status=TaskFailed(error_message=message))
            )

    async def _download(self, card: ModelCard, shard: ShardMetadata | None) -> None:
        """Prepare the files of `shard` (None: the whole model, as asked by `POST
        /download/start`), reporting progress; cancelled through `_download_cancels`."""
        model_id = card.model_id
        cancelled = threading.Event()
        self._download_cancels[model_id] = cancelled
        try:
            await self._prepare(card, shard, cancelled)
        finally:
            self._download_cancels.pop(model_id, None)
            if self._console_progress is not None:
                self._console_progress.end(str(model_id))

    async def _prepare(
        self, card: ModelCard, shard: ShardMetadata | None, cancelled: threading.Event
    ) -> None:
        model_id = card.model_id
        self._local_events.emit(
            NodeDownloadProgress(
                node_id=self.node_id, model_id=model_id, status=DownloadOngoing(message="preparing")
            )
        )

        def on_progress(message: str) -> None:
            logger.info(f"{model_id}: {message}")

        loop = anyio.lowlevel.current_token()
        peers = (
            peers_holding(self.state, self.node_id, model_id, self._peer_credential, self._hub_mbps)
            if self._peer_credential is not None
            else []
        )

        def on_download_progress(progress: DownloadProgress) -> None:
            # From the download's threads, at most twice a second (its tracker throttles);
            # events are emitted on the event loop, in order.
            if self._console_progress is not None:
                self._console_progress.update(str(model_id), progress)
            if progress.complete:
                self._measure_hub(progress)
                return  # DownloadCompleted follows
            event = NodeDownloadProgress(
                node_id=self.node_id,
                model_id=model_id,
                status=DownloadOngoing(message="downloading", progress=progress),
            )
            anyio.from_thread.run_sync(self._local_events.emit, event, token=loop)

        try:
            path = await anyio.to_thread.run_sync(
                lambda: prepare_model(
                    card,
                    self._models_dir,
                    self._offline,
                    on_progress,
                    shard=shard,
                    on_download_progress=on_download_progress,
                    cancelled=cancelled,
                    peers=peers,
                )
            )
        except Exception as error:
            if isinstance(error, DownloadCancelledError):
                logger.info(f"the download of {model_id} was cancelled (partial files kept)")
            elif isinstance(error, ModelPreparationError):
                logger.error(f"preparing {model_id} failed: {error}")
            else:
                logger.opt(exception=error).error(f"preparing {model_id} failed")
            permanent = isinstance(error, ModelPreparationError) and error.permanent
            status: DownloadStatus = DownloadFailed(error_message=str(error), permanent=permanent)
            if permanent:
                self._give_up(model_id)
            else:
                self._record_failure(model_id)
            self._fail_waiting_tasks(model_id, f"model {model_id} cannot be prepared: {error}")
        else:
            status = DownloadCompleted(path=str(path))
            self._failures.pop(model_id, None)
        self.downloads[model_id] = status
        self._local_events.emit(
            NodeDownloadProgress(node_id=self.node_id, model_id=model_id, status=status)
        )
        self._notify()


def runner_options_for(
    options: RunnerOptions, instance_tokens: int | None, draft: InstanceDraft | None = None
) -> RunnerOptions:
    """A node's runner `options` with its instance's KV-cache budget (`instance_tokens`,
    `Instance.kv_cache_tokens`), which every rank holds, bounded by the node's
    `--kv-cache-tokens` (a node restarted with a smaller one holds no more than it, whatever
    the instance was placed with). Instances placed before budgets were carried (None): the
    node's options. Placement counts the budget in the default KV dtype's bytes: a node
    storing float32 KV (`--kv-cache-dtype`) holds the tokens that fit the same bytes
    (`kv_cache_tokens_for_dtype`).

    The draft model is the instance's (`Instance.draft`, which placement chose from the
    card or the `--draft-model` of rank 0's node, and counted), None without one: a node's
    option reaches its runners through placement, so a draft left out for lack of room is
    not loaded anyway."""
    draft_model = None if draft is None else str(draft.model_id)
    if options.draft_model != draft_model:
        options = options.model_copy(update={"draft_model": draft_model})
    if instance_tokens is None:
        return options
    placed = kv_cache_tokens_for_dtype(instance_tokens, options.kv_cache_dtype)
    own = options.kv_cache_tokens
    tokens = placed if own is None else min(own, placed)
    return options.model_copy(update={"kv_cache_tokens": tokens})


def draft_link_options(
    options: RunnerOptions, instance: Instance, runner_id: RunnerId
) -> RunnerOptions:
    """`options` for runner `runner_id` of `instance` when its draft model runs on a spare
    node (`InstanceDraft.runner`): that draft runner serves drafts on its port
    (`draft_server_port`), and rank 0 asks for them at the address its node reaches the
    spare node on (`remote_draft_host`, `remote_draft_port`); every other runner, and every
    runner of an instance drafting in rank 0, gets none of them."""
    draft = instance.draft
    link = None if draft is None else draft.runner
    serve = link.port if link is not None and runner_id == link.runner_id else None
    host = port = None
    if link is not None and runner_id == instance.shard_assignments.rank_zero_runner():
        host, port = link.address, link.port
    update = {"draft_server_port": serve, "remote_draft_host": host, "remote_draft_port": port}
    if all(getattr(options, name) == value for name, value in update.items()):
        return options
    return options.model_copy(update=update)
