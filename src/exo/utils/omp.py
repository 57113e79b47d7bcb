"""The OpenMP settings a node gives its runners."""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from pathlib import Path

# How long (busy-wait iterations) an idle intra-op thread of libgomp (torch's OpenMP on
# Linux) spins before it sleeps; libgomp's manual gives 300,000 as the default. Between two
# decode steps (sampling, the pipe to the node: ~0.1-0.3 ms) a thread spinning that long
# keeps a core the node's API process and the client need for the token just made; one
# that sleeps must be woken for the next parallel region, which on a VM whose idle vCPU
# halts goes through the hypervisor. Which costs more was measured per CPU maker (2-core
# VMs, `exo bench --engine-in-process`, interleaved run by run; these VMs' speed moves
# between minutes, so each figure is one A/B pair of runs):
# - AMD EPYC (Zen 3), SmolLM2-135M: API streaming decode 0.89-0.93x of the engine's
#   in-process rate with the default, 0.95-0.96x with 20,000; the engine's own rate
#   unchanged. So `SPIN_COUNT` there.
# - Intel Xeon (2026-12-03, the AMX machine), Gemma 3 270M at 128 tokens: API TTFT
#   1.01x / 1.05x of the engine's with the default against 1.08x / 1.28x with 20,000, API
#   decode 1.01x / 0.95x against 0.98x / 0.91x. So libgomp's default there (and elsewhere).
SPIN_COUNT = 20_000
SHORT_SPIN_VENDORS = frozenset({"AuthenticAMD"})


def cpu_vendor(cpuinfo: Path = Path("/proc/cpuinfo")) -> str | None:
    """The CPU maker's id string (`vendor_id` of /proc/cpuinfo: "GenuineIntel",
    "AuthenticAMD"), or None where the file has none (not Linux x86)."""
    try:
        text = cpuinfo.read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("vendor_id"):
            return line.split(":", 1)[1].strip() or None
    return None


def limit_thread_spinning(
    environ: MutableMapping[str, str] | None = None, vendor: str | None = None
) -> None:
    """On CPUs of `SHORT_SPIN_VENDORS` (default: this machine's `cpu_vendor`), set
    `GOMP_SPINCOUNT` to `SPIN_COUNT` in `environ` (default: `os.environ`) for the processes
    started from it afterwards (a node's runners; libgomp reads it when it starts); a value
    the user already set is kept, and elsewhere libgomp's default stays."""
    target = os.environ if environ is None else environ
    if (vendor if vendor is not None else cpu_vendor()) in SHORT_SPIN_VENDORS:
        target.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
