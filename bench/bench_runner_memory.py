"""Memory one runner process takes before any real model: the fixed part placement adds
per runner (`exo.shared.models.memory.RUNNER_PROCESS_OVERHEAD_BYTES`).

A fresh interpreter is started the way the supervisor starts a runner (`multiprocessing`
"spawn"), imports the runner module, then loads and warms up a tiny random Llama (2
layers, hidden size 64: its weights and KV cache are a few hundred KiB) with the engine
the runner uses. After each stage it reports its RSS and USS (`psutil`; USS is the memory
only this process holds: what each further runner on a node costs, the shared library
code counted once; anonymous is `RssAnon`, the part of it the kernel cannot drop under
pressure). Prints each stage in MiB and writes JSON (`--json`).

    python bench/bench_runner_memory.py [--repeats 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import tempfile
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

MIB = 2**20


def _anonymous_bytes() -> int:
    """`RssAnon` of /proc/self/status (Linux): private memory no other process shares and
    the kernel cannot drop under pressure (no swap); 0 where it is not reported."""
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return 0
    for line in status.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _sample() -> dict[str, int]:
    import psutil

    info = psutil.Process().memory_full_info()
    return {"rss": int(info.rss), "uss": int(info.uss), "anonymous": _anonymous_bytes()}


def _child(model_dir: str, out: Connection) -> None:
    stages: dict[str, dict[str, int]] = {"interpreter": _sample()}
    import exo.worker.runner.runner  # noqa: F401  (what the spawned runner imports)

    stages["runner imported"] = _sample()
    from exo.shared.models.cards import card_from_local_directory
    from exo.testing.builders import make_shard
    from exo.worker.engines.torch.engine_factory import load_engine

    shard = make_shard(card_from_local_directory(Path(model_dir)))
    engine = load_engine(Path(model_dir), shard)
    stages["tiny model loaded"] = _sample()
    engine.warmup()
    stages["warmed up"] = _sample()
    out.send(stages)
    out.close()


def measure(repeats: int) -> dict[str, Any]:
    from exo.testing.tiny_models import save_tiny_checkout

    context = multiprocessing.get_context("spawn")
    runs: list[dict[str, dict[str, int]]] = []
    with tempfile.TemporaryDirectory() as directory:
        model_dir = save_tiny_checkout(Path(directory) / "tiny")
        for _ in range(repeats):
            read, write = context.Pipe(duplex=False)
            process = context.Process(target=_child, args=(str(model_dir), write))
            process.start()
            write.close()
            if not read.poll(600):
                process.kill()
                raise RuntimeError("the runner process did not report within 600 s")
            runs.append(read.recv())
            process.join(60)
    stages = list(runs[0])
    return {
        "repeats": repeats,
        "stages_mib": {
            stage: {
                kind: statistics.median(run[stage][kind] for run in runs) / MIB
                for kind in ("rss", "uss", "anonymous")
            }
            for stage in stages
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = measure(args.repeats)
    for stage, figures in result["stages_mib"].items():
        print(
            f"{stage:>20}: RSS {figures['rss']:7.1f} MiB   USS {figures['uss']:7.1f} MiB   "
            f"anonymous {figures['anonymous']:7.1f} MiB"
        )
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
