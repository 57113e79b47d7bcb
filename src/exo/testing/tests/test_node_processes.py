"""A test's `exo` nodes die with the test process, even when it is killed from outside (no
fixture finalizer runs): CI's `timeout` must not leave nodes and runners serving."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import psutil

from exo.testing.processes import die_with_this_thread, wait_until

# A test process that starts an `ExoNode` whose `exo` command is a stand-in (a shell that
# sleeps: the same launch, session and parent-death request as a real node, without a
# node's start-up), prints its pid and waits to be killed.
CHILD = """
import sys, time
from pathlib import Path
from exo.testing import processes
processes.exo_command = lambda: sys.argv[1]
node = processes.ExoNode(Path(sys.argv[2])).launch()
print(node.process.pid, flush=True)
time.sleep(120)
"""


def _stand_in(tmp_path: Path) -> Path:
    script = tmp_path / "fake-exo"
    script.write_text("#!/bin/sh\nexec sleep 120\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_node_dies_when_its_test_process_is_killed(tmp_path: Path) -> None:
    test_process = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(_stand_in(tmp_path)), str(tmp_path / "home")],
        stdout=subprocess.PIPE,
        text=True,
    )
    node_pid = 0
    try:
        node_pid = int(test_process.stdout.readline())  # type: ignore[union-attr]
        # Its own session (a test kills a node and its runners as one group).
        assert os.getsid(node_pid) == node_pid != os.getsid(test_process.pid)
        assert not _gone(node_pid)
        test_process.send_signal(signal.SIGKILL)
        test_process.wait(timeout=10)
        wait_until(lambda: _gone(node_pid), timeout=10, what="the node to die with its test")
    finally:
        test_process.kill()
        test_process.wait(timeout=10)
        if node_pid and not _gone(node_pid):
            os.kill(node_pid, signal.SIGKILL)


def test_a_node_started_off_the_main_thread_is_not_tied_to_that_thread() -> None:
    # The parent-death signal follows the thread that forked: asked from a pool's worker,
    # the node would die when the pool shuts down, so it is not asked there.
    asked: list[object] = []
    worker = threading.Thread(target=lambda: asked.append(die_with_this_thread()))
    worker.start()
    worker.join(timeout=10)
    assert asked == [None]
    assert callable(die_with_this_thread())
