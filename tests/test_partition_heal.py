"""A network split between two real `exo` processes on loopback (their only link runs
through a relay the test cuts and restores): each side elects its own master and places
an instance; once the link is back the cluster holds ONE history with both instances, and
the losing side's runner was never restarted. A model added through the losing side
during the split (acknowledged there) is in that history, added exactly once."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from exo.node.event_log import EventLog
from exo.shared.types.events import CustomModelAdded
from exo.testing.link_proxy import LinkProxy
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until
from tests.test_cluster import FORM_TIMEOUT_SECONDS, identical_states, place_on, running

READY_SECONDS = 300.0
LOCAL_COPY = "HuggingFaceTB--SmolLM2-135M-Instruct"  # the default model's converted directory
HEAL_SECONDS = 120.0


def chat(node: ExoNode) -> httpx.Response:
    return httpx.post(
        f"{node.url}/v1/chat/completions",
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "temperature": 0,
        },
        timeout=120,
    )


@pytest.mark.slow
def test_a_healed_split_keeps_the_instances_of_both_sides(
    tmp_path: Path, shared_models_dir: Path
) -> None:
    # A wins the election after the split heals (--force-master): B's side loses.
    a = ExoNode(tmp_path / "a", shared_models_dir, ("--no-default-model", "--force-master"))
    link = LinkProxy(a.zenoh_port)
    b = ExoNode(
        tmp_path / "b", shared_models_dir,
        ("--no-default-model", "--bootstrap-peers", link.endpoint), namespace=a.namespace,
    )  # fmt: skip
    started = time.monotonic()
    try:
        with running([a, b]):
            wait_until(lambda: identical_states([a, b]), FORM_TIMEOUT_SECONDS)
            a_id, b_id = a.node_id(), b.node_id()
            print(f"formed in {time.monotonic() - started:.1f} s")

            link.cut()
            split = time.monotonic()
            wait_until(
                lambda: a.cluster()["master"] == a_id and b.cluster()["master"] == b_id,
                FORM_TIMEOUT_SECONDS,
                what="a master on each side",
            )
            print(f"two masters {time.monotonic() - split:.1f} s after the cut")
            on_a, on_b = place_on(a, a_id), place_on(b, b_id)
            wait_until(lambda: a.serving(on_a), READY_SECONDS, interval=0.5)
            wait_until(lambda: b.serving(on_b), READY_SECONDS, interval=0.5)
            runners_of_b = {process.pid for process in b.runner_processes()}
            assert len(runners_of_b) == 1
            assert on_a not in b.state()["instances"] and on_b not in a.state()["instances"]
            added = httpx.post(
                f"{b.url}/models/add",
                json={"model_id": str(shared_models_dir / LOCAL_COPY)},
                timeout=60,
            )
            assert added.status_code == 200, added.text  # acknowledged by B's side
            custom = added.json()["model_id"]
            assert custom in b.state()["custom_cards"]
            assert custom not in a.state()["custom_cards"]

            link.restore()
            healed = time.monotonic()
            state = wait_until(
                lambda: (s := identical_states([a, b])) and on_a in s["instances"]
                and on_b in s["instances"] and custom in s["custom_cards"]
                and a.serving(on_b) and s,
                HEAL_SECONDS,
                interval=0.5,
                what="one state holding both sides' instances",
            )  # fmt: skip
            print(f"one state {time.monotonic() - healed:.1f} s after the link returned")
            assert a.cluster()["master"] == b.cluster()["master"] == a_id
            assert set(state["instances"]) == {on_a, on_b}
            # B's runner kept running through the merge: reported, not restarted.
            assert {process.pid for process in b.runner_processes()} == runners_of_b
            assert "reporting the 1 instances this node runs" in b.log_path.read_text()
            for node in (a, b):
                assert chat(node).status_code == 200
            # B's side's addition was sent again to A's master after B dropped its
            # history, and carried out once.
            history = EventLog(a.home / "event_log.jsonl").read_all()
            additions = [
                e for e in history
                if isinstance(e.event, CustomModelAdded) and e.event.card.model_id == custom
            ]  # fmt: skip
            assert len(additions) == 1
    finally:
        link.close()
