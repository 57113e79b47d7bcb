"""The model lock: one holder at a time across threads, waits bounded by time or a cancel,
and no lock (but no failure) where the models directory cannot be written."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from exo.download.model_lock import ModelBusyError, lock_path, model_lock


def test_a_second_holder_waits_for_the_first(tmp_path: Path) -> None:
    order: list[str] = []
    entered = threading.Event()

    def first() -> None:
        with model_lock(tmp_path, "org--model"):
            entered.set()
            time.sleep(0.3)
            order.append("first done")

    thread = threading.Thread(target=first)
    thread.start()
    assert entered.wait(10)
    with model_lock(tmp_path, "org--model", wait_s=10):
        order.append("second in")
    thread.join(10)
    assert order == ["first done", "second in"]


def test_waiting_gives_up_after_its_time_or_when_cancelled(tmp_path: Path) -> None:
    with model_lock(tmp_path, "org--model"):
        with (
            pytest.raises(ModelBusyError, match="being downloaded"),
            model_lock(tmp_path, "org--model", wait_s=0.2),
        ):
            pass
        cancelled = threading.Event()
        cancelled.set()
        with (
            pytest.raises(ModelBusyError, match="cancelled"),
            model_lock(tmp_path, "org--model", cancelled=cancelled),
        ):
            pass
        with model_lock(tmp_path, "org--other", wait_s=0):  # another model: free
            pass
    with model_lock(tmp_path, "org--model", wait_s=0):  # released
        pass


def test_the_lock_lives_outside_the_models_directory(tmp_path: Path) -> None:
    models = tmp_path / "models-not-made"
    with model_lock(models, "org--model", wait_s=0):
        assert lock_path(models, "org--model").is_file()
    assert not models.exists()  # a lookup neither creates it nor adds entries to it
    assert lock_path(models, "org--model") != lock_path(tmp_path / "other", "org--model")
