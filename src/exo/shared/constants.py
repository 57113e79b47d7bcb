"""Filesystem locations and protocol constants.

The data directory follows the XDG base-directory spec: `$XDG_DATA_HOME/exo`
(default `~/.local/share/exo`). `EXO_HOME` overrides it entirely, which is how tests
and several nodes on one machine keep their state apart.
"""

from __future__ import annotations

import os
from pathlib import Path

DEFAULT_API_PORT = 52415
INSTANCE_HEADER = "x-exo-instance"
"""A request header naming the instance (its id in `GET /state`) that must run the
generation, in every dialect: it runs there or is refused (404 no such instance, 400 an
instance of another model or a value that is no instance id, 503 unavailable), never
elsewhere. For comparing placements of one model side by side (`exo bench`)."""
PROTOCOL_VERSION = "0.2"
"""The default namespace: nodes of another protocol version never see each other. 0.2: a
shard and an instance carry `sharding` instead of a class tag (older event logs are
converted on load, `exo.node.event_log_upgrade`)."""


def exo_home() -> Path:
    """The node's data directory (created on first use)."""
    override = os.environ.get("EXO_HOME")
    if override:
        path = Path(override).expanduser()
    else:
        xdg_data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
        path = Path(xdg_data) / "exo"
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """Where converted and downloaded models live: `<exo_home>/models`, or
    `EXO_MODELS_DIR` (several nodes on one machine can share one copy)."""
    override = os.environ.get("EXO_MODELS_DIR")
    path = Path(override).expanduser() if override else exo_home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def event_log_path() -> Path:
    return exo_home() / "event_log.jsonl"


def node_id_path() -> Path:
    return exo_home() / "node_id"
