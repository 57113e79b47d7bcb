"""Chaos: the models disk fills during a download. The models directory is a tmpfs the
scenario mounts (and always unmounts) with room for the model and the node's free-space
margin, so the download starts; when the Hub stand-in is first asked for a weight file, a
filler file takes all but `LEFT_FREE_BYTES` of the disk, so the write runs out of space
mid-file. The download must fail with a clear error in the state, no runner may load the
model, and no file may sit under its final name unless it is complete and verified. Once
the filler is deleted, the download is started again and completes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from starlette.responses import Response

from exo.testing.hf_file_serving import FileRequest
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.processes import ExoNode, wait_until
from tests.chaos.harness import Row
from tests.test_cluster import running

REPO = "someone/tiny-chaos"
DIRECTORY = "someone--tiny-chaos"
FAIL_SECONDS = 180.0
DISK_BYTES = 96 * 2**20  # the model (~1 MB) and the node's free-space margin (0.06 GiB)
LEFT_FREE_BYTES = 4096  # less than any weight file (the smallest is ~16 KB)


def fill_disk_on_first_weight_file(disk: Path) -> Callable[[FileRequest], Response | None]:
    """A Hub hook: before the first weight file is served, write `disk/filler` until only
    `LEFT_FREE_BYTES` stay free; lets every request through."""
    filled = threading.Event()

    def hook(file_request: FileRequest) -> Response | None:
        weights = file_request.file.path.endswith(".safetensors")
        if file_request.method == "GET" and weights and not filled.is_set():
            filled.set()
            stats = os.statvfs(disk)
            free = stats.f_bavail * stats.f_frsize
            (disk / "filler").write_bytes(b"\0" * max(0, free - LEFT_FREE_BYTES))
        return None

    return hook


@contextmanager
def small_tmpfs(directory: Path, size_bytes: int) -> Iterator[Path]:
    """A tmpfs of `size_bytes` mounted at `directory` for the block's duration."""
    directory.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "exo-chaos", str(directory)],
        check=True,
    )
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def _download(node: ExoNode) -> dict[str, Any] | None:
    status: dict[str, Any] | None = (
        node.state()["downloads"].get(node.node_id(), {}).get(REPO)
    )  # fmt: skip
    return status


def models_disk_full_during_download(root: Path, models: Path) -> Row:
    """`models` is unused: the node's models directory is the small tmpfs."""
    row = Row("fill the models disk during a download")
    checkout = save_layered_checkout(root / "checkout")
    files = {p.name: p.read_bytes() for p in checkout.iterdir() if p.is_file()}
    with HubServer() as hub, small_tmpfs(root / "models-tmpfs", DISK_BYTES) as disk:
        hub.add_directory(REPO, checkout)
        hub.hooks.append(fill_disk_on_first_weight_file(disk))
        node = ExoNode(
            root / "node",
            disk,
            ("--no-default-model",),
            env={"HF_ENDPOINT": hub.url, "HF_HUB_OFFLINE": "0", "HF_HUB_DISABLE_TELEMETRY": "1"},
        )
        with running([node]):
            added = httpx.post(f"{node.url}/models/add", json={"model_id": REPO}, timeout=60)
            assert added.status_code == 200, added.text
            placed = httpx.post(f"{node.url}/place_instance", json={"model_id": REPO}, timeout=60)
            assert placed.status_code == 200, placed.text
            started = time.monotonic()
            failed = wait_until(
                lambda: (_download(node) or {}).get("kind") == "DownloadFailed" and _download(node),
                FAIL_SECONDS,
                what="the download failing",
            )
            row.recovery_s = time.monotonic() - started
            message = failed["error_message"]
            row.note(f"download failed after {row.recovery_s:.1f} s: {message}")
            assert "space" in message.lower(), message
            time.sleep(3.0)  # room for a wrongly started load to show
            state = node.state()
            loaded = [
                (runner_id, status["kind"])
                for runner_id, status in state["runners"].items()
                if status["kind"] in ("RunnerLoaded", "RunnerReady", "RunnerRunning")
            ]
            assert loaded == [], loaded
            assert node.process is not None and node.process.poll() is None
            stored = disk / DIRECTORY
            present = sorted(p.name for p in stored.rglob("*") if p.is_file())
            row.note(f"on the full disk: {present}")
            for path in stored.rglob("*"):
                if path.is_file() and path.name in files:  # under its final name: complete
                    assert (
                        hashlib.sha256(path.read_bytes()).digest()
                        == hashlib.sha256(files[path.name]).digest()
                    ), f"{path.name} is half-written under its final name"
            # Room again: the download is started again and completes, verified.
            (disk / "filler").unlink()
            again = httpx.post(f"{node.url}/download/start", json={"model": REPO}, timeout=30)
            assert again.status_code == 200, again.text
            freed = time.monotonic()
            wait_until(
                lambda: (_download(node) or {}).get("kind") == "DownloadCompleted",
                FAIL_SECONDS,
                what="the download completing once there is room",
            )
            row.note(f"completed {time.monotonic() - freed:.1f} s after the disk was freed")
            for name, data in files.items():
                stored_file = stored / name
                if stored_file.exists():
                    assert stored_file.read_bytes() == data, name
    return row
