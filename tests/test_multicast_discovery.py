"""Zero-configuration discovery: nodes with no bootstrap peers find each other by zenoh
multicast scouting. Runs inside a network namespace the test creates, so the multicast
traffic never leaves it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from exo.testing.processes import API_TIMEOUT_SECONDS, exo_command, free_port, wait_until

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None,
    reason="needs root and iproute2 to create a network namespace",
)


@pytest.fixture
def namespace() -> Iterator[str]:
    name = f"exo-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", name, "ip", "link", "set", "lo", "up"], check=True)
        subprocess.run(
            ["ip", "netns", "exec", name, "ip", "route", "add", "224.0.0.0/4", "dev", "lo"],
            check=True,
        )
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def cluster_view(namespace: str, port: int) -> dict[str, object]:
    """GET /cluster from inside the namespace (its loopback is not ours)."""
    script = (
        "import httpx, json, sys; "
        f"print(json.dumps(httpx.get('http://127.0.0.1:{port}/cluster', timeout=3).json()))"
    )
    result = subprocess.run(
        ["ip", "netns", "exec", namespace, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if result.returncode != 0:
        raise ValueError(result.stderr[-300:])
    view: dict[str, object] = json.loads(result.stdout)
    return view


def test_nodes_find_each_other_by_multicast(namespace: str, tmp_path: Path) -> None:
    ports = [(free_port(), free_port()) for _ in range(2)]
    processes = []
    try:
        for index, (api_port, zenoh_port) in enumerate(ports):
            home = tmp_path / f"node-{index}"
            home.mkdir()
            log = (home / "exo.log").open("wb")
            processes.append(
                subprocess.Popen(
                    [
                        "ip", "netns", "exec", namespace, exo_command(),
                        "--host", "127.0.0.1",
                        "--api-port", str(api_port),
                        "--zenoh-port", str(zenoh_port),
                        "--namespace", "multicast-test",
                        "--no-default-model",
                    ],
                    env={**os.environ, "EXO_HOME": str(home)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )  # fmt: skip

        def agreed() -> bool:
            views = [cluster_view(namespace, api_port) for api_port, _ in ports]
            ids = {view["node_id"] for view in views}
            return (
                len(ids) == 2
                and all(view["peers"] == sorted(ids - {view["node_id"]}) for view in views)
                and len({view["master"] for view in views} - {None}) == 1
                and all(view["master"] is not None for view in views)
            )

        # Starting (imports, zenoh) is bounded apart from finding each other: on a loaded
        # machine it alone has taken over 90 s.
        wait_until(
            lambda: all(cluster_view(namespace, api_port) for api_port, _ in ports),
            timeout=API_TIMEOUT_SECONDS,
            interval=0.5,
            what="both nodes' APIs",
        )
        wait_until(agreed, timeout=60, interval=0.5, what="discovery by multicast")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
