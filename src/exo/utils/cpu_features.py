"""What this machine's CPU can do, from /proc/cpuinfo (no torch import: the CLI reads it)."""

from __future__ import annotations

import functools
from pathlib import Path

from exo.shared.models.memory import PrefillActivations

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


def default_prefill_activations(flags: frozenset[str] | None = None) -> PrefillActivations:
    """`--prefill-activations`' default on a CPU with `flags` (default: this one's): "bf16"
    where AMX-BF16 runs prefill (`AMX_BF16_FLAGS`), else "int16". bf16 multiplied Gemma 3
    270M's and SmolLM2-135M's 128-512-row int4 products ~2x as fast as int16 on a 2-core
    Xeon with AMX, for a KL of ~2e-4 from int16's next-token distributions (docs/engine.md,
    "Prefill activations")."""
    return "bf16" if (cpu_flags() if flags is None else flags) >= AMX_BF16_FLAGS else "int16"
