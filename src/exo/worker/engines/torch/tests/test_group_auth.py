"""The group handshake (`comm/group_auth.py`), the authenticated rendezvous store
(`comm/group_store.py`) and the authenticated rank links (`comm/tcp_mesh.py`), each rank a
thread of this process on loopback; and the gloo pair proof (`process_group.prove_gloo_pairs`)
with two spawned ranks."""

from __future__ import annotations

import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, TypeVar, cast

import pytest
import torch

from exo.routing.cluster_tls import ClusterSecret
from exo.testing.rank_processes import run_rank_processes
from exo.worker.engines.torch.comm import group_auth
from exo.worker.engines.torch.comm.group_auth import (
    AuthenticationError,
    GroupCredentials,
    Purpose,
    authenticate_client,
    authenticate_server,
)
from exo.worker.engines.torch.comm.group_store import GroupStore, StoreTimeout
from exo.worker.engines.torch.comm.link_setup import LinkError
from exo.worker.engines.torch.comm.tcp_mesh import RankLinks

T = TypeVar("T")

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
CREDENTIALS = GroupCredentials(KEY, "instance-a")


def _both(
    client: Callable[[socket.socket], T], server: Callable[[socket.socket], Any]
) -> tuple[Future[T], Future[Any]]:
    """Run `client` and `server` on the two ends of a loopback TCP connection."""
    listener = socket.create_server(("127.0.0.1", 0))
    outgoing = socket.create_connection(listener.getsockname())
    incoming, _ = listener.accept()
    listener.close()
    pool = ThreadPoolExecutor(2)
    futures = (pool.submit(client, outgoing), pool.submit(server, incoming))
    pool.shutdown(wait=False)
    return futures


def _client(
    credentials: GroupCredentials, rank: int = 1, server_rank: int = 0
) -> Callable[[socket.socket], None]:
    def connect(connection: socket.socket) -> None:
        try:
            authenticate_client(connection, credentials, Purpose.STORE, rank, server_rank)
        except BaseException:
            connection.close()  # as the store and the links do
            raise

    return connect


def _server(credentials: GroupCredentials) -> Callable[[socket.socket], int]:
    def serve(connection: socket.socket) -> int:
        try:
            return authenticate_server(
                connection, credentials, Purpose.STORE, 0, lambda rank: 0 < rank < 4
            )
        finally:
            connection.close()

    return serve


def test_the_right_key_is_accepted_both_ways() -> None:
    client, server = _both(_client(CREDENTIALS, rank=2), _server(CREDENTIALS))
    client.result(timeout=10)
    assert server.result(timeout=10) == 2


@pytest.mark.parametrize(
    "credentials",
    [
        GroupCredentials(OTHER_KEY, "instance-a"),  # another cluster secret
        GroupCredentials(KEY, "instance-b"),  # another instance's group
    ],
)
def test_a_wrong_key_or_instance_is_refused_by_both_ends(credentials: GroupCredentials) -> None:
    client, server = _both(_client(credentials), _server(CREDENTIALS))
    with pytest.raises(AuthenticationError, match="did not prove"):
        client.result(timeout=10)
    with pytest.raises(AuthenticationError):
        server.result(timeout=10)


def test_a_rank_the_server_does_not_accept_is_refused() -> None:
    client, server = _both(_client(CREDENTIALS, rank=7), _server(CREDENTIALS))
    with pytest.raises(AuthenticationError, match="may not connect"):
        server.result(timeout=10)
    with pytest.raises(AuthenticationError):
        client.result(timeout=10)


def test_a_client_that_skips_the_check_and_guesses_a_tag_is_refused() -> None:
    """A stranger speaks the protocol but has no key: its tag (here one made with another
    key) fails the constant-time compare and the server sends no acceptance."""
    stranger = GroupCredentials(OTHER_KEY, "instance-a")

    def guess(connection: socket.socket) -> bytes:
        connection.sendall(b"exoA" + bytes([Purpose.STORE]) + (1).to_bytes(4, "big") + bytes(32))
        challenge = connection.recv(64, socket.MSG_WAITALL)
        connection.sendall(stranger.tag(b"exo group client v1", challenge))
        return connection.recv(1)  # b"": closed without acceptance

    client, server = _both(guess, _server(CREDENTIALS))
    with pytest.raises(AuthenticationError, match="lacks the group key"):
        server.result(timeout=10)
    assert client.result(timeout=10) == b""


class _Recording:
    """A socket stand-in that records what is sent through it."""

    def __init__(self, connection: socket.socket) -> None:
        self.connection = connection
        self.sent = bytearray()

    def sendall(self, data: bytes) -> None:
        self.sent += data
        self.connection.sendall(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connection, name)


