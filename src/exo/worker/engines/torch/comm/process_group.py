"""The process group of one model instance's ranks, and the messages rank 0 sends to the
others.

On CPU every message and collective goes over the rank links (`comm/tcp_mesh.py`): the group
is the rendezvous store and the links, and no gloo group is formed, so a rank listens on no
port but the links' listener while the group forms (and rank 0 on the store's): gloo's own
pair listener, which has no authentication and keeps whatever connects to it for the group's
lifetime, is not opened (docs/security.md). `EXO_RANK_LINKS=0` (A/B benches) forms a gloo
group and sends everything over it, as `init_group(with_gloo=True)` forms one beside the
links. With every rank on CUDA, nccl carries the collectives.

Every wait that depends on another rank's compute or on the network is bounded by the group's
timeout (`init_group(timeout_s=...)`), so a dead or stuck rank makes the others raise. Waits
for rank 0's next command (idle between requests, or while rank 0's consumer reads a piece)
are unbounded: a closed connection still makes them raise at once.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import struct
from collections.abc import Callable, Mapping
from concurrent.futures import TimeoutError as FuturesTimeout
from datetime import timedelta
from typing import Any

import psutil
import torch
import torch.distributed as dist

from exo.worker.engines.torch.comm.group_auth import (
    NONCE_BYTES,
    TAG_BYTES,
    AuthenticationError,
    GroupCredentials,
)
from exo.worker.engines.torch.comm.group_store import GroupStore, open_group_store
from exo.worker.engines.torch.comm.link_setup import LinkError
from exo.worker.engines.torch.comm.tcp_mesh import (
    RankLinks,
    current_links,
    links_enabled,
    set_links,
)

# Long enough to mean "forever" for an idle rank, short enough for gloo's millisecond count.
IDLE_WAIT = timedelta(days=30)
# The bound on waits for another rank's compute, set by `init_group`.
_group_timeout = timedelta(seconds=60)
# The authenticated rendezvous store of the current group (None: none, or torch's TCPStore).
_group_store: GroupStore | None = None
# The current group's (rank, world size) while one is formed, with or without torch's.
_group_ranks: tuple[int, int] | None = None
# The links-only group's own TCPStore (no cluster secret), kept while the group lives: a
# rank may still read other ranks' addresses from it after this one finished connecting.
_plain_store: Any = None
_GLOO_PROOF_LABEL = b"exo gloo pair v1"


def group_timeout() -> timedelta:
    """The group's bound on every collective and send/receive (`init_group`'s timeout_s)."""
    return _group_timeout


def local_address_for(master_addr: str) -> str | None:
    """The local address that a connection to `master_addr` leaves from (None if
    `master_addr` does not resolve)."""
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_DGRAM)
    except socket.gaierror:
        return None
    family, _type, _proto, _name, address = infos[0]
    if ipaddress.ip_address(address[0]).is_loopback:
        return str(address[0])
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect((address[0], 9))  # UDP connect sends nothing; picks the route
        return str(probe.getsockname()[0]).split("%")[0]


def local_interface_for(master_addr: str) -> str | None:
    """The name of this machine's network interface holding the local address that a
    connection to `master_addr` leaves from (None if it cannot be found)."""
    local_address = local_address_for(master_addr)
    if local_address is None:
        return None
    for name, addresses in psutil.net_if_addrs().items():
        for entry in addresses:
            if entry.address.split("%")[0] == local_address:
                return name
    if ipaddress.ip_address(local_address).is_loopback:
        return "lo" if "lo" in psutil.net_if_addrs() else None
    return None


def configure_gloo_interface(master_addr: str) -> None:
    """Set GLOO_SOCKET_IFNAME (unless already set) to the interface used to reach
    `master_addr`: gloo otherwise binds to the interface of the hostname's address, which on
    loopback tests may not be loopback."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    interface = local_interface_for(master_addr)
    if interface is not None:
        os.environ["GLOO_SOCKET_IFNAME"] = interface


