"""A damaged history on real `exo` processes (loopback): a follower whose log was
corrupted while stopped starts, sets the damage aside and takes the master's history; a
lone node whose log was cut mid-record starts from the good records."""

from __future__ import annotations

import time
from pathlib import Path

from exo.testing.processes import ExoNode, wait_until
from tests.test_cluster import FORM_TIMEOUT_SECONDS, identical_states, make_cluster, running

LOG = "event_log.jsonl"


def set_aside(node: ExoNode) -> list[Path]:
    return sorted(node.home.glob(f"{LOG}.corrupt-*"))


def test_a_damaged_log_is_set_aside_and_rebuilt(tmp_path: Path) -> None:
    master, follower = make_cluster(tmp_path, tmp_path / "models", 2, ("--force-master",))
    started = time.monotonic()
    with running([master, follower]):
        agreed = wait_until(lambda: identical_states([master, follower]), FORM_TIMEOUT_SECONDS)
        held = agreed["last_event_applied_idx"]
        print(f"cluster formed at event {held} after {time.monotonic() - started:.1f} s")
        follower.stop()

        # A flipped bit in a record in the middle: only its checksum tells.
        log = follower.home / LOG
        data = bytearray(log.read_bytes())
        data[len(data) // 2] ^= 0x04
        log.write_bytes(bytes(data))
        again = ExoNode(
            follower.home, follower.models_dir, ("--no-default-model",),
            namespace=master.namespace, bootstrap=(master,),
        )  # fmt: skip
        with running([again]):
            restarted = time.monotonic()
            synced = wait_until(lambda: identical_states([master, again]), FORM_TIMEOUT_SECONDS)
            print(f"follower rebuilt in {time.monotonic() - restarted:.1f} s")
            assert synced["history_id"] == agreed["history_id"]
            assert synced["last_event_applied_idx"] >= held
            [aside] = set_aside(again)
            assert aside.read_bytes() == bytes(data)
            assert "bad record at line" in again.log_path.read_text()
        history = master.state()["history_id"]

    # The master, alone now, with its last record cut short (a crash mid-write).
    log = master.home / LOG
    records = log.read_bytes().count(b"\n")
    log.write_bytes(log.read_bytes()[:-17])
    lone = ExoNode(master.home, master.models_dir, ("--no-default-model", "--force-master"))
    with running([lone]):
        state = wait_until(lambda: (s := lone.state())["history_id"] == history and s, 60)
        # Every whole record was kept (the log may begin after a snapshot: none here).
        assert state["last_event_applied_idx"] >= records - 2
        assert len(set_aside(lone)) == 1
        assert "torn last record" in lone.log_path.read_text()
