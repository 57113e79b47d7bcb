"""What this machine's CPU is and can do, from /proc/cpuinfo (no torch import: the CLI reads it).

On the ground floor: imports nothing of exo (`docs/architecture.md`, "Floors")."""

from __future__ import annotations

import functools
import platform
from pathlib import Path

# The flags prefill's AMX-BF16 product needs (native/prefill_bf16.cpp, built where all are
# present: Intel Sapphire Rapids and later; exposed by a VM only where the host lets it).
AMX_BF16_FLAGS = frozenset({"amx_bf16", "amx_tile", "avx512_bf16", "avx512vl"})


@functools.cache
def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first processor's `flags` (empty where the file or the line is missing)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


@functools.cache
def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The first processor's `model name` (`platform.processor()` or the machine's
    architecture where the file or the line is missing)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "model name":
            return value.strip()
    return platform.processor() or platform.machine()
