"""A spawned process that sets its title shows it in `ps` (`/proc/<pid>/cmdline`)."""

import multiprocessing
import sys
from multiprocessing.synchronize import Event

import psutil
import pytest

from exo.utils.process_title import runner_title, set_process_title


def test_a_runner_title_names_the_model_and_the_rank() -> None:
    assert runner_title("HuggingFaceTB/SmolLM2-135M-Instruct", 1) == (
        "exo runner HuggingFaceTB/SmolLM2-135M-Instruct rank 1"
    )


def _titled(title: str, titled: Event, done: Event) -> None:
    set_process_title(title)
    titled.set()
    done.wait(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_spawned_process_shows_its_title_in_ps() -> None:
    context = multiprocessing.get_context("spawn")  # as the supervisor starts runners
    titled, done = context.Event(), context.Event()
    title = runner_title("org/model", 0)
    process = context.Process(target=_titled, args=(title, titled, done), daemon=True)
    process.start()
    try:
        assert titled.wait(60), "the process did not start"
        assert process.pid is not None
        assert " ".join(psutil.Process(process.pid).cmdline()).strip() == title
    finally:
        done.set()
        process.join(30)
