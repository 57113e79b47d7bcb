"""Rank-to-rank links: a full mesh of TCP connections between one instance's ranks, for the
small, latency-bound messages of the decode hot path (tensor-parallel all-reduces of a few
rows, pipeline step headers, hidden states and logits).

Why not gloo for these: on one pinned core per node, a gloo all-reduce of a `[1, 1024]`
float32 row costs milliseconds (its progress thread must be scheduled on the busy core, then
wake the caller), which for a 28-layer model with two all-reduces per layer is most of a
decode token. A blocking `recv_into` on a `TCP_NODELAY` socket from the computing thread
costs one wake-up (`bench/bench_links.py` measures both; figures:
docs/benchmarks/engine-design-figures.md#tcp_meshpy and
docs/benchmarks/2026-12-03-rank-links.md). On CPU they carry everything else too (one-off
agreements, prefill's large all-reduces): no gloo group is formed beside them
(`process_group.init_group`), so no rank opens gloo's unauthenticated pair listener.

Set-up (`RankLinks.connect`): `comm/link_setup.py` forms the mesh (every rank listens,
publishes its address in the rendezvous store, connects to the lower ranks and accepts the
higher ones, each connection opening with the group handshake or a token hello).

Errors: a closed connection, a reset, or a wait past the group's timeout raise `LinkError`, a
`torch.distributed.DistNetworkError`, so callers treat it as they treat gloo's failures.
Authentication happens once, at connect: the per-message path is the same with or without
a secret, and carries no encryption (docs/security.md).
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from exo.worker.engines.torch.comm.group_auth import GroupCredentials
from exo.worker.engines.torch.comm.link_setup import LinkError, connect_peers, receive_exactly

# All-reduces of at most this many bytes per rank send before they receive (one message
# latency); larger ones (long prefills) receive on helper threads while they send
# (`RankLinks.all_reduce_sum`). Two ranks both `sendall` this much before either reads, so it
# must fit the kernel's socket buffers (we ask for `_BUFFER_BYTES` each way and check what we
# got).
SMALL_BYTES = 256 * 1024
_BUFFER_BYTES = 1 << 20
_LENGTH = struct.Struct("!q")
DEFAULT_SPIN_US = 1000


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (any dtype)."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        raise ValueError("links carry contiguous CPU tensors only")
    array: Any = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class RankLinks:
    """This rank's TCP connection to every other rank of the group.

    Not thread-safe, except that `irecv` receives on one helper thread per peer: do not
    `recv` from a peer that has an `irecv` pending.
    """

    def __init__(
        self, rank: int, world_size: int, peers: dict[int, socket.socket], timeout_s: float
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self._peers = peers
        self._receivers: dict[int, ThreadPoolExecutor] = {}
        self._scratch: dict[tuple[torch.dtype, int], list[torch.Tensor]] = {}
        self.spin_s = spin_seconds()
        # A second socket object on each connection (the same open file), non-blocking,
        # for the spin: the connection's own keeps its timeout for the threads that send
        # on it meanwhile (Python's timeout is per socket object).
        self._pollers = {other: _poller(peer) for other, peer in peers.items()}
        self.small_bytes = SMALL_BYTES
        for peer in peers.values():
            sent = peer.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            self.small_bytes = min(self.small_bytes, sent // 2)

    # -- set-up ---------------------------------------------------------------------------

    @classmethod
    def connect(
        cls,
        store: Any,
        rank: int,
        world_size: int,
        host: str,
        timeout_s: float,
        credentials: GroupCredentials | None = None,
        rank_zero_host: str | None = None,
        link_hosts: Mapping[int, str] | None = None,
    ) -> RankLinks:
        """Build the mesh through the group's rendezvous `store` (a `torch.distributed.Store`
        every rank shares); `host` is the local address the other ranks can reach.

        `rank_zero_host`: the address this rank reaches rank 0 at (its rendezvous address).
        When given, every rank listens on every interface and links to rank 0 there, as it
        reached its store: ranks may reach rank 0, and each other, on different networks.
        `link_hosts[other]`: the address this rank reaches the lower rank `other` at (the
        measured topology's, `ConnectToGroup.link_addresses`); a rank not in it is reached
        at the address it published (its `host`, the one it reaches rank 0 from).

        With `credentials` (the cluster has a secret) each connection opens with the group
        handshake (`comm/group_auth.py`) bound to this group's token, both ends proving the
        key; without, with the hello carrying the token. Accepted connections are checked
        on threads of their own, each within `HANDSHAKE_SECONDS`, so a stranger that
        connects and stays silent delays no rank.

        Raises:
            LinkError: a rank did not connect within `timeout_s`, or a lower rank did not
                prove the group key.
        """
        deadline = time.monotonic() + timeout_s
        peers = connect_peers(
            store, rank, world_size, host, deadline, credentials, rank_zero_host, link_hosts
        )
        for connection in peers.values():
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
            connection.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
            connection.settimeout(timeout_s)
        return cls(rank, world_size, peers, timeout_s)

    def close(self) -> None:
        """Close every connection (idempotent); peers waiting on this rank raise."""
        for receiver in self._receivers.values():
            receiver.shutdown(wait=False, cancel_futures=True)
        self._receivers.clear()
        for connection in self._peers.values():
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
            connection.close()
        self._peers.clear()
        for poller in self._pollers.values():
            poller.close()
        self._pollers.clear()

    # -- point to point -------------------------------------------------------------------

    def _peer(self, other: int) -> socket.socket:
        try:
            return self._peers[other]
        except KeyError:
            raise LinkError(f"rank {self.rank} has no link to rank {other}") from None

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Send a contiguous CPU tensor's bytes to rank `dst` (it must `recv` the same shape
        and dtype). Blocks until the kernel took them (bounded by the timeout).

        Raises:
            LinkError: the peer is gone or did not read within the timeout.
        """
        self._send_bytes(_byte_view(tensor), dst)

    def _send_bytes(self, data: memoryview | bytes, dst: int) -> None:
        connection = self._peer(dst)
        try:
            connection.sendall(data)
        except OSError as error:
            raise LinkError(f"rank {self.rank}: sending to rank {dst} failed: {error}") from error

    def recv(
        self, tensor: torch.Tensor, src: int, timeout_s: float | None = -1.0, spin: bool = True
    ) -> None:
        """Receive rank `src`'s next `send` into `tensor` (contiguous CPU, same byte size).

        Args:
            timeout_s: bound on the whole wait, seconds; -1: the group's; None: unbounded
                (a closed connection still raises at once).
            spin: poll without sleeping for the first `spin_s` of the wait (see
                `spin_seconds`); off for receives on helper threads.

        Raises:
            LinkError: the peer closed its link or did not send within the bound.
        """
        self._recv_bytes(_byte_view(tensor), src, timeout_s, spin)

    def _recv_bytes(
        self, view: memoryview, src: int, timeout_s: float | None = -1.0, spin: bool = True
    ) -> None:
        connection = self._peer(src)
        got = 0
        if spin and self.spin_s > 0:
            got = _spin_receive(self._pollers[src], view, self.spin_s)
            if got == len(view):
                return
        bound = self.timeout_s if timeout_s == -1.0 else timeout_s
        if bound != self.timeout_s:
            connection.settimeout(bound)
        try:
            receive_exactly(connection, view[got:])
        except TimeoutError as error:
            raise LinkError(
                f"rank {self.rank}: rank {src} sent nothing for {bound} s (timeout)"
            ) from error
        except OSError as error:
            raise LinkError(
                f"rank {self.rank}: receiving from rank {src} failed: {error}"
            ) from error
        finally:
            if bound != self.timeout_s:
                connection.settimeout(self.timeout_s)

    def irecv(self, tensor: torch.Tensor, src: int) -> Future[None]:
        """Receive rank `src`'s next `send` into `tensor` on a helper thread (so this rank
        can send meanwhile); `result(timeout)` on the future waits for it and re-raises."""
        receiver = self._receivers.get(src)
        if receiver is None:
            receiver = ThreadPoolExecutor(1, thread_name_prefix=f"exo-link-{src}")
            self._receivers[src] = receiver
        return receiver.submit(self.recv, tensor, src, -1.0, False)

    def send_message(self, payload: torch.Tensor, dst: int) -> None:
        """Send a 1-D int64 tensor of any length (its length first, in the same write)."""
        length = _LENGTH.pack(payload.numel())
        self._send_bytes(length + bytes(_byte_view(payload)), dst)

    def recv_message(self, src: int, timeout_s: float | None = -1.0) -> torch.Tensor:
        """Receive a `send_message` (waiting up to `timeout_s` for it, see `recv`)."""
        length = bytearray(_LENGTH.size)
        self._recv_bytes(memoryview(length), src, timeout_s)
        (count,) = _LENGTH.unpack(length)
        payload = torch.empty(count, dtype=torch.int64)
        if count:
            self.recv(payload, src)
        return payload

    # -- collectives ----------------------------------------------------------------------

    def all_reduce_sum(self, tensor: torch.Tensor) -> None:
        """Sum `tensor` over every rank, in place (contiguous CPU).

        Every rank sends its tensor to every other, then adds the received ones in rank
        order (rank 0's first), so every rank computes the same bits. Up to `small_bytes`
        it sends first and then receives (one one-way message latency); above, it receives
        on helper threads while it sends (`all_gather`: both ranks' sends need not fit the
        socket buffers) into buffers of its own. Bytes sent per rank: `world_size - 1`
        times the tensor, as much as a ring all-reduce sends for two ranks, a third more
        for three (a ring sends `2 (world_size - 1) / world_size` times); the ranks of a
        CPU split are few.

        Raises:
            LinkError: a peer is gone or did not send within the timeout.
        """
        size = tensor.numel() * tensor.element_size()
        others = [other for other in range(self.world_size) if other != self.rank]
        parts: list[torch.Tensor] = []
        if size > self.small_bytes:
            flat_local = tensor.reshape(-1)
            received = {other: torch.empty_like(flat_local) for other in others}
            self.all_gather(flat_local, received)
            parts = [
                flat_local if other == self.rank else received[other]
                for other in range(self.world_size)
            ]
        else:
            view = _byte_view(tensor)
            for other in others:
                self._send_bytes(view, other)
            key = (tensor.dtype, tensor.numel())
            scratch = self._scratch.get(key)
            if scratch is None:
                scratch = [torch.empty(tensor.numel(), dtype=tensor.dtype) for _ in self._peers]
                self._scratch[key] = scratch
            buffers = iter(scratch)
            for other in range(self.world_size):
                if other == self.rank:
                    parts.append(tensor.reshape(-1))
                    continue
                buffer = next(buffers)
                self.recv(buffer, other)
                parts.append(buffer)
        flat = tensor.reshape(-1)
        if self.world_size == 2:
            torch.add(parts[0], parts[1], out=flat)  # a + b: the same bits on both ranks
            return
        total = parts[0].clone()
        for part in parts[1:]:
            total.add_(part)
        flat.copy_(total)

    def all_gather(self, local: torch.Tensor, parts: dict[int, torch.Tensor]) -> None:
        """Send `local` (contiguous CPU) to every other rank and receive each other rank's
        into `parts[rank]` (its shape and dtype), in place. The receives run on helper
        threads while this thread sends (`irecv`), so any size goes through without both
        ranks' sends having to fit the socket buffers. Cost: one one-way latency plus the
        bytes of the parts; no rank sends more than its own tensor to each other rank
        (an all-reduce of a zero-padded whole sends the whole to each).

        Raises:
            LinkError: a peer is gone or did not send within the timeout.
            ValueError: `parts` does not name exactly the other ranks.
        """
        others = [other for other in range(self.world_size) if other != self.rank]
        if sorted(parts) != others:
            raise ValueError(f"rank {self.rank} gathers from ranks {others}, not {sorted(parts)}")
        received = {other: self.irecv(parts[other], other) for other in others}
        view = _byte_view(local)
        for other in others:
            self._send_bytes(view, other)
        for future in received.values():
            future.result(self.timeout_s + 1.0)

    def broadcast_message(
        self, payload: torch.Tensor | None, src: int, timeout_s: float | None = -1.0
    ) -> torch.Tensor:
        """`send_message` from `src` to every other rank (`payload` set on `src` only);
        the others receive it, waiting up to `timeout_s` (see `recv`)."""
        if self.rank == src:
            assert payload is not None
            for other in range(self.world_size):
                if other != src:
                    self.send_message(payload, other)
            return payload
        return self.recv_message(src, timeout_s)


def spin_seconds() -> float:
    """How long a rank polls its link before it sleeps in the kernel waiting for data:
    `EXO_LINK_SPIN_US` microseconds (default `DEFAULT_SPIN_US`; 0: never).

    A rank that sleeps leaves its core idle, and waking an idle core costs more than the
    message: on the 2-core VMs an idle vCPU halts and is woken through the hypervisor.
    Decode's all-reduces wait tens to hundreds of microseconds for the slower rank, so a
    rank that polls through them never sleeps during a step; longer waits (between steps,
    between requests) still sleep after the spin.

    Raises:
        ValueError: the variable is not a whole number of microseconds >= 0.
    """
    text = os.environ.get("EXO_LINK_SPIN_US", str(DEFAULT_SPIN_US))
    if not text.strip().isdigit():
        raise ValueError(f"EXO_LINK_SPIN_US={text!r}: a whole number of microseconds >= 0")
    return int(text) / 1e6


def _poller(connection: socket.socket) -> socket.socket:
    poller = socket.socket(fileno=os.dup(connection.fileno()))
    poller.setblocking(False)
    return poller


def _spin_receive(poller: socket.socket, view: memoryview, spin_s: float) -> int:
    """Read what arrives on `poller` (non-blocking) into `view` for up to `spin_s`
    seconds; returns the bytes read (all of `view` at most).

    Raises:
        LinkError: the other rank closed its link.
    """
    got = 0
    total = len(view)
    deadline = time.perf_counter() + spin_s
    while got < total:
        try:
            # MSG_DONTWAIT: never blocks, even while another thread has the connection in
            # blocking mode (`settimeout(None)` clears the shared O_NONBLOCK).
            count = poller.recv_into(view[got:], total - got, socket.MSG_DONTWAIT)
        except BlockingIOError:
            if time.perf_counter() > deadline:
                break
            continue
        except OSError as error:
            raise LinkError(f"receiving failed: {error}") from error
        if count == 0:
            raise LinkError("the other rank closed its link")
        got += count
    return got


# -- the process's links (one group per process) ----------------------------------------

_links: RankLinks | None = None


def links_enabled() -> bool:
    """Whether new groups build links (`EXO_RANK_LINKS=0` keeps every message on gloo, for
    A/B benches)."""
    return os.environ.get("EXO_RANK_LINKS", "1") != "0"


def set_links(links: RankLinks | None) -> None:
    """Install (or clear, closing the old ones) this process's links."""
    global _links
    if _links is not None and _links is not links:
        _links.close()
    _links = links


def current_links() -> RankLinks | None:
    """This process's links, if its group built them."""
    return _links


def all_reduce_sum(tensor: torch.Tensor) -> None:
    """Sum `tensor` over the group's ranks in place: over the links when they exist and the
    tensor is on the CPU, else `torch.distributed.all_reduce` (nccl on CUDA; gloo with
    `EXO_RANK_LINKS=0`). A non-contiguous tensor is summed through a contiguous copy (gloo
    reduced one's storage as if it were contiguous)."""
    if not tensor.is_contiguous():
        summed = tensor.contiguous()
        all_reduce_sum(summed)
        tensor.copy_(summed)
        return
    links = _links
    if links is not None and tensor.device.type == "cpu":
        links.all_reduce_sum(tensor)
    else:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
