"""The rank-to-rank links (`comm/tcp_mesh.py`): each rank is a thread of this process, the mesh is
built through a real `TCPStore` on loopback."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import torch
import torch.distributed as dist

from exo.worker.engines.torch.comm.link_setup import LinkError
from exo.worker.engines.torch.comm.tcp_mesh import RankLinks
from exo.worker.engines.torch.tests.conftest import LinkStores

T = TypeVar("T")


def _on_every_rank(mesh: list[RankLinks], work: Callable[[RankLinks], T]) -> list[T]:
    with ThreadPoolExecutor(len(mesh)) as pool:
        futures = [pool.submit(work, links) for links in mesh]
        return [future.result(timeout=30) for future in futures]


def test_send_and_receive_tensors_and_messages(make_mesh: Callable[..., list[RankLinks]]) -> None:
    first, second = make_mesh(2)
    sent = torch.arange(12, dtype=torch.bfloat16).reshape(3, 4) / 7
    received = torch.zeros_like(sent)
    first.send(sent, 1)
    second.recv(received, 0)
    assert torch.equal(received, sent)
    second.send_message(torch.tensor([5, -1, 2**40]), 0)
    second.send_message(torch.tensor([], dtype=torch.int64), 0)
    assert first.recv_message(1).tolist() == [5, -1, 2**40]
    assert first.recv_message(1).tolist() == []


def test_broadcast_message_reaches_every_rank(make_mesh: Callable[..., list[RankLinks]]) -> None:
    mesh = make_mesh(3)
    payload = torch.tensor([3, 1, 4, 1, 5])
    got = _on_every_rank(
        mesh, lambda links: links.broadcast_message(payload if links.rank == 0 else None, 0)
    )
    assert all(message.tolist() == payload.tolist() for message in got)


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_equals_reference_sum_on_every_rank(
    make_mesh: Callable[..., list[RankLinks]], world_size: int
) -> None:
    mesh = make_mesh(world_size)
    generator = torch.Generator().manual_seed(0)
    inputs = [torch.randn(4, 1024, generator=generator) for _ in range(world_size)]
    reference = inputs[0].clone()
    for part in inputs[1:]:
        reference += part

    def reduce(links: RankLinks) -> torch.Tensor:
        tensor = inputs[links.rank].clone()
        for _ in range(3):  # the same buffers again: scratch reuse
            tensor.copy_(inputs[links.rank])
            links.all_reduce_sum(tensor)
        return tensor

    results = _on_every_rank(mesh, reduce)
    for result in results:
        assert torch.equal(result, reference)  # rank order: the same bits everywhere


@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_past_the_socket_buffers_equals_the_reference_sum(
    make_mesh: Callable[..., list[RankLinks]], world_size: int
) -> None:
    """A prefill's all-reduce (4 MiB per rank, past `small_bytes` and the kernel's socket
    buffers, which the small path's send-then-receive would deadlock on) receives while it
    sends, and still sums in rank order: the same bits on every rank as the small path."""
    mesh = make_mesh(world_size)
    generator = torch.Generator().manual_seed(1)
    inputs = [torch.randn(512, 2048, generator=generator) for _ in range(world_size)]
    assert inputs[0].numel() * 4 > 4 * max(links.small_bytes for links in mesh)
    reference = inputs[0].clone()
    for part in inputs[1:]:
        reference += part

    def reduce(links: RankLinks) -> torch.Tensor:
        tensor = inputs[links.rank].clone()
        links.all_reduce_sum(tensor)
        return tensor

    for result in _on_every_rank(mesh, reduce):
        assert torch.equal(result, reference)


def test_posted_receive_lets_both_ranks_send_large_messages(
    make_mesh: Callable[..., list[RankLinks]],
) -> None:
    """Rank 0 posts the receive of 8 MB of logits, then sends 8 MB of hidden states while
    rank 1 first sends its logits: far past the socket buffers, no deadlock."""
    first, second = make_mesh(2)
    logits = torch.empty(2 * 1024 * 1024)
    hidden = torch.full((2 * 1024 * 1024,), 2.0)

    def last_rank() -> torch.Tensor:
        second.send(torch.full((2 * 1024 * 1024,), 3.0), 0)
        received = torch.empty_like(hidden)
        second.recv(received, 0)
        return received

    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(last_rank)
        pending = first.irecv(logits, 1)
        first.send(hidden, 1)
        pending.result(timeout=30)
        assert torch.equal(other.result(timeout=30), hidden)
    assert bool((logits == 3.0).all())


def test_all_gather_delivers_every_rank_s_part_past_the_socket_buffers(
    make_mesh: Callable[..., list[RankLinks]],
) -> None:
    """Three ranks, parts of different widths and 2-4 MiB each (larger than what both ends'
    socket buffers hold): every rank ends with every other rank's tensor, bit for bit."""
    mesh = make_mesh(3)
    widths = {0: 1 << 19, 1: 1 << 19, 2: 3 << 18}
    local = {
        rank: torch.randn(2, width, generator=torch.Generator().manual_seed(rank))
        for rank, width in widths.items()
    }

    def work(links: RankLinks) -> dict[int, torch.Tensor]:
        parts = {other: torch.empty(2, widths[other]) for other in widths if other != links.rank}
        links.all_gather(local[links.rank], parts)
        return parts

    for links, parts in zip(mesh, _on_every_rank(mesh, work), strict=True):
        assert sorted(parts) == [other for other in range(3) if other != links.rank]
        for other, part in parts.items():
            assert torch.equal(part, local[other])
    with pytest.raises(ValueError, match="gathers from"):
        mesh[0].all_gather(local[0], {1: torch.empty(2, widths[1])})


