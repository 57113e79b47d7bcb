"""What a node reports about itself, and which changes are worth an event."""

from __future__ import annotations

import socket
from pathlib import Path

import psutil
import pytest

from exo.node import info_gatherer
from exo.node.info_gatherer import (
    CPU_CHANGE_REPORT_PERCENT,
    DISK_CHANGE_REPORT_BYTES,
    HEARTBEAT_SECONDS,
    LOAD_REPORT_SECONDS,
    MEMORY_CHANGE_REPORT_BYTES,
    MISSING_RESEND_SECONDS,
    _significant_change,
    api_addresses,
    gather_node_info,
    memory_info,
    report_due,
)
from exo.shared.types.nodes import MemoryInfo, NetworkInterface, NodeInfo

MIB = 2**20
INTERFACES = (
    NetworkInterface(name="eth0", addresses=("10.0.0.5", "10.0.0.6")),
    NetworkInterface(name="lo", addresses=("127.0.0.1",)),
)


@pytest.mark.parametrize("host", ["0.0.0.0", ""])
def test_api_on_all_interfaces_is_reachable_on_every_address(host: str) -> None:
    assert api_addresses(host, INTERFACES) == ("10.0.0.5", "10.0.0.6", "127.0.0.1")
    assert api_addresses(host, ()) == ()


@pytest.mark.parametrize("host", ["10.0.0.6", "127.0.0.1", "192.168.7.7"])
def test_api_bound_to_one_host_is_reachable_there_only(host: str) -> None:
    assert api_addresses(host, INTERFACES) == (host,)


def test_override_memory_replaces_the_available_figure(monkeypatch: pytest.MonkeyPatch) -> None:
    # Children of the test process (other tests' nodes, browsers) would count against it.
    monkeypatch.setattr(info_gatherer, "_children_resident_bytes", lambda: 0)
    monkeypatch.delenv("OVERRIDE_MEMORY_MB", raising=False)
    real = memory_info()
    assert 0 < real.available_bytes <= real.total_bytes
    monkeypatch.setenv("OVERRIDE_MEMORY_MB", "512")
    small = memory_info()
    assert small.available_bytes == 512 * MIB
    assert small.total_bytes >= real.total_bytes - 64 * MIB
    # More than the machine has: the total grows with it, so available <= total holds.
    huge_mb = psutil.virtual_memory().total // MIB * 4
    monkeypatch.setenv("OVERRIDE_MEMORY_MB", str(huge_mb))
    huge = memory_info()
    assert huge.available_bytes == huge_mb * MIB
    assert huge.total_bytes == huge.available_bytes


def test_gather_node_info_reports_this_machine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(info_gatherer, "_children_resident_bytes", lambda: 0)
    monkeypatch.setenv("OVERRIDE_MEMORY_MB", "1024")
    info = gather_node_info("127.0.0.1", 52415, tmp_path)
    assert info.friendly_name == socket.gethostname()
    assert info.memory.available_bytes == 1024 * MIB
    assert info.cpu_cores == psutil.cpu_count(logical=True)
    assert info.cpu_model
    assert info.models_disk_free_bytes > 0
    assert info.api_port == 52415
    assert info.api_addresses == ("127.0.0.1",)
    assert not info.offline
    assert gather_node_info("127.0.0.1", 52415, tmp_path, offline=True).offline
    assert all(interface.addresses for interface in info.network_interfaces)
    assert all(gpu.total_memory_bytes > 0 for gpu in info.gpus)
    # It crosses the wire as is.
    assert NodeInfo.model_validate_json(info.model_dump_json()) == info


def test_gather_on_all_interfaces_lists_every_interface_address() -> None:
    info = gather_node_info("0.0.0.0", 52415, None)
    assert info.models_disk_free_bytes == 0
    assert info.api_addresses == tuple(
        address for interface in info.network_interfaces for address in interface.addresses
    )
    assert "127.0.0.1" in info.api_addresses


def test_missing_models_directory_reports_no_free_space(tmp_path: Path) -> None:
    info = gather_node_info("127.0.0.1", 1, tmp_path / "does" / "not" / "exist")
    assert info.models_disk_free_bytes == 0


BASE = NodeInfo(
    friendly_name="n",
    memory=MemoryInfo(total_bytes=64 * 2**30, available_bytes=32 * 2**30),
    models_disk_free_bytes=100 * 2**30,
    api_port=52415,
    api_addresses=("10.0.0.5",),
)