def init_group(
    backend: str,
    rank: int,
    world_size: int,
    master_addr: str,
    master_port: int,
    timeout_s: float = 60,
    credentials: GroupCredentials | None = None,
    with_gloo: bool = False,
    link_addresses: Mapping[int, str] | None = None,
) -> None:
    """Join the group of one model instance (blocks until every rank joined).

    Args:
        backend: "gloo" (CPU) or "nccl" (every rank on CUDA).
        rank: this process's rank, 0 being the one that serves requests.
        world_size: number of ranks.
        master_addr: address of rank 0's rendezvous store.
        master_port: TCP port of that store.
        timeout_s: bound on every collective and send/receive, seconds.
        credentials: the group key and instance id when the cluster has a secret. Then the
            rendezvous is `comm/group_store.py`'s authenticated store, which rank 0 serves
            on every interface, and the links authenticate; a gloo group's pairs must
            prove the key before any other message crosses them (`prove_gloo_pairs`).
            None: torch's `TCPStore` (every interface, no authentication), as before.
        with_gloo: also form a gloo group beside the links (benches comparing the two).
        link_addresses: where this rank reaches lower ranks other than 0, by rank
            (`ConnectToGroup.link_addresses`); others at the address each published.

    On CPU with more than one rank the ranks connect their `tcp_mesh.RankLinks` and form no
    torch.distributed group: every message and collective goes over the links (see the
    module's docstring). `EXO_RANK_LINKS=0`, or a `master_addr` no local address reaches,
    forms a gloo group instead and sends everything over it; nccl forms its own group.

    Raises:
        torch.distributed.DistError: a rank did not join (or link) within `timeout_s`, or
            (with `credentials`) a peer did not prove the group key.
    """
    global _group_timeout, _group_store, _group_ranks, _plain_store
    _group_timeout = timedelta(seconds=timeout_s)
    timeout = timedelta(seconds=timeout_s)
    local_address = local_address_for(master_addr)
    links_only = (
        backend == "gloo"
        and world_size > 1
        and links_enabled()
        and local_address is not None
        and not with_gloo
    )
    if backend == "gloo" and not links_only:
        configure_gloo_interface(master_addr)
    store: Any
    if credentials is not None:
        store = open_group_store(rank, world_size, master_addr, master_port, credentials, timeout_s)
        _group_store = store
    elif links_only:
        store = dist.TCPStore(
            master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout
        )
        _plain_store = store
    else:
        store = None
    set_links(None)
    try:
        if not links_only:
            if store is None:
                host = f"[{master_addr}]" if ":" in master_addr else master_addr
                dist.init_process_group(
                    backend=backend,
                    init_method=f"tcp://{host}:{master_port}",
                    rank=rank,
                    world_size=world_size,
                    timeout=timeout,
                )
            else:
                dist.init_process_group(
                    backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout
                )
        _group_ranks = (rank, world_size)
        if credentials is not None and backend == "gloo" and world_size > 1 and not links_only:
            prove_gloo_pairs(store, credentials, rank, world_size, timeout_s)
        if backend == "gloo" and world_size > 1 and links_enabled() and local_address is not None:
            links_store = store if store is not None else dist.distributed_c10d._get_default_store()
            set_links(
                RankLinks.connect(
                    links_store,
                    rank,
                    world_size,
                    local_address,
                    timeout_s,
                    credentials,
                    rank_zero_host=master_addr,
                    link_hosts=link_addresses,
                )
            )
    except BaseException:
        destroy_group()
        raise


def group_ranks() -> tuple[int, int] | None:
    """This process's (rank, world size) in its instance's group, None when it has none."""
    return _group_ranks


