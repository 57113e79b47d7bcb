"""A stranger on the network of a split instance whose cluster has a secret: it knows every
address and port the instance's ranks listen on, but not the secret. Two ranks (a 2-way
pipeline split of a tiny random-weight Llama) run in two network namespaces joined by a
veth pair, as two machines; the stranger, in the second namespace, connects to every port
either rank listens on once the group has formed (rank 0's rendezvous store: the group runs
on the rank links alone, whose listeners close once the mesh is built, and forms no gloo
group, whose pair listener would accept anyone): with a wrong key, with garbage, and
silently. It is refused everywhere, receives nothing beyond a handshake challenge, and the
instance keeps serving: its greedy tokens after the intrusion equal those before and the
single-process engine's.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from exo.testing.rank_processes import run_rank_processes
from tests.chaos.harness import enter_netns
from tests.chaos.partition import SUBNET, linked_namespaces

# Both ranks know this key (the one a cluster secret derives); the stranger another.
KEY = bytes.fromhex("5e" * 32)
STRANGER_KEY = bytes.fromhex("a7" * 32)
INSTANCE_ID = "instance-under-test"
RANK_ADDRESSES = (f"{SUBNET}.1", f"{SUBNET}.2")
GREEDY: dict[str, Any] = {"temperature": 0.0, "max_tokens": 8}
WILDCARDS = ("::", "0.0.0.0")  # every interface (dual-stack or IPv4 only)
# Bounds against a hung group, not speed checks.
GROUP_DEADLINE_S = 300.0
GO_WAIT_S = 120.0


def _namespaces_unavailable() -> str | None:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return "needs root and iproute2 to create network namespaces"
    probe = f"exo-probe-{secrets.token_hex(4)}"
    created = subprocess.run(["ip", "netns", "add", probe], capture_output=True, timeout=30)
    if created.returncode != 0:
        return f"cannot create a network namespace: {created.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], check=False, timeout=30)
    return None


_UNAVAILABLE = _namespaces_unavailable()
pytestmark = pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")


def _listening_ports() -> list[tuple[str, int]]:
    import psutil

    return sorted(
        (connection.laddr.ip, connection.laddr.port)
        for connection in psutil.Process().net_connections(kind="tcp")
        if connection.status == psutil.CONN_LISTEN
    )


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    results: Any,
    namespaces: tuple[str, str],
    model_dir: str,
    go: Any,
) -> None:
    """A spawned rank on its own "machine": join the authenticated group, report the ports
    it listens on, then (rank 0) generate before and after the stranger's visit."""
    enter_netns(namespaces[rank])  # before any socket; threads started later inherit it
    import torch

    from exo.worker.engines.torch.comm.group_auth import GroupCredentials
    from exo.worker.engines.torch.comm.process_group import destroy_group, init_group
    from exo.worker.engines.torch.engine_factory import load_engine
    from exo.worker.engines.torch.tests.test_distributed import make_shard, request

    torch.set_num_threads(1)
    try:
        credentials = GroupCredentials(KEY, INSTANCE_ID)
        init_group(
            "gloo", rank, world_size, RANK_ADDRESSES[0], port, timeout_s=60,
            credentials=credentials,
        )  # fmt: skip
        engine = load_engine(Path(model_dir), make_shard(Path(model_dir), "pipeline", rank, 2))
        engine.warmup()
        results.put(("ports", rank, _listening_ports(), port))
        if rank == 0:
            for phase in ("before", "after"):
                if phase == "after" and not go.wait(GO_WAIT_S):
                    raise TimeoutError("the stranger never finished")
                pieces = list(engine.generate(request(**GREEDY)))
                tokens = [token for piece in pieces for token in piece.token_ids]
                results.put(("tokens", phase, tokens))
            engine.shutdown()
        else:
            engine.serve_forever()
        results.put(("done", rank))
        destroy_group()
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


@dataclass
class Visit:
    """What the stranger did and saw."""

    refused: list[str] = field(default_factory=list)  # one line per refused attempt
    received: dict[tuple[str, int], bytes] = field(default_factory=dict)  # beyond handshakes
    silent: list[tuple[tuple[str, int], socket.socket]] = field(default_factory=list)


