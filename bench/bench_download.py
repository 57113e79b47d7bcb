"""Hub download throughput on loopback: a repository of random weight files served by the
loopback Hub server (`exo.testing.hf_server`), fetched by `download_from_hub` (4 files in
parallel, verified), printed as MB/s.

Usage: python bench/bench_download.py [--files 4] [--file-mb 64]

Not measured yet: the peer transfer and the time from `exo` start to the first token of a
model fetched from a peer (peer-to-peer transfer is not built).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from exo.download.hub_download import HubDownload, download_from_hub
from exo.testing.hf_server import HubServer

REPO = "bench/random-weights"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    files = {
        f"model-{index + 1:05d}-of-{args.files:05d}.safetensors": os.urandom(args.file_mb * 2**20)
        for index in range(args.files)
    }
    files["config.json"] = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()
    total = sum(len(data) for data in files.values())
    with HubServer() as hub, tempfile.TemporaryDirectory(prefix="exo-bench-") as scratch:
        hub.add_repository(REPO, files)
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        for run in range(args.runs):
            directory = Path(scratch) / f"run-{run}"
            started = time.perf_counter()
            download_from_hub(HubDownload(REPO, REPO, "main", None, directory))
            seconds = time.perf_counter() - started
            print(
                f"hub download (loopback, verified, {args.files} x {args.file_mb} MiB): "
                f"{total / 1e6:.0f} MB in {seconds:.2f} s = {total / 1e6 / seconds:.0f} MB/s"
            )


if __name__ == "__main__":
    main()
