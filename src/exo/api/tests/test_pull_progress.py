"""Ollama's pull lines made from a Hub download's progress."""

from __future__ import annotations

from exo.api.routes.ollama_files import pull_progress_lines
from exo.shared.types.downloads import DownloadProgress, FileProgress

WEIGHTS_SHA256 = "ab" * 32


def test_each_file_is_one_pulling_line_with_its_digest_and_bytes() -> None:
    progress = DownloadProgress(
        downloaded_bytes=1500,
        total_bytes=5000,
        speed_bytes_per_second=100.0,
        eta_seconds=35.0,
        files=(
            FileProgress(path="config.json", downloaded_bytes=500, total_bytes=500),
            FileProgress(
                path="model.safetensors",
                downloaded_bytes=1000,
                total_bytes=4500,
                sha256=WEIGHTS_SHA256,
            ),
        ),
    )
    lines = [line.model_dump(exclude_none=True) for line in pull_progress_lines(progress)]
    assert lines == [
        {"status": "pulling config.json", "total": 500, "completed": 500},
        {
            "status": f"pulling {WEIGHTS_SHA256[:12]}",
            "digest": f"sha256:{WEIGHTS_SHA256}",
            "total": 4500,
            "completed": 1000,
        },
    ]
