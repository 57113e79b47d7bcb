"""A draft runner: the runner process of an instance's draft model on a spare node
(`InstanceDraft.runner`, issue 43's cluster case). It loads the draft model whole and serves
drafts to the instance's rank 0 over one authenticated TCP connection
(`engines.torch.draft_server.DraftServer`) instead of serving generations.

Its life follows a rank runner's statuses, so the worker's plan and the cluster state treat
it alike (idle -> loading -> loaded -> warming up -> ready; failed; shut down), but nothing
waits for it: rank 0 drafts n-grams only until it answers, and goes on without it if it
fails or its node leaves. It listens only once its model is loaded (`LoadModel`), on the
port placement chose (`DraftRunner.port`), on every interface (rank 0 reaches it at the
address its node measured); with a cluster secret every connection first proves the key
(`comm/group_auth.py`, `Purpose.DRAFT`), bound to the target instance's id.
"""

from __future__ import annotations

import contextlib
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from loguru import logger

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
from exo.shared.types.tasks import (
    CancelTask,
    ConnectToGroup,
    Embedding,
    LoadModel,
    Shutdown,
    StartWarmup,
    TaskFailed,
    TextGeneration,
)
from exo.worker.runner.messages import (
    RunnerInbound,
    RunnerOutbound,
    RunnerStatusReport,
    TaskStatusReport,
    encode_outbound,
    runner_inbound_adapter,
)
from exo.worker.runner.options import RunnerOptions

if TYPE_CHECKING:
    from exo.worker.engines.torch.draft_server import DraftServer
    from exo.worker.engines.torch.remote_drafts import RemoteDraft


def remote_draft_of(options: RunnerOptions, instance_id: InstanceId) -> RemoteDraft | None:
    """Where rank 0 of `instance_id` asks for its drafts (`remote_draft_host` /
    `remote_draft_port`, set when its draft model runs on a spare node), with the
    credentials its connection proves the cluster secret with; None: it drafts itself."""
    host, port = options.remote_draft_host, options.remote_draft_port
    if host is None or port is None or options.draft_model is None:
        return None
    from exo.worker.engines.torch.comm.group_auth import GroupCredentials
    from exo.worker.engines.torch.remote_drafts import RemoteDraft

    key = options.rank_group_key
    credentials = None if key is None else GroupCredentials(bytes.fromhex(key), instance_id)
    return RemoteDraft(
        host=host,
        port=port,
        model_id=options.draft_model,
        credentials=credentials,
        instance_id=str(instance_id),
    )


class DraftServingRunner:
    """The loop of a draft runner's process (see the module docstring).

    Args:
        runner_id / shard: the draft runner and the draft model's whole-model shard.
        inbound / outbound: the pipes to and from its supervisor.
        options: the node's runner options; `draft_server_port` must be set.

    Raises:
        ValueError: `options.draft_server_port` is None (not a draft runner).
    """

    def __init__(
        self,
        runner_id: RunnerId,
        shard: ShardMetadata,
        inbound: Connection,
        outbound: Connection,
        options: RunnerOptions,
    ) -> None:
        if options.draft_server_port is None:
            raise ValueError("a draft runner needs options.draft_server_port")
        self.runner_id = runner_id
        self.shard = shard
        self._inbound = inbound
        self._outbound = outbound
        self._options = options
        self._port = options.draft_server_port
        self._server: DraftServer | None = None
        self._status: RunnerStatus = RunnerIdle()

    def run(self) -> None:
        """Serve the supervisor's messages until it asks for a shutdown or goes away."""
        self._set_status(RunnerIdle())
        try:
            while True:
                try:
                    raw = self._inbound.recv_bytes()
                except EOFError:
                    return  # the supervisor is gone: nobody reads our status any more
                if not self._handle(runner_inbound_adapter.validate_json(raw)):
                    break
        finally:
            if self._server is not None:
                with contextlib.suppress(Exception):
                    self._server.close()
                self._server = None
        self._set_status(RunnerShutdown())

    def _send(self, message: RunnerOutbound) -> None:
        self._outbound.send_bytes(encode_outbound([message]))

    def _set_status(self, status: RunnerStatus) -> None:
        self._status = status
        self._send(RunnerStatusReport(status=status))

    def _handle(self, message: RunnerInbound) -> bool:
        """Act on one message; False once asked to shut down."""
        match message:
            case LoadModel(model_dir=model_dir, instance_id=instance_id):
                self._load(Path(model_dir), instance_id)
            case StartWarmup():
                self._warm_up()
            case Shutdown():
                return False
            case TextGeneration(task_id=task_id) | Embedding(task_id=task_id):
                # The worker routes generations to rank 0 only; answer rather than hang one.
                self._send(
                    TaskStatusReport(
                        task_id=task_id,
                        status=TaskFailed(
                            error_message="a draft runner serves drafts, not requests"
                        ),
                    )
                )
            case ConnectToGroup() | CancelTask():
                pass  # a draft runner is in no group and runs no task
        return True

    def _load(self, model_dir: Path, instance_id: InstanceId) -> None:
        from exo.worker.engines.torch.comm.group_auth import GroupCredentials
        from exo.worker.engines.torch.draft_server import load_draft_server
        from exo.worker.engines.torch.engine import DEFAULT_MAX_CONCURRENT_REQUESTS

        if not isinstance(self._status, RunnerIdle):
            return
        layers = self.shard.model_card.n_layers
        self._set_status(RunnerLoading(layers_loaded=0, total_layers=layers))
        key = self._options.rank_group_key
        credentials = None if key is None else GroupCredentials(bytes.fromhex(key), instance_id)
        try:
            server = load_draft_server(
                model_dir, self._port, credentials, str(instance_id),
                slots=self._options.max_concurrent_requests or DEFAULT_MAX_CONCURRENT_REQUESTS,
                kv_dtype=self._options.kv_cache_dtype,
            )  # fmt: skip
            server.start()
        except Exception as error:
            logger.opt(exception=error).error(f"draft runner {self.runner_id}: loading failed")
            self._set_status(RunnerFailed(error_message=f"draft model loading failed: {error}"))
            return
        self._server = server
        logger.info(
            f"draft runner {self.runner_id}: {self.shard.model_card.model_id} serves drafts "
            f"on port {self._port}"
        )
        self._set_status(RunnerLoaded())

    def _warm_up(self) -> None:
        if self._server is None:
            self._set_status(RunnerFailed(error_message="warm-up requested before loading"))
            return
        self._set_status(RunnerWarmingUp())
        self._set_status(
            RunnerReady(
                weight_bytes=_weight_bytes(self._server.source.model),
                max_concurrent_requests=self._options.max_concurrent_requests or 1,
                kv_cache_tokens=0,
                draft_model=str(self.shard.model_card.model_id),
            )
        )


def _weight_bytes(model: Any) -> int:
    """Bytes of a loaded model's parameters and buffers (its weights as held)."""
    tensors = [*model.parameters(), *model.buffers()]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
