"""The dashboard's live stream on a real `exo` process: Ctrl-C with a browser's `/events`
stream open still stops the node cleanly, and the stream ends instead of breaking."""

from __future__ import annotations

import signal
import threading
from pathlib import Path

import httpx

from exo.testing.processes import ExoNode, wait_until


def test_a_node_with_an_open_event_stream_stops_cleanly(tmp_path: Path) -> None:
    node = ExoNode(tmp_path / "node", extra_args=("--no-default-model",)).start()
    lines: list[str] = []
    failures: list[BaseException] = []

    def listen() -> None:
        try:
            with httpx.stream("GET", f"{node.url}/events", timeout=60) as response:
                for line in response.iter_lines():
                    lines.append(line)
        except BaseException as error:  # the test reports it below
            failures.append(error)

    listener = threading.Thread(target=listen, daemon=True)
    try:
        listener.start()
        wait_until(lambda: "event: snapshot" in lines, timeout=30, what="the snapshot")
    finally:
        code = node.stop(signal.SIGINT, timeout=60)
    listener.join(timeout=30)
    assert code == 0, node.log()
    assert not listener.is_alive(), "the stream stayed open after the node stopped"
    assert failures == [], failures  # the response ended; it was not cut off mid-way
    log = node.log()
    assert "Exception in ASGI application" not in log
    assert "without completing response" not in log
