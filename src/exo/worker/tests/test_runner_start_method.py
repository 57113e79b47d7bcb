"""Runners forked from the node's runner server (`exo.worker.runner.start_method`) get what
a spawned runner got: the node's environment as libgomp sees it (the thread count), the
runners' own variables, their death read as EOF with its exit code; a runner started after
the node's environment changed is spawned with the new one; and when the node is killed,
the server and its runners end too.

Each case runs in a fresh "node" process (`python -c`), as a node starts its runners,
since a process has one fork server for its whole life."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from typing import Any

import psutil

from exo.testing.processes import RUNNER_SERVER_MARK, wait_until

NODE_SECONDS = 300.0  # a fresh interpreter importing torch twice on a loaded machine
GONE_SECONDS = 30.0


def _runner(outbound: Connection, inbound: Connection, busy: bool) -> None:
    """A stand-in runner: reports what it got, then waits on its inbound pipe until killed
    or until the node's end of the pipe closes; or, `busy`, never reads it (as a runner
    loading a model or computing a step), so that only its death with its parent ends it."""
    from multiprocessing import forkserver

    import torch

    from exo.worker.runner.process import _die_with_parent
    from exo.worker.runner.start_method import leave_runner_server

    leave_runner_server()
    _die_with_parent()
    outbound.send(
        {
            "forked": forkserver.get_inherited_fds() is not None,
            "threads": torch.get_num_threads(),
            "mark": os.environ.get("EXO_TEST_MARK"),
            "kernel_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
            "pid": os.getpid(),
        }
    )
    if busy:
        time.sleep(NODE_SECONDS)
        return
    with contextlib.suppress(EOFError):
        inbound.recv()


def _start(context: Any, busy: bool = False) -> tuple[Any, Connection, Connection]:
    """A stand-in runner started as the supervisor starts one; its process and the node's
    ends of its two pipes."""
    from_runner, runner_writes = context.Pipe(duplex=False)
    runner_reads, to_runner = context.Pipe(duplex=False)
    process = context.Process(target=_runner, args=(runner_writes, runner_reads, busy), daemon=True)
    process.start()
    runner_writes.close()
    runner_reads.close()
    return process, from_runner, to_runner


def node_main(mode: str) -> None:
    """The "node" process: `report` prints what its runners got; `hold` prints the pid of
    its one runner, then waits to be killed."""
    from exo.worker.runner.start_method import runner_context

    context = runner_context()
    first, from_first, _to_first = _start(context, busy=mode == "hold")
    got_first = from_first.recv()
    if mode == "hold":
        print(json.dumps({"runner": got_first["pid"]}), flush=True)
        time.sleep(NODE_SECONDS)
        return
    os.kill(first.pid, signal.SIGKILL)
    try:
        from_first.recv()
        eof = False
    except EOFError:
        eof = True
    first.join(30)
    os.environ["EXO_TEST_MARK"] = "changed"
    later_context = runner_context()
    second, from_second, to_second = _start(later_context)
    got_second = from_second.recv()
    to_second.close()  # the node's end closes: the runner's read ends, it exits
    second.join(30)
    result = {
        "first": got_first,
        "first_eof": eof,
        "first_exit": first.exitcode,
        "first_method": context.get_start_method(),
        "second": got_second,
        "second_method": later_context.get_start_method(),
        "second_exit": second.exitcode,
    }
    print(json.dumps(result), flush=True)


def broken_server_node_main() -> None:
    """The "node" process whose runner server fails in its imports: a real supervisor
    starts a runner anyway (spawned), which answers a shutdown; prints its pid."""
    import anyio

    from exo.shared.types.common import InstanceId, NodeId, RunnerId
    from exo.testing.builders import make_shard
    from exo.worker.runner import start_method
    from exo.worker.runner.supervisor import RunnerSupervisor

    start_method.RUNNER_PRELOAD = [*start_method.RUNNER_PRELOAD, f"{__package__}.raising_import"]

    async def main() -> None:
        supervisor = RunnerSupervisor(
            node_id=NodeId("node"),
            runner_id=RunnerId("runner-broken-server"),
            instance_id=InstanceId("instance"),
            shard=make_shard(),
            emit_event=lambda _event: None,
            publish_chunk=lambda _owner, _chunk: None,
            on_change=lambda: None,
        )
        await supervisor.start()
        print(json.dumps({"pid": supervisor.pid}), flush=True)
        with anyio.fail_after(NODE_SECONDS):
            async with anyio.create_task_group() as group:
                group.start_soon(supervisor.run)
                await supervisor.shutdown()

    anyio.run(main)


def _node(mode: str, extra_env: dict[str, str]) -> subprocess.Popen[str]:
    environment = {
        key: value for key, value in os.environ.items() if key not in ("EXO_RUNNER_START",)
    }
    environment.update(extra_env)
    environment.pop("ONEDNN_PRIMITIVE_CACHE_CAPACITY", None)
    call = "broken_server_node_main()" if mode == "broken" else f"node_main({mode!r})"
    command = f"from {__name__} import *; {call}"
    return subprocess.Popen(
        [sys.executable, "-c", command],
        env=environment,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_a_forked_runner_gets_the_node_s_environment_and_its_death_reads_as_eof() -> None:
    # One thread where torch's default on this machine would be its cores: only libgomp
    # reading OMP_NUM_THREADS when the server imported torch gives 1 after the fork.
    node = _node("report", {"OMP_NUM_THREADS": "1", "EXO_TEST_MARK": "at start"})
    try:
        output, _ = node.communicate(timeout=NODE_SECONDS)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
    assert node.returncode == 0, output
    result = json.loads(output.strip().splitlines()[-1])
    assert result["first_method"] == "forkserver"
    assert result["first"]["forked"] is True
    assert result["first"]["threads"] == 1
    assert result["first"]["mark"] == "at start"
    assert result["first"]["kernel_cache"] == "64"  # set by the node for its runners
    assert result["first_eof"] is True
    assert result["first_exit"] == -signal.SIGKILL
    # The node's environment changed: that runner is spawned, with the new value.
    assert result["second_method"] == "spawn"
    assert result["second"]["forked"] is False
    assert result["second"]["mark"] == "changed"
    assert result["second"]["threads"] == 1
    assert result["second_exit"] == 0


def test_a_runner_is_spawned_when_the_runner_server_fails() -> None:
    node = _node("broken", {})
    try:
        output, errors = node.communicate(timeout=NODE_SECONDS)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
    assert node.returncode == 0, errors[-3000:]
    assert "fails to import, on purpose" in errors  # the server's own traceback
    assert "the runner server failed" in errors
    pid = json.loads(output.strip().splitlines()[-1])["pid"]
    assert f"runner runner-broken-server started (pid {pid}, spawn)" in errors


def test_the_runner_server_and_its_runners_end_when_the_node_is_killed() -> None:
    node = _node("hold", {"EXO_TEST_MARK": "hold"})
    try:
        assert node.stdout is not None
        line = node.stdout.readline()  # the runner reported: the server and it are up
        runner = psutil.Process(json.loads(line)["runner"])
        servers = [
            child
            for child in psutil.Process(node.pid).children()
            if RUNNER_SERVER_MARK in " ".join(child.cmdline())
        ]
        assert len(servers) == 1, [child.cmdline() for child in servers]
        assert runner.ppid() == servers[0].pid  # forked by the server
        node.send_signal(signal.SIGKILL)  # the node alone, as the OOM killer would
        node.wait(10)
        wait_until(
            lambda: _gone(servers[0]) and _gone(runner),
            GONE_SECONDS,
            0.1,
            what="the runner server and its runner gone after the node",
        )
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(10)
        with_group = [p for p in psutil.process_iter() if _in_group(p, node.pid)]
        for leftover in with_group:
            leftover.kill()


def _gone(process: psutil.Process) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _in_group(process: psutil.Process, group: int) -> bool:
    try:
        return os.getpgid(process.pid) == group
    except (ProcessLookupError, psutil.Error):
        return False
