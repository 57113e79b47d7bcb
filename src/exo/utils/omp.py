"""The OpenMP settings a node gives its runners."""

from __future__ import annotations

import os
from collections.abc import MutableMapping

# How long (busy-wait iterations) an idle intra-op thread of libgomp (torch's OpenMP on
# Linux) spins before it sleeps. libgomp's manual gives 300,000 as the default; between two
# decode steps (sampling, the pipe to the node: ~0.1-0.3 ms) a thread spinning that long
# keeps a core the node's API process and the client need for the token just made. Measured
# on a 2-core AMD EPYC with SmolLM2-135M (`exo bench --engine-in-process`): API streaming
# decode 0.89-0.93x of the engine's in-process rate with the default, 0.95-0.96x with
# 20,000; the engine's own rate unchanged (inside a step, parallel regions follow each other
# within microseconds, well inside the shorter spin).
SPIN_COUNT = 20_000


def limit_thread_spinning(environ: MutableMapping[str, str] | None = None) -> None:
    """Set `GOMP_SPINCOUNT` to `SPIN_COUNT` in `environ` (default: `os.environ`) for the
    processes started from it afterwards (a node's runners; libgomp reads it when it
    starts); a value the user already set is kept."""
    target = os.environ if environ is None else environ
    target.setdefault("GOMP_SPINCOUNT", str(SPIN_COUNT))
