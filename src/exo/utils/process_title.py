"""Process titles: what `ps`, `top` and `/proc/<pid>/cmdline` show for exo's processes.

A spawned runner would otherwise show as `python -c from multiprocessing.spawn import ...`,
which names neither the model nor the rank; `setproctitle` rewrites the process's argument
area (and, on Linux, its 15-character `comm` name) so that `ps` shows the runner's title.
"""

from __future__ import annotations

import setproctitle

# How every runner's title starts (tests find a node's runners by it).
RUNNER_TITLE_PREFIX = "exo runner "


def runner_title(model_id: str, device_rank: int) -> str:
    """The title of the runner process of one rank of a model: `exo runner <model> rank N`."""
    return f"{RUNNER_TITLE_PREFIX}{model_id} rank {device_rank}"


def set_process_title(title: str) -> None:
    """Make `ps` show `title` as this process's command line."""
    setproctitle.setproctitle(title)
