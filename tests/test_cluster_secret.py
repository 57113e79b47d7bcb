"""A cluster secret on loopback: two `exo` nodes with the secret form a cluster over mutual
TLS and serve; a rogue `exo` node with another secret and raw zenoh sessions (plain TCP,
and TLS under a foreign CA) aimed at the members' ports never see a member's node id,
event or token, and what they publish (a forged DeleteInstance of the served instance)
has no effect: the cluster keeps serving."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import zenoh

from exo.routing.cluster_tls import ClusterSecret
from exo.shared.types.commands import DeleteInstance, ForwarderCommand
from exo.shared.types.common import CommandId, InstanceId, NodeId
from exo.testing.ports import free_port
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until

SECRET = "members-only: correct horse battery staple"
ROGUE_SECRET = "the rogue's own secret, not the members'"
# Bounds on forming a cluster and loading the model, not measures of them (printed).
FORM_TIMEOUT_SECONDS = 90.0
READY_TIMEOUT_SECONDS = 300.0
# How long the rogues are given to link, listen and inject (zenoh retries a bootstrap
# peer about every second).
ROGUE_WINDOW_SECONDS = 5.0
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]


class TlsNode(ExoNode):
    """An `exo` node whose peers reach it on `tls/` (it runs with a cluster secret)."""

    @property
    def zenoh_endpoint(self) -> str:
        return f"tls/127.0.0.1:{self.zenoh_port}"


class RawSessions:
    """Bare zenoh peers dialing the members' link ports, subscribed to every key and
    every liveliness token; `seen` holds each key with its payload."""

    def __init__(self, targets: list[str], foreign_home: Path, rogue_endpoint: str) -> None:
        self.seen: list[str] = []
        self._lock = threading.Lock()
        tls = ClusterSecret(ROGUE_SECRET).write_tls_files(foreign_home).zenoh_tls_config()
        tcp_targets = [target.replace("tls/", "tcp/") for target in targets]
        self.sessions = [
            self._open(f"tcp/127.0.0.1:{free_port()}", [*tcp_targets, *targets], {}),
            # Under the rogue's CA, it also links with the rogue node: the control showing
            # that a linked session hears a node's keys and tokens.
            self._open(f"tls/127.0.0.1:{free_port()}", [*targets, rogue_endpoint], {"tls": tls}),
        ]

    def _open(self, listen: str, connect: list[str], link: dict[str, Any]) -> zenoh.Session:
        config = {
            "mode": "peer",
            "listen": {"endpoints": [listen]},
            "connect": {"endpoints": connect},
            "scouting": {"multicast": {"enabled": False}},
            "transport": {"link": link},
        }
        session = zenoh.open(zenoh.Config.from_json5(json.dumps(config)))
        session.declare_subscriber("**", self._record)
        session.liveliness().declare_subscriber("**", self._record, history=True)
        return session

    def _record(self, sample: zenoh.Sample) -> None:
        with self._lock:
            self.seen.append(f"{sample.key_expr} {sample.payload.to_string()}")

    def text(self) -> str:
        with self._lock:
            return "\n".join(self.seen)

    def put(self, key: str, payload: bytes) -> None:
        for session in self.sessions:
            session.put(key, payload)

    def close(self) -> None:
        for session in self.sessions:
            session.close()


@dataclass
class Clusters:
    members: list[TlsNode]
    rogue: TlsNode
    raw: RawSessions
    member_ids: list[str]
    rogue_id: str


def _ask(node: ExoNode) -> str:
    response = httpx.post(
        f"{node.url}/v1/chat/completions",
        json={"model": DEFAULT_MODEL_ID, "messages": QUESTION, "temperature": 0, "max_tokens": 20},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    content: str = response.json()["choices"][0]["message"]["content"]
    return content


def _members_agree(members: list[TlsNode]) -> bool:
    views = [member.cluster() for member in members]
    masters = {view["master"] for view in views}
    states = [member.state()["node_info"] for member in members]
    return len(masters) == 1 and None not in masters and all(len(s) == 2 for s in states)


@pytest.fixture
def clusters(
    tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path
) -> Iterator[Clusters]:
    root = tmp_path_factory.mktemp("cluster-secret")
    secret_env = {"EXO_CLUSTER_SECRET": SECRET}
    first = TlsNode(root / "member-0", shared_models_dir, ("--no-default-model",), secret_env)
    second = TlsNode(
        root / "member-1",
        shared_models_dir,
        ("--no-default-model",),
        secret_env,
        namespace=first.namespace,
        bootstrap=(first,),
    )
    secret_file = root / "rogue-secret"
    secret_file.write_text(ROGUE_SECRET + "\n", encoding="utf-8")
    # Same namespace, dialing both members: only the secret differs.
    rogue = TlsNode(
        root / "rogue",
        shared_models_dir,
        ("--no-default-model", "--cluster-secret-file", str(secret_file)),
        namespace=first.namespace,
        bootstrap=(first, second),
    )
    nodes = [first, second, rogue]
    raw: RawSessions | None = None
    try:
        for node in nodes:
            node.launch()
        raw = RawSessions(
            [first.zenoh_endpoint, second.zenoh_endpoint], root / "raw-tls", rogue.zenoh_endpoint
        )
        for node in nodes:
            node.wait_api()
        started = time.monotonic()
        wait_until(lambda: _members_agree([first, second]), FORM_TIMEOUT_SECONDS, what="members")
        print(f"members formed a cluster in {time.monotonic() - started:.1f}s")
        yield Clusters(
            [first, second], rogue, raw, [first.node_id(), second.node_id()], rogue.node_id()
        )
    finally:
        if raw is not None:
            raw.close()
        for node in nodes:
            node.stop()


def test_members_serve_while_rogues_learn_nothing_and_inject_nothing(clusters: Clusters) -> None:
    first, second = clusters.members
    response = httpx.post(
        f"{first.url}/place_instance",
        json={"model_id": DEFAULT_MODEL_ID, "node_ids": [clusters.member_ids[1]]},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    started = time.monotonic()
    wait_until(lambda: first.serving(instance_id), READY_TIMEOUT_SECONDS, what="instance ready")
    print(f"instance ready on the second member in {time.monotonic() - started:.1f}s")
    # The first member's API streams tokens its peer's runner produced, over the TLS link.
    answer = _ask(first)
    assert "Paris" in answer

    # Even knowing the instance id, a rogue's DeleteInstance reaches no member.
    forged = ForwarderCommand(
        origin=NodeId("forger"),
        command=DeleteInstance(command_id=CommandId("forged"), instance_id=InstanceId(instance_id)),
    )
    commands_key = f"exo/{first.namespace}/commands"
    clusters.raw.put(commands_key, forged.model_dump_json().encode())
    deadline = time.monotonic() + ROGUE_WINDOW_SECONDS
    while time.monotonic() < deadline:
        clusters.raw.put(commands_key, forged.model_dump_json().encode())
        time.sleep(0.5)
    for member in clusters.members:
        assert member.serving(instance_id) is not None
    assert _ask(second) == answer
    _check_rogues_learned_nothing(clusters)


def _check_rogues_learned_nothing(clusters: Clusters) -> None:
    first, second = clusters.members
    rogue = clusters.rogue
    # Positive control: the raw session under the rogue's CA did link with the rogue node.
    wait_until(
        lambda: clusters.rogue_id in clusters.raw.text(), 30, what="the rogue's token (control)"
    )
    # Alone in its own cluster: it elects itself.
    wait_until(
        lambda: rogue.cluster()["master"] == clusters.rogue_id, 30, what="the rogue's master"
    )
    assert rogue.cluster()["peers"] == []
    rogue_state = json.dumps(rogue.state())
    rogue_log = (rogue.home / "exo.log").read_text(errors="replace")
    raw_seen = clusters.raw.text()
    for member_id in clusters.member_ids:
        assert member_id not in rogue_state
        assert member_id not in rogue_log
        assert member_id not in raw_seen
    assert "Paris" not in rogue_log and "Paris" not in raw_seen
    assert "GenerateText" not in raw_seen
    for member in (first, second):
        assert clusters.rogue_id not in json.dumps(member.state())
        assert clusters.rogue_id not in member.cluster()["peers"]
    # The secret itself is never logged.
    for node in (first, second, rogue):
        log = (node.home / "exo.log").read_text(errors="replace")
        assert SECRET not in log and ROGUE_SECRET not in log
        assert "links on tls/127.0.0.1:" in log
        assert "access    closed" in log
