"""Building a C++ library with torch's extension builder in a supervised child process, so a
build survives a busy machine: a limit on stalls instead of on the build's length, progress
kept across attempts, one builder per library, and nothing in the cache before the whole
library is there.

Why: with one limit on the whole build (10 minutes before), a build that was only slow (load
10-16 on 2 cores: the compiler gets a fraction of a core) failed and the engine fell back to
torch's slower kernels; the stopped build lost every object it had compiled, so the next
start began again from nothing; and only the builder's Python process was killed, while
`ninja` and its compilers ran on. What it does instead:

- The build runs in a child process: torch's builder also loads what it builds, and a
  library loaded from two paths in one process would register its operators twice.

- The build directory is `<cache>/<name>.build`, kept until the library is in place: torch's
  builder runs `ninja`, which compiles only the objects not yet built (an object a killed
  compiler left half-written has no entry in ninja's log, so it is compiled again). A
  stopped build, or one whose process was killed, resumes where it stopped.
- The build is stopped only when it makes no progress: no object or library file in its
  directory appears or changes for `BUILD_STALL_S`. As long as objects keep coming it runs
  on (at most `BUILD_STALL_S` per object and two more: `_watch`'s bound). Every
  `BUILD_REPORT_S` the log says how many objects are built.
- Stopping: SIGTERM to the builder's process group (a session of its own); ninja passes it to
  its compilers (each in a process group of its own) and deletes their partial outputs;
  SIGKILL to the group after `STOP_GRACE_S`. The builder also gets SIGTERM when the process
  that started it dies (Linux's parent-death signal) and passes it on the same way, so a
  killed runner leaves no compiler running.
- The library is renamed into the cache (`os.replace`, atomic) once its link succeeded; a
  stopped or failed build leaves no `.so` behind (and no build directory where it had built
  no object).
- One builder per library: an `fcntl` lock beside it, which the system releases when its
  holder dies. torch's own lock (a `lock` file in the build directory, which a killed
  builder leaves behind and every later build would then wait on) is removed while the
  `fcntl` lock is held. A process that finds the lock held logs that it waits.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from loguru import logger

# Seconds without a new or changed object before a build is stopped: many times the longest
# gap between two objects seen on a loaded 2-core machine, where the whole build took most
# of the old 10-minute limit (docs/benchmarks/2026-12-07-native-build-under-load.md).
BUILD_STALL_S = 600.0
# Seconds between the log's "N of M objects" lines while a build runs.
BUILD_REPORT_S = 60.0
# Seconds the builder's process group has to stop after SIGTERM before SIGKILL.
STOP_GRACE_S = 10.0
_POLL_S = 0.5

# The child: passes SIGTERM (its own, or the parent-death signal) to its whole process
# group, ninja included, then runs torch's builder; ninja's output goes to the build log.
_BUILDER = """\
import ctypes, os, signal, sys
name, sources, build, flags, parent = sys.argv[1:6]
def stop(signum, frame):
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    os.killpg(0, signal.SIGTERM)
signal.signal(signal.SIGTERM, stop)
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (AttributeError, OSError):
    pass
if os.getppid() != int(parent):
    stop(signal.SIGTERM, None)
from torch.utils.cpp_extension import load
load(name=name, sources=sources.split("\\n"), build_directory=build,
     extra_cflags=flags.split(), extra_ldflags=["-fopenmp"], is_python_module=False,
     verbose=True)
"""


class BuildStalled(RuntimeError):
    """A build made no progress for `BUILD_STALL_S` and was stopped."""


def built_extension(name: str, sources: Sequence[Path], flags: Sequence[str], root: Path) -> Path:
    """`root/<name>.so`, built from `sources` with `flags` unless it is there already.

    Args:
        name: the library's name, unique for these sources and flags (a hash in it).
        sources: the C++ files, compiled into one library.
        flags: extra compiler flags.
        root: the cache directory (writable).

    Returns:
        The library's path in `root`.

    Raises:
        BuildStalled: no progress for `BUILD_STALL_S` (the build directory stays: the next
            attempt resumes it).
        RuntimeError: the build failed (the message holds the log's first error line and
            its last line; the whole log is `<root>/<name>.build/build.log` where the
            build had built objects, which the next attempt keeps).
    """
    library = root / f"{name}.so"
    if library.exists():
        return library
    with open(root / f"{name}.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("waiting for another process building exo's native kernels in {}", root)
            fcntl.flock(lock, fcntl.LOCK_EX)
        if library.exists():  # built by another process while this one waited
            return library
        build = root / f"{name}.build"
        build.mkdir(exist_ok=True)
        (build / "lock").unlink(missing_ok=True)  # torch's, left by a killed builder
        resumed = _objects_built(build)
        logger.info(
            "building exo's native kernels (once per machine, a minute or more on a busy one)"
            " in {}{}", root, f", resuming ({resumed} objects built)" if resumed else "",
        )  # fmt: skip
        started = time.monotonic()
        try:
            _run_builder(name, sources, flags, build)
        except RuntimeError:
            if not _objects_built(build):  # nothing to resume (a flag the compiler refuses)
                shutil.rmtree(build, ignore_errors=True)
            raise
        os.replace(build / f"{name}.so", library)
        shutil.rmtree(build, ignore_errors=True)
        logger.info("built exo's native kernels in {:.0f} s", time.monotonic() - started)
    return library


def _run_builder(name: str, sources: Sequence[Path], flags: Sequence[str], build: Path) -> None:
    """Run torch's builder in a session of its own, watched by `_watch`, into `build`."""
    command = [
        sys.executable, "-c", _BUILDER, name, "\n".join(map(str, sources)), str(build),
        " ".join(flags), str(os.getpid()),
    ]  # fmt: skip
    with open(build / "build.log", "w") as log:
        process = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            env=build_environment(), start_new_session=True,
        )  # fmt: skip
    try:
        _watch(process, build, len(sources))
    finally:
        _stop(process)  # whatever ended the watch: no builder outlives it
    if process.returncode != 0 or not (build / f"{name}.so").exists():
        raise RuntimeError(_failure(build / "build.log", process.returncode))


