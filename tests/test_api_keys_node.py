"""API keys on real `exo` processes: key rotation on SIGHUP (and no key in the log), the
default (a generated key required off loopback) seen from a network namespace, and a
3-node cluster under the default whose nodes reach each other on a non-loopback address.

The namespace tests need root and iproute2; they skip without them (and fail under CI=true,
where they must run). Every namespace and veth pair they create is deleted afterwards.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.testing import processes
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
FORM_TIMEOUT_SECONDS = 30.0


class KeyedNode(ExoNode):
    """An `ExoNode` reached at `host` whose helper requests carry an API key: `api_key`, or
    else the key the node generated in its data directory."""

    def __init__(
        self,
        home: Path,
        *args: Any,
        host: str = "127.0.0.1",
        api_key: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(home, *args, **kwargs)
        self.host = host
        self.api_key = api_key
        self.extra_args = ("--host", host, *self.extra_args)  # the last --host counts

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def zenoh_endpoint(self) -> str:
        return f"tcp/{self.host}:{self.zenoh_port}"

    @property
    def key(self) -> str:
        if self.api_key is not None:
            return self.api_key
        return (self.home / "api_key").read_text().strip()

    def get(self, path: str, key: str | None = None, timeout: float = 10) -> httpx.Response:
        headers = {"Authorization": f"Bearer {key or self.key}"}
        return httpx.get(f"{self.url}{path}", headers=headers, timeout=timeout)

    def node_id(self) -> str:
        node_id: str = self.get("/node_id").json()
        return node_id

    def cluster(self) -> dict[str, Any]:
        view: dict[str, Any] = self.get("/cluster").json()
        return view

    def _api_up(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"exo exited with {self.process.returncode}:\n{self.log()}")
        if self.api_key is None and not (self.home / "api_key").exists():
            return False  # the generated key is written before the API starts
        return self.get("/node_id", timeout=2).status_code == 200

    def state(self) -> dict[str, Any]:
        response = self.get("/state")
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state


def test_a_rotated_key_file_takes_effect_on_sighup(tmp_path: Path) -> None:
    first, second, wrong = "rotate-key-first-5b1c9e", "rotate-key-second-77d0aa", "wrong-key-31f4"
    key_file = tmp_path / "keys"
    key_file.write_text(f"{first}\n")
    node = KeyedNode(
        tmp_path / "node",
        api_key=first,
        extra_args=("--no-default-model", "--api-key-file", str(key_file), "-v"),
    )
    try:
        node.start()
        wait_until(lambda: node.get("/v1/models").status_code == 200, 30, what="the first key")
        assert node.get("/v1/models", key=wrong).status_code == 401
        assert httpx.get(f"{node.url}/state", timeout=5).status_code == 401  # loopback too
        key_file.write_text(f"# rotated\n{second}\n")
        assert node.process is not None
        os.kill(node.process.pid, signal.SIGHUP)

        def rotated() -> bool:
            return (
                node.get("/v1/models", key=second).status_code == 200
                and node.get("/v1/models", key=first).status_code == 401
            )

        wait_until(rotated, 20, what="the rotated key to take effect")
        assert node.process.poll() is None  # SIGHUP did not stop the node
        client = openai.OpenAI(base_url=f"{node.url}/v1", api_key=first, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    finally:
        node.stop()
    log = node.log_path.read_text(errors="replace")
    assert "SIGHUP: 1 API key(s) loaded" in log
    assert '"GET /v1/models HTTP/1.1" 401' in log  # the access log ran (exo -v) ...
    for key in (first, second, wrong):
        assert key not in log  # ... and no key is in it, nor anywhere else in the log


@dataclass(frozen=True)
class Veth:
    """A network namespace joined to this one by a veth pair: `host_address` on this side,
    `namespace_address` inside."""

    namespace: str
    host_address: str
    namespace_address: str


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def veth() -> Iterator[Veth]:
    if shutil.which("ip") is None or os.geteuid() != 0:
        reason = "needs root and iproute2 to create a network namespace"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    pid = os.getpid()
    name = f"exo-t{pid}"
    host_side, namespace_side = f"exo{pid % 100000}h", f"exo{pid % 100000}n"
    # A private /30 of its own per test process: 10.213.X.Y/30.
    third, fourth = (pid >> 6) % 256, (pid % 64) * 4
    host_address, namespace_address = f"10.213.{third}.{fourth + 1}", f"10.213.{third}.{fourth + 2}"
    try:
        _ip("netns", "add", name)
    except subprocess.CalledProcessError as error:
        reason = f"ip netns add is not permitted here: {error.stderr.decode().strip()}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    try:
        _ip("link", "add", host_side, "type", "veth", "peer", "name", namespace_side)
        _ip("link", "set", namespace_side, "netns", name)
        _ip("addr", "add", f"{host_address}/30", "dev", host_side)
        _ip("link", "set", host_side, "up")
        _ip(
            "netns",
            "exec",
            name,
            "ip",
            "addr",
            "add",
            f"{namespace_address}/30",
            "dev",
            namespace_side,
        )
        _ip("netns", "exec", name, "ip", "link", "set", namespace_side, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield Veth(name, host_address, namespace_address)
    finally:
        subprocess.run(["ip", "link", "del", host_side], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


def test_default_key_is_required_off_loopback_only(
    veth: Veth, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The node runs inside the namespace on all of its addresses; this test's process
    reaches it from outside (10.213.x.1, not loopback), and a client inside the namespace
    reaches it on the namespace's loopback."""
    wrapper = tmp_path / "exo-in-namespace"
    wrapper.write_text(
        f'#!/bin/sh\nexec ip netns exec {veth.namespace} {processes.exo_command()} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setattr(processes, "exo_command", lambda: str(wrapper))
    node = KeyedNode(tmp_path / "node", host="0.0.0.0", extra_args=("--no-default-model",))
    outside = f"http://{veth.namespace_address}:{node.port}"
    try:
        node.launch()
        wait_until(lambda: (node.home / "api_key").exists(), 60, what="the generated key")
        key = node.key
        assert key.startswith("exo-") and (node.home / "api_key").stat().st_mode & 0o077 == 0
        wait_until(
            lambda: httpx.get(f"{outside}/v1/models", headers={"x-api-key": key}, timeout=2)
            .status_code == 200,
            60,
            what="the API from outside the namespace",
        )  # fmt: skip
        refused = openai.OpenAI(base_url=f"{outside}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.AuthenticationError) as error:
            refused.models.list()
        assert "api_key" in error.value.response.json()["error"]["message"]
        assert httpx.get(f"{outside}/state", timeout=5).status_code == 401
        served = openai.OpenAI(base_url=f"{outside}/v1", api_key=key, max_retries=0)
        assert served.models.with_raw_response.list().http_response.status_code == 200
        assert (
            httpx.get(f"{outside}/state", headers={"x-api-key": key}, timeout=5).status_code == 200
        )
        # On the namespace's loopback: no key needed.
        script = (
            "import httpx; "
            f"print(httpx.get('http://127.0.0.1:{node.port}/state', timeout=5).status_code)"
        )
        inside = subprocess.run(
            ["ip", "netns", "exec", veth.namespace, sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert inside.stdout.strip() == "200", inside.stderr[-500:]
    finally:
        node.stop()
    assert key in node.log_path.read_text(errors="replace")  # shown in the start banner


def test_three_nodes_under_the_default_place_and_serve_across_nodes(
    veth: Veth, tmp_path: Path, shared_models_dir: Path
) -> None:
    """Three nodes listen on the veth's address (not loopback), so every HTTP request between
    them (topology probes; peer file transfers use the same credential) needs the node
    credential, and every client request needs the node's generated key."""
    host = veth.host_address
    first = KeyedNode(
        tmp_path / "node-0", shared_models_dir, host=host, extra_args=("--no-default-model",)
    )
    nodes = [
        first,
        *(
            KeyedNode(
                tmp_path / f"node-{index}",
                shared_models_dir,
                host=host,
                extra_args=("--no-default-model",),
                namespace=first.namespace,
                bootstrap=(first,),
            )
            for index in (1, 2)
        ),
    ]
    started = time.monotonic()
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_api()
        print(f"APIs up after {time.monotonic() - started:.1f} s")
        node_ids = {node.node_id() for node in nodes}
        assert len({node.key for node in nodes}) == 3  # a key per node
        wait_until(
            lambda: all(
                len(first.state()["topology"].get(node_id, {})) == 2 for node_id in node_ids
            ),
            timeout=60,
            what="topology edges between all nodes (probes carry the node credential)",
        )
        print(f"links measured after {time.monotonic() - started:.1f} s")
        assert httpx.get(f"{first.url}/state", timeout=5).status_code == 401
        # Placed through A on A (the default model), asked through B and C: the chunks
        # travel between nodes, each client uses its own node's key.
        placed = httpx.post(
            f"{first.url}/place_instance",
            json={"model_id": DEFAULT_MODEL_ID, "node_ids": [first.node_id()]},
            headers={"Authorization": f"Bearer {first.key}"},
            timeout=60,
        )
        assert placed.status_code == 200, placed.text
        instance_id = placed.json()["instance_id"]
        wait_until(lambda: first.serving(instance_id), 240, interval=0.5, what="the model ready")
        print(f"model ready after {time.monotonic() - started:.1f} s")
        for node in nodes[1:]:
            client = openai.OpenAI(
                base_url=f"{node.url}/v1", api_key=node.key, timeout=120, max_retries=0
            )
            completion = client.chat.completions.create(
                model=DEFAULT_MODEL_ID,
                messages=QUESTION,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=20,
            )
            assert "Paris" in (completion.choices[0].message.content or "")
        print(f"answered through both after {time.monotonic() - started:.1f} s")
        assert first.runner_processes() and not any(n.runner_processes() for n in nodes[1:])
    finally:
        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:  # stopped side by side
            list(pool.map(lambda node: node.stop(), nodes))
