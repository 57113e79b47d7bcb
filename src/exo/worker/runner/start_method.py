"""How a node starts its runner processes: forked from a warm server, not spawned cold.

A runner spawned afresh (`multiprocessing`'s "spawn") imports torch, transformers and the
engine before it can read a task: about 7 s of one core on the 2-core reference machine,
several times that on a loaded one (the figures: docs/testing.md, "Runner start-up"). Every
runner a node starts pays it again: each placement, and each recovery after a runner died
or its instance was placed again.

So a node starts its runners through `multiprocessing`'s "forkserver": one server process,
started from the node (`start_runner_server`, when the node starts), imports the runner's
modules once (`RUNNER_PRELOAD`), and each runner is a fork of that warm interpreter.
What a runner gets is what a spawned one got:

- Its environment. The server is started from the node's environment after
  `prepare_runner_environment` set the runners' variables in it, so the libraries that
  read variables when they load (libgomp's `OMP_*` and `GOMP_SPINCOUNT`, glibc's
  `GLIBC_TUNABLES`) load in the server with the runners' values, and oneDNN's caches,
  read at first use, are read in the runner. Should the node's environment differ later
  from the one its server started with (a caller changed `os.environ`), that runner is
  spawned instead (`runner_context`), with the environment of the moment.
- Its threads. The server runs no torch operator, so it has no OpenMP team for the fork
  to lose; OpenBLAS's thread servers (numpy's and scipy's, started at import) stop before
  a fork and start again after it (their own `pthread_atfork` handlers). The runner sets
  its thread count after the fork, as before (`model.loading`).
- Dying with the node. A forked runner's parent is the server, which ends when the node
  does, however the node ends: it waits on a pipe whose write end only the node holds
  (each runner drops its copy first thing, `leave_runner_server`). A runner dies with its
  parent (`PR_SET_PDEATHSIG`, `process.py`), so with the node.
- Its death read as EOF. The server closes its copies of a runner's pipes once it has
  forked it, as a spawned runner's pipes were closed in the node: the runner's end is held
  by the runner alone.

`EXO_RUNNER_START=spawn` starts every runner spawned, as before (a fallback, and what
the measurements compare with). The server costs memory while the node runs: an idle
interpreter that imported torch and the engine (its private part, ~0.3-0.4 GiB, is what a
spawned runner also held on its own; a forked runner shares it until written).
"""

from __future__ import annotations

import multiprocessing
import os
import threading
from collections.abc import MutableMapping
from multiprocessing import forkserver
from multiprocessing.context import ForkServerContext, SpawnContext
from typing import Any

from loguru import logger

from exo.utils.heap import advise_huge_pages, bound_kernel_caches
from exo.utils.omp import limit_thread_spinning

START_METHOD_ENV = "EXO_RUNNER_START"
"""`spawn` starts runners afresh instead of forking them from the node's runner server."""

# What the server imports once for every runner: `__main__` (multiprocessing's own default:
# the node's entry script, which a runner otherwise imports after the fork) and the runner's
# entry module, which imports the engine (torch, transformers and exo's engine modules).
RUNNER_PRELOAD = ["__main__", "exo.worker.runner.process"]

_lock = threading.Lock()
_server_environment: dict[str, str] | None = None
_server_failed = False


def prepare_runner_environment(environ: MutableMapping[str, str] | None = None) -> None:
    """Set in `environ` (default: `os.environ`) what a node's runners need before they
    start: bounded per-shape kernel caches, intra-op threads that stop spinning soon after
    a step where that measured better, weights on huge pages where the kernel gives them
    only when asked. Each keeps a value the user set, so calling it again changes nothing."""
    bound_kernel_caches(environ)
    limit_thread_spinning(environ)
    advise_huge_pages(environ)


def forking_enabled(environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether runners are forked from the runner server (not `EXO_RUNNER_START=spawn`)."""
    return (os.environ if environ is None else environ).get(START_METHOD_ENV) != "spawn"


def runner_context() -> ForkServerContext | SpawnContext:
    """The `multiprocessing` context to start a runner with: "forkserver", its server
    running (started now with the runners' environment if it is not), or "spawn" where
    forking is off, the server failed (`runner_server_failed`) or the node's environment is
    no longer the one its server started with.

    Blocks only to start the server (a process spawn, not its imports); the first fork
    request waits for the server's imports.
    """
    global _server_environment
    prepare_runner_environment()
    if not forking_enabled() or _server_failed:
        return spawn_context()
    with _lock:
        environment = dict(os.environ)
        if _server_environment is None:
            _server_environment = environment
        elif environment != _server_environment:
            changed = sorted(
                name
                for name in environment.keys() | _server_environment.keys()
                if environment.get(name) != _server_environment.get(name)
            )
            logger.info(
                "runner spawned: the environment changed since the runner server started "
                f"({', '.join(changed)})"
            )
            return spawn_context()
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload(RUNNER_PRELOAD)
        # Started (again, if it died) with the environment just compared.
        forkserver.ensure_running()
        return context


def runner_server_failed() -> None:
    """The runner server could not fork a runner (it died, or failed in its imports):
    this node's runners are spawned from now on."""
    global _server_failed
    _server_failed = True


def spawn_context() -> SpawnContext:
    """The context that starts a runner as a fresh interpreter (the runners' environment
    set first)."""
    prepare_runner_environment()
    return multiprocessing.get_context("spawn")


def start_runner_server() -> None:
    """Start the node's runner server now, so that its imports run while the node starts
    rather than when its first runner is wanted (nothing where forking is off)."""
    runner_context()


def leave_runner_server() -> None:
    """In a runner forked by the server: close the runner's copy of the descriptor that
    keeps the server alive, so that the server ends when the node does (and the runner
    with it) rather than when its last runner does. A runner starts no process through
    the server. Does nothing in a spawned runner."""
    if forkserver.get_inherited_fds() is None:
        return  # not started by a forkserver
    server: Any = forkserver._forkserver  # CPython's one server per process (3.8-3.14)
    descriptor = getattr(server, "_forkserver_alive_fd", None)
    if descriptor is not None:
        os.close(descriptor)
        server._forkserver_alive_fd = None