def test_a_replayed_client_transcript_is_refused() -> None:
    """Everything a member's client sent in one accepted handshake, sent again on a new
    connection: the server's new nonce makes the recorded tag wrong."""
    recorded: list[_Recording] = []

    def member(connection: socket.socket) -> None:
        recording = _Recording(connection)
        recorded.append(recording)
        authenticate_client(cast(socket.socket, recording), CREDENTIALS, Purpose.STORE, 1, 0)

    client, server = _both(member, _server(CREDENTIALS))
    client.result(timeout=10)
    assert server.result(timeout=10) == 1
    transcript = bytes(recorded[0].sent)

    def replay(connection: socket.socket) -> bytes:
        connection.sendall(transcript[:41])  # the hello
        connection.recv(64, socket.MSG_WAITALL)  # the new challenge, ignored
        connection.sendall(transcript[41:])  # the old proof
        return connection.recv(1)

    replayer, second_server = _both(replay, _server(CREDENTIALS))
    with pytest.raises(AuthenticationError, match="lacks the group key"):
        second_server.result(timeout=10)
    assert replayer.result(timeout=10) == b""


def test_a_replayed_server_challenge_is_refused_by_the_client() -> None:
    """A fake server answering with a challenge recorded from a real one: the client's new
    nonce makes the recorded tag wrong."""
    recorded: list[_Recording] = []

    def member_server(connection: socket.socket) -> int:
        recording = _Recording(connection)
        recorded.append(recording)
        return authenticate_server(
            cast(socket.socket, recording), CREDENTIALS, Purpose.STORE, 0, lambda rank: True
        )

    client, server = _both(_client(CREDENTIALS), member_server)
    client.result(timeout=10)
    server.result(timeout=10)
    challenge = bytes(recorded[0].sent[:64])

    def fake_server(connection: socket.socket) -> None:
        connection.recv(41, socket.MSG_WAITALL)
        connection.sendall(challenge)
        connection.recv(32)

    client, _server_done = _both(_client(CREDENTIALS), fake_server)
    with pytest.raises(AuthenticationError, match="did not prove"):
        client.result(timeout=10)


def test_a_silent_or_trickling_peer_times_out() -> None:
    """The deadline bounds the whole handshake: a peer that sends nothing, or a byte at a
    time, is dropped when it passes."""
    listener = socket.create_server(("127.0.0.1", 0))
    silent = socket.create_connection(listener.getsockname())
    incoming, _ = listener.accept()
    trickler = socket.create_connection(listener.getsockname())
    trickled, _ = listener.accept()
    listener.close()
    stop = threading.Event()

    def trickle() -> None:
        for byte in b"exoA" + bytes(37):
            if stop.wait(0.05):
                return
            trickler.sendall(bytes([byte]))

    sender = threading.Thread(target=trickle)
    sender.start()
    try:
        for connection in (incoming, trickled):
            started = time.monotonic()
            with pytest.raises(AuthenticationError, match="in time"):
                authenticate_server(
                    connection, CREDENTIALS, Purpose.STORE, 0, lambda rank: True, deadline_s=0.3
                )
            assert time.monotonic() - started < 1.0
    finally:
        stop.set()
        sender.join()
        for end in (silent, incoming, trickler, trickled):
            end.close()


def test_the_key_comes_from_the_secret_and_differs_per_secret() -> None:
    first = ClusterSecret("correct horse battery staple")
    assert first.rank_group_key() == ClusterSecret("correct horse battery staple").rank_group_key()
    assert first.rank_group_key() != ClusterSecret("another secret entirely").rank_group_key()
    assert len(first.rank_group_key()) == 32
    assert "key=<hidden>" in repr(GroupCredentials(first.rank_group_key(), "i"))


# -- the store -------------------------------------------------------------------------


@pytest.fixture
def fast_handshakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_auth, "HANDSHAKE_SECONDS", 0.5)


@pytest.fixture
def store_server() -> Iterator[GroupStore]:
    store = GroupStore.serve("127.0.0.1", 0, CREDENTIALS, 3, timeout_s=5)
    yield store
    store.close()


def _port(store: GroupStore) -> int:
    assert store.server is not None
    return store.server.address[1]


def test_the_store_answers_members_with_c10d_semantics(store_server: GroupStore) -> None:
    member = GroupStore.connect("127.0.0.1", _port(store_server), CREDENTIALS, 1, timeout_s=5)
    try:
        member.set("a", b"1")
        assert store_server.get("a") == b"1"
        store_server.set("b", "text")
        assert member.get("b") == b"text"
        assert member.add("n", 2) == 2 and store_server.add("n", 3) == 5
        assert member.check(["a", "b"]) and not member.check(["a", "missing"])
        assert member.compare_set("c", "", "x") == b"x"  # absent counts as empty
        assert member.compare_set("c", "y", "z") == b"x"  # not expected: unchanged
        assert member.num_keys() == store_server.num_keys() == 4
        assert member.delete_key("c") and not member.delete_key("c")
        later = threading.Timer(0.2, lambda: store_server.set("late", b"v"))
        later.start()
        member.wait(["late"], timedelta(seconds=5))  # blocks until set
        assert member.get("late") == b"v"
        with pytest.raises(StoreTimeout):
            member.wait(["never"], timedelta(seconds=0.2))
    finally:
        member.close()


