"""One node per data directory: a second holder is refused with the first's pid, in this
process, from another process, and through `exo`'s entry point (`main`, `python -m exo`);
a killed holder leaves no stale lock."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from loguru import logger

from exo.cli import main
from exo.node.home_lock import LOCK_FILE_NAME, HomeInUseError, HomeLock

HOLDER = """
import sys, time
from pathlib import Path
from exo.node.home_lock import HomeLock
lock = HomeLock(Path(sys.argv[1]))
print("held", flush=True)
time.sleep(120)
"""


def test_a_second_lock_is_refused_until_the_first_is_released(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first = HomeLock(tmp_path)
    assert (tmp_path / LOCK_FILE_NAME).read_text() == f"{os.getpid()}\n"
    with pytest.raises(HomeInUseError, match=rf"in use by another exo node \(pid {os.getpid()}\)"):
        HomeLock(tmp_path)
    monkeypatch.chdir(tmp_path.parent)  # a relative EXO_HOME: the message names it whole
    with pytest.raises(HomeInUseError) as refused:
        HomeLock(Path(tmp_path.name))
    assert str(refused.value).startswith(f"{tmp_path.resolve()} is in use")
    first.release()
    first.release()  # idempotent
    HomeLock(tmp_path).release()


def test_another_process_is_named_and_its_death_frees_the_directory(tmp_path: Path) -> None:
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(HomeInUseError, match=rf"\(pid {holder.pid}\).*EXO_HOME"):
            HomeLock(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while True:  # the kernel drops the dead holder's lock as it closes its files
        try:
            HomeLock(tmp_path).release()
            break
        except HomeInUseError:
            assert time.monotonic() < deadline, "the killed holder's lock was never released"
            time.sleep(0.05)


def test_exo_refuses_to_start_on_a_directory_in_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    held = HomeLock(tmp_path)
    # main() would replace every loguru sink; the test's sink sees what it logs.
    monkeypatch.setattr("exo.main.configure_logging", lambda level: None)
    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    try:
        with pytest.raises(SystemExit) as stopped:
            main(["--no-default-model", "--offline"])
    finally:
        logger.remove(sink)
        held.release()
    assert stopped.value.code == 1
    assert any(f"{tmp_path.resolve()} is in use by another exo node" in line for line in logged), (
        logged
    )
    # Nothing of the directory was touched: no node id, no event log.
    assert sorted(path.name for path in tmp_path.iterdir()) == [LOCK_FILE_NAME]


def test_python_dash_m_exo_runs_the_node_and_is_refused_too(tmp_path: Path) -> None:
    """`python -m exo` is the `exo` command: here it stops at the held directory."""
    held = HomeLock(tmp_path)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "exo", "--no-default-model", "--offline"],
            capture_output=True, text=True, timeout=120, check=False,
            env={**os.environ, "EXO_HOME": str(tmp_path)},
        )  # fmt: skip
    finally:
        held.release()
    assert done.returncode == 1, done.stderr[-2000:]
    assert f"(pid {os.getpid()})" in done.stderr


def test_a_taken_api_port_is_refused_with_the_options_to_choose_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    monkeypatch.setattr("exo.main.configure_logging", lambda level: None)
    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        try:
            with pytest.raises(SystemExit) as stopped:
                main(["--no-default-model", "--offline", "--host", "127.0.0.1",
                      "--api-port", str(port)])  # fmt: skip
        finally:
            logger.remove(sink)
    assert stopped.value.code == 1
    assert any(
        f"cannot listen on 127.0.0.1:{port}" in line and "--api-port" in line for line in logged
    ), logged


def test_a_taken_zenoh_port_is_one_line_naming_the_port_and_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    monkeypatch.setattr("exo.main.configure_logging", lambda level: None)
    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    with socket.socket() as taken, socket.socket() as free:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        free.bind(("127.0.0.1", 0))
        api_port = free.getsockname()[1]
        free.close()
        try:
            with pytest.raises(SystemExit) as stopped:
                main(["--no-default-model", "--offline", "--no-multicast", "--host", "127.0.0.1",
                      "--api-port", str(api_port), "--zenoh-port", str(port)])  # fmt: skip
        finally:
            logger.remove(sink)
    assert stopped.value.code == 1
    (line,) = [line for line in logged if f"127.0.0.1:{port}" in line]
    assert line.startswith(f"cannot listen on 127.0.0.1:{port}"), line
    assert "--zenoh-port" in line and "address already in use" in line, line
    assert ".rs:" not in line and "\n" not in line.strip(), line
