from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def empty_models_directory(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Routes look for downloaded models in the node's models directory: point it at an
    empty one, so what this machine has converted does not change what a test sees (nor
    the other directories a machine may name: `EXO_MODELS_DIRS` would replace it)."""
    directory = tmp_path_factory.mktemp("models")
    monkeypatch.setenv("EXO_MODELS_DIR", str(directory))
    monkeypatch.delenv("EXO_MODELS_DIRS", raising=False)
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
    return directory
