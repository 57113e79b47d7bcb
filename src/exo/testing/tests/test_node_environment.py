"""A test node's environment keeps the machine's model stores out."""

from __future__ import annotations

from pathlib import Path

import pytest

from exo.testing.processes import MACHINE_MODEL_STORES, ExoNode


def test_a_node_sees_none_of_the_machines_model_stores(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in MACHINE_MODEL_STORES:
        monkeypatch.setenv(name, "/machine/store")
    monkeypatch.setenv("SOME_SETTING", "kept")
    monkeypatch.setenv("EXO_CLUSTER_SECRET", "the machine's own cluster secret")
    env = ExoNode(tmp_path / "home", models_dir=tmp_path / "models").environment()
    assert "/machine/store" not in env.values()
    assert env["HF_HUB_CACHE"] == str(tmp_path / "home" / "hf-cache")
    assert env["OLLAMA_MODELS"] == str(tmp_path / "home" / "ollama-models")
    assert env["EXO_HOME"] == str(tmp_path / "home")
    assert env["EXO_MODELS_DIR"] == str(tmp_path / "models")
    assert env["SOME_SETTING"] == "kept"
    assert "HF_HOME" not in env and "EXO_MODELS_DIRS" not in env
    assert "EXO_CLUSTER_SECRET" not in env


def test_a_tests_own_env_still_names_stores(tmp_path: Path) -> None:
    chosen = {"HF_HUB_CACHE": str(tmp_path / "shared-cache"), "OLLAMA_MODELS": "/o"}
    env = ExoNode(tmp_path / "home", env=chosen).environment()
    assert env["HF_HUB_CACHE"] == chosen["HF_HUB_CACHE"] and env["OLLAMA_MODELS"] == "/o"
