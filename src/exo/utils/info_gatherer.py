"""Periodically reports this node's resources as `NodeGatheredInfo` local events."""

from __future__ import annotations

import os
import platform
import socket

import anyio
import psutil

from exo.shared.local_events import LocalEventSender
from exo.shared.types.events import NodeGatheredInfo
from exo.shared.types.nodes import MemoryInfo, NodeInfo

GATHER_INTERVAL_SECONDS = 2.0
# Memory moves all the time; only a change this large (or the heartbeat) is worth an event.
MEMORY_CHANGE_REPORT_BYTES = 256 * 2**20
HEARTBEAT_SECONDS = 60.0


def memory_info() -> MemoryInfo:
    """Total and available RAM in bytes. `OVERRIDE_MEMORY_MB` (tests, capping what exo may
    use) replaces the available figure, and the total when larger."""
    virtual = psutil.virtual_memory()
    total, available = int(virtual.total), int(virtual.available)
    override = os.environ.get("OVERRIDE_MEMORY_MB")
    if override:
        available = int(float(override) * 2**20)
        total = max(total, available)
    return MemoryInfo(total_bytes=total, available_bytes=available)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gather_node_info() -> NodeInfo:
    return NodeInfo(
        friendly_name=socket.gethostname(),
        memory=memory_info(),
        cpu_model=cpu_model(),
        cpu_cores=psutil.cpu_count(logical=True) or 1,
    )


class InfoGatherer:
    def __init__(self, local_events: LocalEventSender) -> None:
        self._local_events = local_events

    async def run(self) -> None:
        last: NodeInfo | None = None
        last_sent = 0.0
        while True:
            info = await anyio.to_thread.run_sync(gather_node_info)
            now = anyio.current_time()
            if (
                last is None
                or abs(info.memory.available_bytes - last.memory.available_bytes)
                >= MEMORY_CHANGE_REPORT_BYTES
                or now - last_sent >= HEARTBEAT_SECONDS
            ):
                self._local_events.emit(
                    NodeGatheredInfo(node_id=self._local_events.node_id, info=info)
                )
                last, last_sent = info, now
            await anyio.sleep(GATHER_INTERVAL_SECONDS)
