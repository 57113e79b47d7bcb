"""Periodically reports this node's resources as `NodeGatheredInfo` local events."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import psutil
from loguru import logger

from exo.shared.local_events import LocalEventSender
from exo.shared.models.weight_formats import DEFAULT_PREFILL_ACTIVATIONS, PrefillActivations
from exo.shared.types.events import NodeGatheredInfo
from exo.shared.types.nodes import GpuInfo, MemoryInfo, NetworkInterface, NodeInfo, NodeSpeed
from exo.shared.types.state import State
from exo.utils.cpu_features import cpu_model

GATHER_INTERVAL_SECONDS = 2.0
# Memory moves all the time; only a change this large (or the heartbeat) is worth an event.
MEMORY_CHANGE_REPORT_BYTES = 256 * 2**20
DISK_CHANGE_REPORT_BYTES = 1024 * 2**20
# Liveness is the election heartbeat's job; this only refreshes figures now and then.
HEARTBEAT_SECONDS = 300.0
# CPU load is news for the dashboard, but every report is an event in the cluster's log: a
# move this large, at most this often (<= 360 events an hour per busy node).
CPU_CHANGE_REPORT_PERCENT = 25.0
LOAD_REPORT_SECONDS = 10.0
MISSING_RESEND_SECONDS = 5.0
# Speed figures measured on a busy machine: whether it is quiet now is checked this often,
# this many times (an hour), and when it is they are measured again.
SPEED_REMEASURE_SECONDS = 300.0
SPEED_REMEASURE_CHECKS = 12


def memory_info() -> MemoryInfo:
    """Total and available RAM in bytes.

    `OVERRIDE_MEMORY_MB` (tests, capping what exo may use) replaces the total when larger,
    and the available figure with the override less what this process's children (its
    runners) hold resident (RSS): as on real memory, a node's loaded runners use up what
    it reports, so placement cannot keep adding runners to a capped node once the first
    ones are ready. Never below 0."""
    virtual = psutil.virtual_memory()
    total, available = int(virtual.total), int(virtual.available)
    override = os.environ.get("OVERRIDE_MEMORY_MB")
    if override:
        cap = int(float(override) * 2**20)
        total = max(total, cap)
        available = max(0, cap - _children_resident_bytes())
    return MemoryInfo(total_bytes=total, available_bytes=available)


def _children_resident_bytes() -> int:
    """Resident bytes of every live descendant of this process (0 for one that exits while
    it is read)."""
    held = 0
    for child in psutil.Process().children(recursive=True):
        try:
            held += int(child.memory_info().rss)
        except psutil.Error:
            continue
    return held


def gpus() -> tuple[GpuInfo, ...]:
    """CUDA devices visible to torch (none on a CPU-only build)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    found = []
    for index in range(torch.cuda.device_count()):
        properties = torch.cuda.get_device_properties(index)
        found.append(GpuInfo(name=properties.name, total_memory_bytes=properties.total_memory))
    return tuple(found)


def network_interfaces() -> tuple[NetworkInterface, ...]:
    """IPv4 addresses of the interfaces that are up."""
    stats = psutil.net_if_stats()
    interfaces = []
    for name, addresses in sorted(psutil.net_if_addrs().items()):
        if name in stats and not stats[name].isup:
            continue
        ipv4 = tuple(a.address for a in addresses if a.family == socket.AF_INET)
        if ipv4:
            interfaces.append(NetworkInterface(name=name, addresses=ipv4))
    return tuple(interfaces)


def api_addresses(api_host: str, interfaces: tuple[NetworkInterface, ...]) -> tuple[str, ...]:
    """Where peers can reach this node's API: every interface address when it listens on
    all of them, else only the address it is bound to."""
    if api_host not in ("0.0.0.0", ""):
        return (api_host,)
    return tuple(address for interface in interfaces for address in interface.addresses)


def disk_usage_bytes(path: Path) -> tuple[int, int]:
    """(free, total) bytes of the file system holding `path`; (0, 0) when it is missing."""
    try:
        usage = shutil.disk_usage(path)
    except OSError:
        return 0, 0
    return int(usage.free), int(usage.total)


def cpu_percent() -> float:
    """How busy all cores were since the previous call (the first call: since the process
    started), 0-100 (psutil's `cpu_percent(interval=None)`)."""
    return min(100.0, max(0.0, float(psutil.cpu_percent(interval=None))))


def gather_node_info(
    api_host: str = "0.0.0.0",
    api_port: int = 0,
    models: Path | None = None,
    offline: bool = False,
    speed: NodeSpeed | None = None,
    prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
    kv_cache_tokens: int | None = None,
    draft_model: str | None = None,
    draft_on_spare: bool = True,
) -> NodeInfo:
    interfaces = network_interfaces()
    disk_free, disk_total = disk_usage_bytes(models) if models is not None else (0, 0)
    return NodeInfo(
        friendly_name=socket.gethostname(),
        memory=memory_info(),
        cpu_model=cpu_model(),
        cpu_cores=psutil.cpu_count(logical=True) or 1,
        gpus=gpus(),
        models_disk_free_bytes=disk_free,
        models_disk_total_bytes=disk_total,
        cpu_percent=round(cpu_percent(), 1),
        network_interfaces=interfaces,
        api_port=api_port,
        api_addresses=api_addresses(api_host, interfaces),
        offline=offline,
        speed=speed,
        prefill_activations=prefill_activations,
        kv_cache_tokens=kv_cache_tokens,
        draft_model=draft_model,
        draft_on_spare=draft_on_spare,
    )


