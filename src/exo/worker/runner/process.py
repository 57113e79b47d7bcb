"""The runner process's entry point: what a runner does before its `Runner` loop (its
signals, dying with its node, its logs and process title), with its arguments as the
supervisor passes them; a draft runner (`RunnerOptions.draft_server_port`) runs the
`DraftServingRunner` loop instead."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
from multiprocessing.connection import Connection

from loguru import logger

from exo.shared.types.common import RunnerId
from exo.shared.types.shards import ShardMetadata
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.runner import Runner
from exo.worker.runner.start_method import leave_runner_server

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """A runner whose node was killed (SIGKILL, OOM) must not go on serving its shard:
    ask Linux to kill it when its parent dies, and exit at once if that already happened."""
    parent = os.getppid()
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent or parent == 1:
        os._exit(1)


def runner_main(
    runner_id: str,
    shard_json: str,
    inbound: Connection,
    outbound: Connection,
    log_level: str,
    options_json: str | None = None,
) -> None:
    """Entry point of the runner process (forked from the node's runner server, or
    spawned: `start_method.py`)."""
    from pydantic import TypeAdapter

    from exo.utils.process_title import runner_title, set_process_title

    # Ctrl-C reaches the whole process group; the node shuts runners down in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    leave_runner_server()
    _die_with_parent()
    logger.remove()
    logger.add(sys.stderr, level=log_level, format="{time:HH:mm:ss} runner | {level} | {message}")
    shard: ShardMetadata = TypeAdapter(ShardMetadata).validate_json(shard_json)
    set_process_title(runner_title(shard.model_card.model_id, shard.device_rank))
    options = None if options_json is None else RunnerOptions.model_validate_json(options_json)
    if options is not None and options.draft_server_port is not None:
        from exo.worker.runner.draft_serving import DraftServingRunner

        DraftServingRunner(RunnerId(runner_id), shard, inbound, outbound, options).run()
        return
    Runner(RunnerId(runner_id), shard, inbound, outbound, options).run()
