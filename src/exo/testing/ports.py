"""Loopback ports for tests that start servers in other processes.

Asking the kernel for a free port (bind to port 0, close, hand the number on) races: until
the server binds it, the port is free again, and the kernel hands ports of its ephemeral
range to every outgoing connection (an HTTP client, a zenoh link, gloo) of every process on
the machine, and to the next `bind(0)`, possibly in a test running in parallel. A port from
`free_port` cannot be taken that way:

- it lies outside the kernel's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`),
  so no connection and no `bind(0)` is given it;
- it is reserved across processes by an exclusive `flock` on a file named after it, held
  until this process exits, so concurrent test runs on one machine never share a port;
- this process never hands it out twice;
- it is free when handed out (a trial bind on 127.0.0.1, TCP and UDP).
"""

from __future__ import annotations

import fcntl
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import IO

# Ports below this are often taken by system services; the kernel's default ephemeral
# range (Linux: 32768-60999) starts above it.
LOWEST_PORT = 20000
HIGHEST_PORT = 65535
# When the ephemeral range leaves fewer ports than this outside it, ports inside it are
# used too (still reserved across processes, and checked free).
MIN_OUTSIDE_PORTS = 1000
LOCK_DIRECTORY = Path(tempfile.gettempdir()) / "exo-test-ports"

_lock = threading.Lock()
_held: dict[int, IO[bytes]] = {}
_next_index = 0


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range of automatically assigned local ports, inclusive (Linux's
    default when `/proc` does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def candidate_ports() -> list[int]:
    """The ports `free_port` chooses from, in the order it tries them."""
    low, high = ephemeral_range()
    outside = [port for port in range(LOWEST_PORT, HIGHEST_PORT + 1) if not low <= port <= high]
    if len(outside) >= MIN_OUTSIDE_PORTS:
        return outside
    return list(range(LOWEST_PORT, HIGHEST_PORT + 1))


def _bindable(port: int) -> bool:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        with socket.socket(socket.AF_INET, kind) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                return False
    return True


def _reserve(port: int) -> bool:
    """Take the cross-process lock of `port` (kept until the process exits)."""
    LOCK_DIRECTORY.mkdir(parents=True, exist_ok=True)
    handle = (LOCK_DIRECTORY / f"{port}.lock").open("ab")
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return False
    _held[port] = handle
    return True


def free_port() -> int:
    """A loopback port (TCP and UDP free on 127.0.0.1) that no other caller, in this
    process or another, is given while this process lives, and that the kernel does not
    assign to connections (see the module docstring).

    Candidates are tried from an offset derived from the process id, so parallel runs
    seldom contend for the same lock files.

    Raises:
        RuntimeError: every candidate port is taken.
    """
    global _next_index
    candidates = candidate_ports()
    with _lock:
        start = (os.getpid() * 7919) % len(candidates)
        for step in range(len(candidates)):
            port = candidates[(start + _next_index + step) % len(candidates)]
            if port in _held or not _bindable(port) or not _reserve(port):
                continue
            if not _bindable(port):  # taken between the check and the lock
                continue
            _next_index += step + 1
            return port
    raise RuntimeError(f"no free port in {LOWEST_PORT}-{HIGHEST_PORT} on 127.0.0.1")
