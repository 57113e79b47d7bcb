"""Test ports: outside the kernel's ephemeral range, never handed out twice, in this
process or another one running at the same time."""

from __future__ import annotations

import socket
import subprocess
import sys

from exo.testing.ports import LOCK_DIRECTORY, candidate_ports, ephemeral_range, free_port

# Both children start from the same candidate port, so only the cross-process locks keep
# their ports apart.
CHILD = """
import sys
from exo.testing import ports
ports.os.getpid = lambda: 1
free_port = ports.free_port
print(" ".join(str(free_port()) for _ in range(20)), flush=True)
sys.stdin.read()  # hold the reservations until the parent is done
"""


def test_ports_are_outside_the_ephemeral_range_and_bindable() -> None:
    low, high = ephemeral_range()
    ports = [free_port() for _ in range(20)]
    assert len(set(ports)) == 20
    if len([p for p in candidate_ports() if not low <= p <= high]) >= 1000:
        assert not any(low <= port <= high for port in ports), (ports, low, high)
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.bind(("127.0.0.1", port))
            server.listen()
        assert (LOCK_DIRECTORY / f"{port}.lock").is_file()


def test_processes_running_at_once_get_disjoint_ports() -> None:
    children = [
        subprocess.Popen(
            [sys.executable, "-c", CHILD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    try:
        seen = [{int(port) for port in child.stdout.readline().split()} for child in children]  # type: ignore[union-attr]
        mine = {free_port() for _ in range(20)}
    finally:
        for child in children:
            child.communicate(timeout=30)
    assert [len(ports) for ports in seen] == [20, 20]
    assert not seen[0] & seen[1] and not mine & (seen[0] | seen[1])
