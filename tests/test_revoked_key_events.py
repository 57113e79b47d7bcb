"""A key removed on SIGHUP also ends the `/events` streams it opened.

Found by trial 40: docs/security.md says removed keys "(and the dashboard sessions made
with them) stop working", and so they do for new requests, but an `/events` stream opened
before the SIGHUP went on receiving every patch of the cluster state, the prompts of other
clients' requests included (a task's messages are in the state), for as long as the
connection lasted (its keep-alives hold it open indefinitely).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import httpx

from exo.testing.processes import wait_until
from exo.testing.tiny_models import save_tiny_checkout
from tests.test_api_keys_node import KeyedNode

REVOKED, KEPT = "revoked-key-1a2b3c4d5e", "kept-key-6f7a8b9c0d"


def test_an_events_stream_of_a_removed_key_gets_no_more_patches(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{REVOKED}\n{KEPT}\n")
    node = KeyedNode(
        tmp_path / "node",
        api_key=KEPT,
        extra_args=("--no-default-model", "--api-key-file", str(key_file)),
    )
    lines: list[tuple[float, str]] = []

    def follow() -> None:
        headers = {"Authorization": f"Bearer {REVOKED}"}
        try:
            with httpx.stream("GET", f"{node.url}/events", headers=headers, timeout=60) as answer:
                for line in answer.iter_lines():
                    lines.append((time.monotonic(), line))
        except httpx.HTTPError:
            pass  # the node closed the stream: what a revocation should do

    try:
        node.start()
        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        wait_until(
            lambda: any(line == "event: snapshot" for _, line in lines), 30, what="a snapshot"
        )
        key_file.write_text(f"{KEPT}\n")
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGHUP)
        wait_until(
            lambda: node.get("/v1/models", key=REVOKED).status_code == 401, 20, what="revocation"
        )
        revoked_at = time.monotonic()
        # A change of the cluster state (a custom model's card) makes a patch.
        model = save_tiny_checkout(tmp_path / "tiny")
        added = httpx.post(
            f"{node.url}/models/add",
            json={"model_id": str(model)},
            headers={"Authorization": f"Bearer {KEPT}"},
            timeout=60,
        )
        assert added.status_code == 200, added.text
        time.sleep(3.0)  # patches go out at most every 200 ms
        after = [line for at, line in lines if at > revoked_at and str(model) in line]
        assert after == [], "the revoked key's stream got the card added after the revocation"
    finally:
        node.stop()