def test_dead_peer_raises_at_once(make_mesh: Callable[..., list[RankLinks]]) -> None:
    first, second = make_mesh(2, timeout_s=30)
    second.close()
    started = time.monotonic()
    with pytest.raises(LinkError):
        first.recv(torch.empty(4), 1)
    assert time.monotonic() - started < 5  # EOF, not the 30 s timeout
    with pytest.raises(dist.DistError):  # what the runner reads as "a peer left"
        first.all_reduce_sum(torch.ones(4))


def test_silent_peer_raises_after_the_timeout(make_mesh: Callable[..., list[RankLinks]]) -> None:
    first, _second = make_mesh(2, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(LinkError, match="timeout"):
        first.recv(torch.empty(4), 1)
    elapsed = time.monotonic() - started
    assert 0.4 < elapsed < 10
    with pytest.raises(LinkError, match="timeout"):
        first.recv_message(1, timeout_s=0.2)


def test_a_stranger_cannot_take_a_rank_s_place() -> None:
    """A connection without the group's token is dropped; the mesh still forms."""
    stores = LinkStores()
    store = stores.client()
    listener_ready = threading.Event()

    def stranger() -> None:
        listener_ready.wait(10)
        port, address = store.get("exo_links/0").decode().split(" ")
        with socket.create_connection((address, int(port)), timeout=5) as connection:
            connection.sendall(b"\x65\x78\x6f\x4c" + b"\x00\x00\x00\x01" + b"x" * 16)
            time.sleep(0.2)

    with ThreadPoolExecutor(3) as pool:
        first = pool.submit(RankLinks.connect, stores.client(), 0, 2, "127.0.0.1", 10.0)
        deadline = time.monotonic() + 30
        while not store.check(["exo_links/0"]):
            assert time.monotonic() < deadline, "rank 0 never published its listener"
            time.sleep(0.01)
        listener_ready.set()
        pool.submit(stranger).result(timeout=10)
        second = pool.submit(RankLinks.connect, stores.client(), 1, 2, "127.0.0.1", 10.0)
        mesh = [first.result(timeout=30), second.result(timeout=30)]
    try:
        mesh[1].send(torch.ones(3), 0)
        received = torch.zeros(3)
        mesh[0].recv(received, 1)
        assert received.tolist() == [1.0, 1.0, 1.0]
    finally:
        for links in mesh:
            links.close()


def test_close_is_idempotent_and_refuses_later_sends(
    make_mesh: Callable[..., list[RankLinks]],
) -> None:
    first, _second = make_mesh(2)
    first.close()
    first.close()
    with pytest.raises(LinkError, match="no link"):
        first.send(torch.ones(1), 1)


def test_a_receive_polls_through_the_spin_then_sleeps_for_the_rest(
    make_mesh: Callable[..., list[RankLinks]], monkeypatch: pytest.MonkeyPatch
) -> None:
    import exo.worker.engines.torch.comm.tcp_mesh as links_module

    first, second = make_mesh(2)
    second.spin_s = 0.005
    blocking_reads: list[int] = []
    entered_blocking_read = threading.Event()
    real_receive = links_module.receive_exactly

    def counted(connection: socket.socket, view: memoryview) -> None:
        blocking_reads.append(len(view))
        entered_blocking_read.set()
        real_receive(connection, view)

    monkeypatch.setattr(links_module, "receive_exactly", counted)
    sent = torch.arange(64, dtype=torch.float32)
    # Already there: read whole by the spin, the kernel's blocking wait never entered.
    first.send(sent, 1)
    received = torch.zeros_like(sent)
    second.recv(received, 0)
    assert torch.equal(received, sent) and blocking_reads == []
    # Part there already, the rest long after the spin: it comes through the blocking read.
    data = sent.numpy().tobytes()
    first._send_bytes(data[:100], 1)

    def late_half() -> None:
        # Sent only once the receive sleeps in the kernel, however late the spin ran; the
        # deadline only keeps a broken receive from hanging the test.
        entered_blocking_read.wait(10)
        first._send_bytes(data[100:], 1)

    sender = threading.Thread(target=late_half)
    sender.start()
    received.zero_()
    second.recv(received, 0)
    sender.join(10)
    assert torch.equal(received, sent)
    assert blocking_reads == [len(data) - 100]
    # Without a spin every receive sleeps in the kernel at once.
    second.spin_s = 0.0
    first.send(sent, 1)
    second.recv(received, 0)
    assert blocking_reads[-1] == len(data)


def test_the_spin_is_set_in_microseconds_and_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    from exo.worker.engines.torch.comm.tcp_mesh import DEFAULT_SPIN_US, spin_seconds

    monkeypatch.delenv("EXO_LINK_SPIN_US", raising=False)
    assert spin_seconds() == DEFAULT_SPIN_US / 1e6
    monkeypatch.setenv("EXO_LINK_SPIN_US", "0")
    assert spin_seconds() == 0.0
    monkeypatch.setenv("EXO_LINK_SPIN_US", "250")
    assert spin_seconds() == 250e-6
    for bad in ("-5", "1.5", "soon"):
        monkeypatch.setenv("EXO_LINK_SPIN_US", bad)
        with pytest.raises(ValueError, match="EXO_LINK_SPIN_US"):
            spin_seconds()