def _watch(process: subprocess.Popen[bytes], build: Path, objects: int) -> None:
    """Wait for `process` while its build directory shows progress.

    Raises:
        BuildStalled: no object or library file appeared or changed for `BUILD_STALL_S`,
            or the build ran past `BUILD_STALL_S` per object and two more (a bound that
            a build making progress does not reach).
    """
    started = last_progress = last_report = time.monotonic()
    seen = _outputs(build)
    deadline = started + BUILD_STALL_S * (objects + 2)
    while time.monotonic() < deadline:
        try:
            process.wait(timeout=_POLL_S)
            return
        except subprocess.TimeoutExpired:
            pass
        now = time.monotonic()
        current = _outputs(build)
        if current != seen:
            seen, last_progress = current, now
        if now - last_progress > BUILD_STALL_S:
            raise BuildStalled(
                f"no object built for {BUILD_STALL_S:.0f} s "
                f"({_objects_built(build)} of {objects} built; log: {build / 'build.log'})"
            )
        if now - last_report >= BUILD_REPORT_S:
            logger.info(
                "building exo's native kernels: {} of {} objects after {:.0f} s",
                _objects_built(build), objects, now - started,
            )  # fmt: skip
            last_report = now
    raise BuildStalled(f"the build ran past {deadline - started:.0f} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End `process`'s process group, if anything of it runs: SIGTERM (ninja then stops its
    compilers), SIGKILL after `STOP_GRACE_S`; return once the group is gone (bounded)."""
    group = process.pid
    for stop_signal, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, STOP_GRACE_S)):
        if not _group_alive(process, group):
            return
        try:
            os.killpg(group, stop_signal)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while _group_alive(process, group) and time.monotonic() < deadline:
            time.sleep(0.05)


def _group_alive(process: subprocess.Popen[bytes], group: int) -> bool:
    process.poll()  # reaps the builder, else it stays a zombie of the group
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    return True


def _outputs(build: Path) -> frozenset[tuple[str, int, int]]:
    """The build's objects and library as (name, size, modification ns): what progress is."""
    found = set()
    for path in build.iterdir():
        if path.suffix in (".o", ".so"):
            try:
                status = path.stat()
            except FileNotFoundError:  # removed by ninja between listing and reading
                continue
            found.add((path.name, status.st_size, status.st_mtime_ns))
    return frozenset(found)


def _objects_built(build: Path) -> int:
    return sum(1 for path in build.glob("*.o"))


def _failure(log: Path, returncode: int | None) -> str:
    """The build log's first error line (the compiler's) and its last line."""
    try:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines()]
    except FileNotFoundError:
        lines = []
    lines = [line for line in lines if line]
    errors = [line for line in lines if "error" in line.lower()]
    chosen = list(dict.fromkeys(errors[:1] + lines[-1:]))
    return " / ".join(chosen) or f"exit code {returncode}"


def build_environment() -> dict[str, str]:
    """This process's environment with `ninja` findable: torch's builder runs it from PATH,
    so the `ninja` package's directory and this interpreter's (a virtual environment's bin,
    where pip put it) go first, for a node started without activating its environment."""
    directories = [str(Path(sys.executable).parent)]
    try:
        import ninja

        directories.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    path = os.environ.get("PATH", "").split(os.pathsep)
    missing = [directory for directory in directories if directory not in path]
    return {**os.environ, "PATH": os.pathsep.join([*missing, *path])}
