from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.testing.processes import ExoNode


@pytest.fixture(scope="session")
def default_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    """A node started exactly as a user would: fresh data directory, default model placed
    and converted from its PyPI package on first start."""
    node = ExoNode(tmp_path_factory.mktemp("exo-default"))
    node.start()
    try:
        node.wait_ready()
        yield node
    finally:
        node.stop()


@pytest.fixture(scope="session")
def shared_models_dir(default_node: ExoNode) -> Path:
    """The default node's converted models, so other nodes skip the conversion."""
    return default_node.home / "models"