def test_the_store_refuses_a_wrong_key(store_server: GroupStore) -> None:
    stranger = GroupCredentials(OTHER_KEY, "instance-a")
    with pytest.raises(AuthenticationError):
        GroupStore.connect("127.0.0.1", _port(store_server), stranger, 1, timeout_s=5)
    assert store_server.server is not None
    deadline = time.monotonic() + 5
    while store_server.server.refused < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert store_server.server.refused == 1


@pytest.mark.usefixtures("fast_handshakes")
def test_silent_strangers_delay_no_member_of_the_store(store_server: GroupStore) -> None:
    port = _port(store_server)
    strangers = [socket.create_connection(("127.0.0.1", port)) for _ in range(5)]
    try:
        started = time.monotonic()
        member = GroupStore.connect("127.0.0.1", port, CREDENTIALS, 2, timeout_s=5)
        member.set("k", b"v")
        assert store_server.get("k") == b"v"
        assert time.monotonic() - started < 0.4  # before any stranger's deadline
        member.close()
        for stranger in strangers:  # each dropped at its handshake's deadline
            stranger.settimeout(5)
            assert stranger.recv(1) == b""
    finally:
        for stranger in strangers:
            stranger.close()


# -- the links ---------------------------------------------------------------------------


def _mesh(
    store_server: GroupStore,
    credentials: list[GroupCredentials],
    timeout_s: float = 10.0,
) -> list[RankLinks | BaseException]:
    """Every rank of `len(credentials)` builds its links (rank r with credentials[r])."""
    port = _port(store_server)

    def build(rank: int) -> RankLinks:
        store = (
            store_server
            if rank == 0
            else GroupStore.connect("127.0.0.1", port, CREDENTIALS, rank, timeout_s=5)
        )
        return RankLinks.connect(
            store, rank, len(credentials), "127.0.0.1", timeout_s, credentials[rank]
        )

    with ThreadPoolExecutor(len(credentials)) as pool:
        futures = [pool.submit(build, rank) for rank in range(len(credentials))]
        results: list[RankLinks | BaseException] = []
        for future in futures:
            try:
                results.append(future.result(timeout=30))
            except BaseException as error:
                results.append(error)
    return results


@pytest.mark.usefixtures("fast_handshakes")
def test_links_form_past_a_silent_stranger_and_carry_tensors(store_server: GroupStore) -> None:
    """A stranger that knows rank 0's link address (published in the store) connects first
    and says nothing; ranks 1 and 2 still link at once, and the mesh works."""
    strangers: list[socket.socket] = []

    def squat() -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if store_server.check(["exo_links/0"]):
                port, address = store_server.get("exo_links/0").decode().split(" ")
                strangers.append(socket.create_connection((address, int(port))))
                return
            time.sleep(0.001)

    squatter = threading.Thread(target=squat)
    squatter.start()
    started = time.monotonic()
    mesh = _mesh(store_server, [CREDENTIALS] * 3)
    squatter.join()
    try:
        assert all(isinstance(links, RankLinks) for links in mesh), mesh
        assert time.monotonic() - started < 10
        first, second, _third = cast(list[RankLinks], mesh)
        sent = torch.arange(6, dtype=torch.float32)
        received = torch.zeros(6)
        second.send(sent, 0)
        first.recv(received, 1)
        assert torch.equal(received, sent)
    finally:
        for links in mesh:
            if isinstance(links, RankLinks):
                links.close()
        for stranger in strangers:
            stranger.close()


def test_a_rank_with_another_key_gets_no_link(store_server: GroupStore) -> None:
    """Rank 1 holds another cluster's key: rank 1 finds rank 0 unproven, rank 0 never gets
    a proven rank 1; both raise instead of linking."""
    outsider = GroupCredentials(OTHER_KEY, "instance-a")
    first, second = _mesh(store_server, [CREDENTIALS, outsider], timeout_s=2.0)
    assert isinstance(first, LinkError), first
    assert isinstance(second, LinkError) and "failed" in str(second), second


# -- gloo's pairs ------------------------------------------------------------------------


def _proof_rank(rank: int, world_size: int, port: int, results: Any) -> None:
    """Prove the pairs twice on one group: every rank with the key, then rank 1 with
    another key."""
    import torch.distributed as dist

    from exo.worker.engines.torch.comm.process_group import prove_gloo_pairs

    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=20),
        )  # fmt: skip
        store = dist.distributed_c10d._get_default_store()
        for attempt, key in enumerate((KEY, KEY if rank == 0 else OTHER_KEY)):
            prefixed = dist.PrefixStore(f"attempt{attempt}", store)
            try:
                prove_gloo_pairs(
                    prefixed, GroupCredentials(key, "instance-a"), rank, world_size, 10
                )
                results.put(("proved", attempt, rank))
            except AuthenticationError:
                results.put(("refused", attempt, rank))
        dist.destroy_process_group()
        results.put(("done", rank))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))


def test_gloo_pairs_must_prove_the_key() -> None:
    reports = run_rank_processes(_proof_rank, (), 2, deadline=120)
    assert sorted(reports) == [
        ("proved", 0, 0), ("proved", 0, 1), ("refused", 1, 0), ("refused", 1, 1),
    ]  # fmt: skip