def _visit(address: str, port: int, visit: Visit, rendezvous: bool) -> None:
    """Connect to one port as a stranger: a silent connection left open, the group
    handshake with another key (as the store and as a link), garbage, and torch's store
    client (at the `rendezvous` port)."""
    import torch.distributed as dist

    from exo.worker.engines.torch.comm.group_auth import (
        AuthenticationError,
        GroupCredentials,
        Purpose,
        authenticate_client,
    )

    # First the silent one, so that its deadline runs while the rest goes on.
    visit.silent.append(((address, port), socket.create_connection((address, port), timeout=5)))
    stranger = GroupCredentials(STRANGER_KEY, INSTANCE_ID)
    for purpose in (Purpose.STORE, Purpose.LINK):
        with socket.create_connection((address, port), timeout=5) as connection:
            try:
                authenticate_client(connection, stranger, purpose, 1, 0, deadline_s=0.5)
            except AuthenticationError as error:
                visit.refused.append(f"{address}:{port} {purpose.name}: {error}")
                continue
            raise AssertionError(f"{address}:{port} accepted a stranger as {purpose.name}")
    with socket.create_connection((address, port), timeout=5) as connection:
        connection.sendall(secrets.token_bytes(512))
        connection.settimeout(0.5)
        try:
            answer = connection.recv(4096)
        except (TimeoutError, ConnectionResetError):
            answer = b""
        if answer:
            visit.received[(address, port)] = answer
        visit.refused.append(f"{address}:{port} garbage: {len(answer)} bytes back")
    if rendezvous:  # torch's own store client, which reads any key of a TCPStore
        try:
            client = dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=2))
            visit.received[(address, port)] = client.get("exo_links/token")
        except (RuntimeError, dist.DistError) as error:
            visit.refused.append(f"{address}:{port} TCPStore client: {str(error)[:60]}")


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from exo.download.pypi_gguf import prepare_model
    from exo.shared.models.cards import load_builtin_cards
    from exo.shared.types.common import ModelId
    from exo.testing.tiny_models import save_tiny_model

    card = load_builtin_cards()[ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")]
    tokenizer_source = prepare_model(
        card, Path.home() / ".cache" / "exo-test-models", offline=False
    )
    return save_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", tokenizer_source, 4)


def _single_process_tokens(model_dir: Path) -> list[int]:
    from exo.worker.engines.torch.engine_factory import load_engine
    from exo.worker.engines.torch.tests.test_distributed import make_shard, request

    engine = load_engine(model_dir, make_shard(model_dir, "pipeline", 0, 1))
    engine.warmup()  # as each rank's engine is (test_distributed.single_process_tokens)
    return [token for piece in engine.generate(request(**GREEDY)) for token in piece.token_ids]


def test_a_stranger_without_the_secret_is_refused_on_every_port_and_serving_goes_on(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from torch import multiprocessing

    from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV
    from exo.worker.engines.torch.comm import group_auth

    monkeypatch.setenv(KV_CACHE_DTYPE_ENV, "float32")  # split == single, token for token
    expected = _single_process_tokens(tiny_model_dir)
    go = multiprocessing.get_context("spawn").Event()
    ports: dict[int, list[tuple[str, int]]] = {}  # where the stranger connects
    raw: dict[int, list[tuple[str, int]]] = {}  # as the ranks listen
    visit = Visit()
    tokens: dict[str, list[int]] = {}
    store_port: list[int] = []  # the group's master port, as the ranks report it

    def on_report(report: tuple[Any, ...]) -> None:
        match report:
            case ("ports", rank, listening, group_port):
                raw[rank] = [(address, port) for address, port in listening]
                # A wildcard listener is reached at the rank's own address.
                ports[rank] = [
                    (RANK_ADDRESSES[rank] if address in WILDCARDS else address, port)
                    for address, port in listening
                ]
                store_port.append(group_port)
                if len(ports) == 2:
                    # The rendezvous port is public (the instance's `rendezvous` in /state).
                    # Threads started here inherit this thread's namespace.
                    with ThreadPoolExecutor(3) as visitors:
                        for future in [
                            visitors.submit(_visit, address, port, visit, port == store_port[0])
                            for address, port in ports[0] + ports[1]
                        ]:
                            future.result(timeout=60)
                    go.set()  # rank 0 generates again, the silent strangers still connected
            case ("tokens", phase, generated):
                tokens[phase] = generated

    # The stranger runs on the second "machine" (rank 1's), reaching rank 0 over veth.
    with (
        linked_namespaces() as namespaces,
        ThreadPoolExecutor(1, initializer=enter_netns, initargs=(namespaces[1],)) as pool,
    ):
        try:
            pool.submit(
                run_rank_processes,
                _rank_main,
                (namespaces, str(tiny_model_dir), go),
                2,
                GROUP_DEADLINE_S,
                on_report,
            ).result(timeout=GROUP_DEADLINE_S + 60)
            # The store drops a silent stranger at its handshake's deadline.
            deadline = time.monotonic() + group_auth.HANDSHAKE_SECONDS + 5
            for (address, port), connection in visit.silent:
                connection.settimeout(max(0.1, deadline - time.monotonic()))
                try:
                    data = connection.recv(1)
                except TimeoutError:
                    data = b"(open)"
                if data not in (b"", b"(open)"):
                    visit.received[(address, port)] = data
                if (address, port) == (RANK_ADDRESSES[0], store_port[0]):
                    assert data == b"", "the store kept a silent stranger past its deadline"
        finally:
            for _address, connection in visit.silent:
                connection.close()

    assert set(ports) == {0, 1}
    store = (RANK_ADDRESSES[0], store_port[0])
    # Rank 0 listens on the store's port only, on every interface (the ranks may reach it
    # on different networks); rank 1 on nothing: the links' listeners are closed once the
    # mesh is built, and no gloo.
    assert [port for _address, port in raw[0]] == [store_port[0]], raw
    assert all(address in WILDCARDS for address, _port in raw[0]), raw
    assert ports[0] == [store] and ports[1] == [], ports
    # 2 handshakes and garbage at the store, and a TCPStore client there
    assert len(visit.refused) == 3 + 1, visit.refused
    assert visit.received == {}, visit.received
    assert tokens["before"] == expected
    assert tokens["after"] == expected
