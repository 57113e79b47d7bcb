"""One preparation of a model's files at a time, and no removal during one.

Every writer of a model's directory (a pull through the Ollama API, the worker's download,
a load that converts a GGUF) goes through `prepare_model`, which holds the model's lock;
`delete_downloaded_model` takes it too. Without it, two pulls of the same model wrote the
same `.partial` files and one answered 500 when the other renamed them away, and a delete
removed files a download was still verifying (both found by the long fuzz).

The lock is `fcntl.flock` on `<temp dir>/exo-model-locks-<uid>/<models dir hash>-<model
directory name>.lock` (outside the models directory, which must not gain entries or be
created by a lookup), so it also holds between processes sharing a models directory (two
nodes on one machine); it is released when its holder exits, even by SIGKILL. Where no lock
file can be made, nothing is locked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

POLL_SECONDS = 0.1


class ModelBusyError(RuntimeError):
    """The model's files are being prepared by someone else (and the caller would not wait
    longer)."""


def lock_path(models_dir: Path, directory_name: str) -> Path:
    """The lock file of model `directory_name` under `models_dir` (its directory made)."""
    locks = Path(tempfile.gettempdir()) / f"exo-model-locks-{os.getuid()}"
    locks.mkdir(mode=0o700, exist_ok=True)
    where = hashlib.sha256(str(models_dir.expanduser().resolve()).encode()).hexdigest()[:16]
    return locks / f"{where}-{directory_name}.lock"


@contextlib.contextmanager
def model_lock(
    models_dir: Path,
    directory_name: str,
    wait_s: float | None = None,
    cancelled: threading.Event | None = None,
) -> Iterator[None]:
    """Hold the exclusive lock on the model stored as `directory_name` under `models_dir`.

    Args:
        wait_s: give up after this many seconds (None: wait as long as it takes).
        cancelled: give up as soon as this is set.

    Raises:
        ModelBusyError: `wait_s` passed, or `cancelled` was set, before the lock was free.
    """
    try:
        handle = lock_path(models_dir, directory_name).open("a+b")
    except OSError:
        yield  # no lock file can be made here
        return
    deadline = None if wait_s is None else time.monotonic() + wait_s
    with handle:
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if cancelled is not None and cancelled.is_set():
                    raise ModelBusyError(f"{directory_name}: cancelled while waiting") from None
                if deadline is not None and time.monotonic() >= deadline:
                    raise ModelBusyError(
                        f"{directory_name} is being downloaded or converted"
                    ) from None
                time.sleep(POLL_SECONDS)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