def prove_gloo_pairs(
    store: Any, credentials: GroupCredentials, rank: int, world_size: int, timeout_s: float
) -> None:
    """Check, before anything else crosses them, that each of this rank's gloo pairs is
    connected to the rank it should be, which must prove the group key over it.

    Why: gloo's listener hands an incoming connection to whichever pair waits for the
    sequence number it sends first, and sequence numbers are small counters; a stranger
    who connects in the moment the group forms can take a pair's place. Each rank puts a
    fresh nonce in the (authenticated) store; each rank sends every other rank, over
    gloo, `HMAC(key, "exo gloo pair v1" | instance | sender | receiver | receiver's
    nonce)` and checks the tag it receives from each. A pair taken by a stranger then
    delivers no valid tag (the stranger lacks the key; the real peer's tag went to the
    stranger's place), the check fails within `timeout_s` and the group is not used.

    Raises:
        AuthenticationError: a pair delivered a wrong tag.
        torch.distributed.DistError: a pair delivered nothing within `timeout_s`.
    """
    own_nonce = secrets.token_bytes(NONCE_BYTES)
    store.set(f"exo_gloo_proof/{rank}", own_nonce.hex())
    others = [other for other in range(world_size) if other != rank]
    received = {other: torch.zeros(TAG_BYTES, dtype=torch.uint8) for other in others}
    receives = {other: dist.irecv(received[other], src=other) for other in others}
    sends = []
    for other in others:
        nonce = bytes.fromhex(store.get(f"exo_gloo_proof/{other}").decode())
        tag = _gloo_tag(credentials, rank, other, nonce)
        sends.append(dist.isend(torch.frombuffer(bytearray(tag), dtype=torch.uint8), dst=other))
    wait = timedelta(seconds=timeout_s)
    for other, work in receives.items():
        assert work is not None
        work.wait(wait)
        expected = _gloo_tag(credentials, other, rank, own_nonce)
        if not hmac.compare_digest(bytes(received[other].numpy()), expected):
            raise AuthenticationError(
                f"rank {rank}: the gloo pair to rank {other} did not prove the group key"
            )
    for work in sends:
        assert work is not None
        work.wait(wait)


def _gloo_tag(credentials: GroupCredentials, sender: int, receiver: int, nonce: bytes) -> bytes:
    return credentials.tag(_GLOO_PROOF_LABEL, struct.pack("!II", sender, receiver), nonce)


def destroy_group() -> None:
    """Leave the default process group, close its links and its rendezvous store (no-op
    if none)."""
    global _group_store, _group_ranks, _plain_store
    set_links(None)
    if dist.is_initialized():
        dist.destroy_process_group()
    if _group_store is not None:
        _group_store.close()
        _group_store = None
    _plain_store = None  # rank 0's store server stops with its last reference
    _group_ranks = None


def _default_group() -> Any:
    return dist.distributed_c10d._get_default_group()


def broadcast_waiting(tensor: torch.Tensor, src: int, timeout: timedelta | None) -> None:
    """`dist.broadcast` with its own timeout (None: the group's)."""
    if timeout is None:
        dist.broadcast(tensor, src=src)
        return
    options = dist.BroadcastOptions()
    options.rootRank = src
    options.rootTensor = 0
    options.timeout = timeout
    _default_group().broadcast([tensor], options).wait()


def receive_waiting(tensor: torch.Tensor, src: int, timeout: timedelta | None) -> None:
    """`dist.recv` with its own timeout (None: the group's)."""
    if timeout is None:
        dist.recv(tensor, src=src)
        return
    work = dist.irecv(tensor, src=src)
    assert work is not None
    work.wait(timeout)


# -- the decode hot path: over the links when the group has them, else gloo ---------------


def _seconds(timeout: timedelta | None) -> float | None:
    """A wait bound for the links: None (unbounded) for `IDLE_WAIT` or longer."""
    if timeout is None:
        return _group_timeout.total_seconds()
    return None if timeout >= IDLE_WAIT else timeout.total_seconds()