def memory_moved(by: int) -> NodeInfo:
    available = BASE.memory.available_bytes + by
    return BASE.model_copy(
        update={"memory": BASE.memory.model_copy(update={"available_bytes": available})}
    )


def disk_moved(by: int) -> NodeInfo:
    return BASE.model_copy(update={"models_disk_free_bytes": BASE.models_disk_free_bytes + by})


@pytest.mark.parametrize(
    ("new", "expected"),
    [
        (BASE, False),
        (memory_moved(MEMORY_CHANGE_REPORT_BYTES - 1), False),
        (memory_moved(-MEMORY_CHANGE_REPORT_BYTES + 1), False),
        (memory_moved(MEMORY_CHANGE_REPORT_BYTES), True),
        (memory_moved(-MEMORY_CHANGE_REPORT_BYTES), True),
        (disk_moved(-DISK_CHANGE_REPORT_BYTES + 1), False),
        (disk_moved(DISK_CHANGE_REPORT_BYTES - 1), False),
        (disk_moved(-DISK_CHANGE_REPORT_BYTES), True),
        # Anything but the moving figures is always news.
        (BASE.model_copy(update={"api_addresses": ("10.0.0.6",)}), True),
        (BASE.model_copy(update={"api_port": 1}), True),
        (BASE.model_copy(update={"cpu_cores": 2}), True),
        (BASE.model_copy(update={"friendly_name": "m"}), True),
        # CPU load alone is rate-limited apart (`report_due`).
        (BASE.model_copy(update={"cpu_percent": 100.0}), False),
    ],
)
def test_only_significant_changes_are_reported(new: NodeInfo, expected: bool) -> None:
    assert _significant_change(BASE, new) is expected


def cpu_at(percent: float) -> NodeInfo:
    return BASE.model_copy(update={"cpu_percent": percent})


@pytest.mark.parametrize(
    ("new", "seconds_since_sent", "missing", "expected"),
    [
        (BASE, 0.0, False, False),
        (BASE, HEARTBEAT_SECONDS, False, True),
        (BASE, MISSING_RESEND_SECONDS - 0.1, True, False),
        (BASE, MISSING_RESEND_SECONDS, True, True),
        (memory_moved(MEMORY_CHANGE_REPORT_BYTES), 0.0, False, True),
        # A load move is reported, but not more often than every LOAD_REPORT_SECONDS.
        (cpu_at(CPU_CHANGE_REPORT_PERCENT), LOAD_REPORT_SECONDS, False, True),
        (cpu_at(CPU_CHANGE_REPORT_PERCENT), LOAD_REPORT_SECONDS - 0.1, False, False),
        (cpu_at(CPU_CHANGE_REPORT_PERCENT - 0.1), LOAD_REPORT_SECONDS * 10, False, False),
    ],
)
def test_reports_are_due_on_change_heartbeat_absence_and_rate_limited_load(
    new: NodeInfo, seconds_since_sent: float, missing: bool, expected: bool
) -> None:
    assert report_due(BASE, new, seconds_since_sent, missing) is expected
    assert report_due(None, new, 0.0, False)  # the first report is always due


def test_load_and_disk_size_are_reported(tmp_path: Path) -> None:
    info = gather_node_info("127.0.0.1", 52415, tmp_path)
    assert 0.0 <= info.cpu_percent <= 100.0
    assert info.models_disk_total_bytes >= info.models_disk_free_bytes > 0
    missing = gather_node_info("127.0.0.1", 52415, tmp_path / "absent")
    assert (missing.models_disk_free_bytes, missing.models_disk_total_bytes) == (0, 0)


def test_override_memory_counts_what_the_node_s_runners_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A capped node's reported memory drops by its children's RSS, as real memory would."""
    import subprocess
    import sys
    import time

    monkeypatch.setenv("OVERRIDE_MEMORY_MB", "4096")
    alone = memory_info().available_bytes
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; block = bytearray(300 * 2**20); time.sleep(60)"]
    )
    try:
        deadline = time.monotonic() + 30
        held = 0
        while time.monotonic() < deadline:
            held = psutil.Process(child.pid).memory_info().rss
            if held > 300 * MIB:
                break
            time.sleep(0.05)
        assert held > 300 * MIB, "the child never held its 300 MiB"
        with_child = memory_info().available_bytes
        assert alone - with_child > 300 * MIB
        assert with_child >= 0
        monkeypatch.setenv("OVERRIDE_MEMORY_MB", "100")
        assert memory_info().available_bytes == 0  # the child holds more than the cap
    finally:
        child.kill()
        child.wait(10)