def _significant_change(old: NodeInfo, new: NodeInfo) -> bool:
    moving = {
        "memory": new.memory,
        "models_disk_free_bytes": new.models_disk_free_bytes,
        "cpu_percent": new.cpu_percent,
    }
    if old.model_copy(update=moving) != new:
        return True
    memory_moved = abs(new.memory.available_bytes - old.memory.available_bytes)
    disk_moved = abs(new.models_disk_free_bytes - old.models_disk_free_bytes)
    return memory_moved >= MEMORY_CHANGE_REPORT_BYTES or disk_moved >= DISK_CHANGE_REPORT_BYTES


def _load_moved(old: NodeInfo, new: NodeInfo) -> bool:
    return abs(new.cpu_percent - old.cpu_percent) >= CPU_CHANGE_REPORT_PERCENT


def report_due(
    last: NodeInfo | None, info: NodeInfo, seconds_since_sent: float, missing: bool
) -> bool:
    """Whether `info` is worth an event, `seconds_since_sent` after `last` was reported:
    the first report, a significant change, a CPU load move (rate-limited), the
    heartbeat, or the state lacking this node (`missing`)."""
    if last is None or _significant_change(last, info):
        return True
    if _load_moved(last, info) and seconds_since_sent >= LOAD_REPORT_SECONDS:
        return True
    if missing and seconds_since_sent >= MISSING_RESEND_SECONDS:
        return True
    return seconds_since_sent >= HEARTBEAT_SECONDS


class InfoGatherer:
    """Reports this node's `NodeInfo` when it changes, when the cluster state lacks it (a
    node timed out after a network blip, a node that joined another history), and every
    `HEARTBEAT_SECONDS`. With `measure_speed` it measures the node's speed once in a worker
    thread (`exo.node.speed_probe.cached_node_speed`; `remeasure_speed` ignores the
    cache) and reports it with the next figures, once settled (`_probe_speed`), with how
    this node's runners round prefill's activations (`prefill_activations`, the node's
    `--prefill-activations`: which of its prefill figures a TTFT prediction reads)."""

    def __init__(
        self,
        local_events: LocalEventSender,
        api_host: str = "0.0.0.0",
        api_port: int = 0,
        models: Path | None = None,
        current_state: Callable[[], State] | None = None,
        offline: bool = False,
        measure_speed: bool = False,
        remeasure_speed: bool = False,
        prefill_activations: PrefillActivations = DEFAULT_PREFILL_ACTIVATIONS,
        kv_cache_tokens: int | None = None,
        draft_model: str | None = None,
        draft_on_spare: bool = True,
    ) -> None:
        self._local_events = local_events
        self._prefill_activations: PrefillActivations = prefill_activations
        self._kv_cache_tokens = kv_cache_tokens
        self._draft_model = draft_model
        self._draft_on_spare = draft_on_spare
        self._measure_speed = measure_speed
        self._remeasure_speed = remeasure_speed
        self._speed: NodeSpeed | None = None
        self._offline = offline
        self._current_state = current_state
        self._api_host = api_host
        self._api_port = api_port
        self._models = models

    def _missing_from_state(self) -> bool:
        if self._current_state is None:
            return False
        state = self._current_state()
        return state.history_id is not None and self._local_events.node_id not in state.node_info

    async def _probe_speed(self) -> None:
        """Measure (or read the cache); figures measured on a busy machine are measured again
        once it is quiet (checked every `SPEED_REMEASURE_SECONDS`, at most
        `SPEED_REMEASURE_CHECKS` times: a node busy serving is not disturbed), keeping each
        figure's best. Only settled figures are reported: a busy machine's can be ~80x too
        low, and previews would predict from them; until then the node reports no speed
        (previews predict nothing for it)."""
        from exo.node.speed_probe import ProbeStopped, cached_node_speed, machine_busy

        remeasure = self._remeasure_speed
        for check in range(1 + SPEED_REMEASURE_CHECKS):
            if check:
                await anyio.sleep(SPEED_REMEASURE_SECONDS)
                if machine_busy():
                    continue
            # A node stopping mid-probe abandons the thread and tells it to stop at its
            # next figure, so it neither logs nor caches after "exo stopped".
            stop = threading.Event()
            try:
                result = await anyio.to_thread.run_sync(
                    functools.partial(cached_node_speed, remeasure, stop=stop),
                    abandon_on_cancel=True,
                )
            except ProbeStopped:
                return
            except Exception as error:  # a failed probe leaves the speed as it was
                logger.warning(f"speed probe failed: {error!r}")
                return
            finally:
                stop.set()
            remeasure = False
            if result.settled:
                self._speed = result.speed
                return
        logger.warning(
            "speed probe: the machine stayed busy; this node reports no speed figures (no "
            "speed predictions) until it measures on a quiet machine (next start, or "
            "`exo --remeasure-speed`)"
        )

    async def run(self) -> None:
        async with anyio.create_task_group() as tasks:
            if self._measure_speed:
                tasks.start_soon(self._probe_speed)
            await self._report_loop()

    async def _report_loop(self) -> None:
        last: NodeInfo | None = None
        last_sent = 0.0
        while True:
            info = await anyio.to_thread.run_sync(
                gather_node_info,
                self._api_host,
                self._api_port,
                self._models,
                self._offline,
                self._speed,
                self._prefill_activations,
                self._kv_cache_tokens,
                self._draft_model,
                self._draft_on_spare,
            )
            now = anyio.current_time()
            if report_due(last, info, now - last_sent, self._missing_from_state()):
                self._local_events.emit(
                    NodeGatheredInfo(node_id=self._local_events.node_id, info=info)
                )
                last, last_sent = info, now
            await anyio.sleep(GATHER_INTERVAL_SECONDS)