def broadcast_tensor(tensor: torch.Tensor, src: int = 0) -> None:
    """Rank `src`'s contiguous CPU `tensor` into every other rank's (same shape and dtype),
    within the group's timeout: a one-off agreement (`EngineTransform.agree`).

    Raises:
        torch.distributed.DistError: a peer is gone or did not send within the timeout.
    """
    links = current_links()
    if links is None:
        dist.broadcast(tensor, src=src)
    elif links.rank == src:
        for other in range(links.world_size):
            if other != src:
                links.send(tensor, other)
    else:
        links.recv(tensor, src)


def send_tensor(tensor: torch.Tensor, dst: int) -> None:
    """Send a contiguous CPU tensor to rank `dst` (which receives the same shape and dtype).

    Raises:
        torch.distributed.DistError: the peer is gone or did not read within the timeout.
    """
    links = current_links()
    if links is not None:
        links.send(tensor, dst)
    else:
        dist.send(tensor, dst=dst)


def receive_tensor(tensor: torch.Tensor, src: int, timeout: timedelta | None = None) -> None:
    """Receive rank `src`'s `send_tensor` into `tensor`, waiting up to `timeout` (None: the
    group's).

    Raises:
        torch.distributed.DistError: the peer is gone or did not send within the bound.
    """
    links = current_links()
    if links is not None:
        links.recv(tensor, src, _seconds(timeout))
    else:
        receive_waiting(tensor, src, timeout)


def post_receive(tensor: torch.Tensor, src: int) -> Callable[[], None]:
    """Start receiving rank `src`'s next `send_tensor` into `tensor` (this rank may send
    meanwhile); return the function that waits for it (bounded by the group's timeout).

    Raises (from the returned function):
        torch.distributed.DistError: the peer is gone or did not send within the timeout.
    """
    links = current_links()
    timeout = _group_timeout
    if links is not None:
        future = links.irecv(tensor, src)

        def wait_links() -> None:
            try:
                future.result(timeout.total_seconds())
            except FuturesTimeout as error:
                raise LinkError(f"rank {src} sent nothing for {timeout} (timeout)") from error

        return wait_links
    work = dist.irecv(tensor, src=src)

    def wait_gloo() -> None:
        assert work is not None
        work.wait(timeout)

    return wait_gloo


def send_message(payload: torch.Tensor, dst: int) -> None:
    """Send a 1-D int64 tensor of any length to rank `dst` (its length first)."""
    links = current_links()
    if links is not None:
        links.send_message(payload, dst)
        return
    dist.send(torch.tensor([payload.numel()], dtype=torch.int64), dst=dst)
    dist.send(payload, dst=dst)


def receive_message(src: int, idle_wait: timedelta) -> torch.Tensor:
    """Receive a `send_message` from rank `src`, waiting up to `idle_wait` for it to start
    (`IDLE_WAIT`: unbounded; a closed link still raises), then the group's timeout."""
    links = current_links()
    if links is not None:
        return links.recv_message(src, _seconds(idle_wait))
    length = torch.zeros(1, dtype=torch.int64)
    receive_waiting(length, src, idle_wait)
    payload = torch.empty(int(length.item()), dtype=torch.int64)
    dist.recv(payload, src=src)
    return payload


def broadcast_message(payload: torch.Tensor | None, idle_wait: timedelta) -> torch.Tensor:
    """Rank 0 sends a 1-D int64 tensor (`payload`) to every rank; the others (`payload`
    None) receive it, waiting up to `idle_wait` for it to start, then the group's timeout."""
    links = current_links()
    if links is not None:
        return links.broadcast_message(payload, 0, _seconds(idle_wait))
    if payload is not None:
        broadcast_waiting(torch.tensor([payload.numel()], dtype=torch.int64), 0, None)
        broadcast_waiting(payload, 0, None)
        return payload
    length = torch.zeros(1, dtype=torch.int64)
    broadcast_waiting(length, 0, idle_wait)
    received = torch.empty(int(length.item()), dtype=torch.int64)
    broadcast_waiting(received, 0, None)
    return received
