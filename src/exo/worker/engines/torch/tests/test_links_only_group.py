"""A CPU instance's group without gloo (`comm/process_group.init_group`): two spawned ranks
form their group from the rendezvous store and the rank links only, with and without a
cluster secret. No torch.distributed group exists; the one-off agreement
(`broadcast_tensor`), a prefill-sized all-reduce past the socket buffers and point-to-point
tensors go over the links; while the group lives rank 1 listens on no port and rank 0 only
on the rendezvous port (gloo's unauthenticated pair listener is never opened), and after
`destroy_group` neither listens on anything. With `EXO_RANK_LINKS=0` the same calls go
over a gloo group instead (the fallback the A/B benches use), whose pair listener rank 1
then holds.
"""

from __future__ import annotations

import traceback
from typing import Any

import pytest

from exo.testing.rank_processes import run_rank_processes

GROUP_DEADLINE_S = 120.0
KEY = bytes(range(32))


def _listening_ports() -> set[int]:
    import psutil

    return {
        connection.laddr.port
        for connection in psutil.Process().net_connections(kind="inet")
        if connection.status == psutil.CONN_LISTEN
    }


def _rank_main(rank: int, world_size: int, port: int, results: Any, secret: bool) -> None:
    try:
        import os

        import torch
        import torch.distributed as dist

        from exo.worker.engines.torch.comm.group_auth import GroupCredentials
        from exo.worker.engines.torch.comm.process_group import (
            broadcast_tensor,
            destroy_group,
            group_ranks,
            init_group,
            receive_tensor,
            send_tensor,
        )
        from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum, current_links

        credentials = GroupCredentials(KEY, "instance-links-only") if secret else None
        init_group("gloo", rank, world_size, "127.0.0.1", port, 30, credentials)
        results.put(("formed", rank, dist.is_initialized(), group_ranks(), _listening_ports()))
        assert (current_links() is None) == (os.environ.get("EXO_RANK_LINKS") == "0")

        agreed = torch.tensor([7 if rank == 0 else -1], dtype=torch.int64)
        broadcast_tensor(agreed, src=0)
        generator = torch.Generator().manual_seed(rank)
        large = torch.randn(512, 1024, generator=generator)  # 2 MiB: past small_bytes
        mine = large.clone()
        all_reduce_sum(large)
        column = torch.randn(64, 8, generator=generator)[:, 1]  # not contiguous
        column_before = column.clone()
        all_reduce_sum(column)
        if rank == 0:
            send_tensor(torch.arange(6, dtype=torch.float32), 1)
            received = None
        else:
            received = torch.empty(6)
            receive_tensor(received, 0)
        # As bytes: a tensor on the queue is shared memory that dies with this process.
        as_bytes = [t.contiguous().numpy().tobytes() for t in (mine, large, column_before, column)]
        results.put(("ran", rank, int(agreed.item()), *as_bytes))
        results.put(("received", rank, None if received is None else received.tolist()))
        destroy_group()
        results.put(("destroyed", rank, group_ranks(), _listening_ports()))
        results.put(("done", "", rank, None))
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))


@pytest.mark.parametrize(
    ("secret", "gloo"),
    [(False, False), (True, False), (False, True)],
    ids=["open", "secret", "gloo-fallback"],
)
def test_cpu_group_forms_and_runs_on_the_links_alone(
    secret: bool, gloo: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    if gloo:
        monkeypatch.setenv("EXO_RANK_LINKS", "0")  # the spawned ranks inherit it
    reports = run_rank_processes(_rank_main, (secret,), 2, GROUP_DEADLINE_S)
    by_kind: dict[str, dict[int, tuple[Any, ...]]] = {}
    for report in reports:
        by_kind.setdefault(report[0], {})[report[1]] = report[2:]

    formed = by_kind["formed"]
    ports = {rank: formed[rank][2] for rank in (0, 1)}
    for rank in (0, 1):
        torch_group, ranks, _ = formed[rank]
        assert torch_group is gloo  # no gloo group unless asked for
        assert ranks == (rank, 2)
    if gloo:
        assert ports[1]  # gloo's pair listener, which the links-only group never opens
    else:
        assert ports[1] == set()  # rank 1: the links' listener closed once the mesh was built
        assert len(ports[0]) == 1  # rank 0: its rendezvous store only

    ran = by_kind["ran"]
    assert ran[0][0] == ran[1][0] == 7

    def tensor(rank: int, index: int) -> torch.Tensor:
        return torch.frombuffer(bytearray(ran[rank][index]), dtype=torch.float32)

    total = tensor(0, 1) + tensor(1, 1)  # rank order, as the links sum
    assert torch.equal(tensor(0, 2), total) and torch.equal(tensor(1, 2), total)
    column_total = tensor(0, 3) + tensor(1, 3)
    assert torch.equal(tensor(0, 4), column_total) and torch.equal(tensor(1, 4), column_total)
    assert by_kind["received"][1][0] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]

    for rank in (0, 1):
        ranks_after, ports_after = by_kind["destroyed"][rank]
        assert ranks_after is None
        assert ports_after == set()


def _rank_reaching_rank_zero_elsewhere(rank: int, world_size: int, port: int, results: Any) -> None:
    """A rank of a 3-rank group with a secret whose last rank reaches rank 0 at 127.0.0.2
    while the others reach it at 127.0.0.1 (two networks to one node, as placement's
    measured `Rendezvous.addresses` may say)."""
    try:
        import torch

        from exo.worker.engines.torch.comm.group_auth import GroupCredentials
        from exo.worker.engines.torch.comm.process_group import (
            broadcast_tensor,
            destroy_group,
            init_group,
        )
        from exo.worker.engines.torch.comm.tcp_mesh import all_reduce_sum

        credentials = GroupCredentials(KEY, "instance-two-networks")
        master_addr = "127.0.0.2" if rank == world_size - 1 else "127.0.0.1"
        init_group("gloo", rank, world_size, master_addr, port, 30, credentials)
        agreed = torch.tensor([5 if rank == 0 else -1], dtype=torch.int64)
        broadcast_tensor(agreed, src=0)
        summed = torch.full((4,), float(rank + 1))
        all_reduce_sum(summed)
        results.put(("ran", rank, int(agreed.item()), summed.tolist()))
        destroy_group()
        results.put(("done", "", rank, None))
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))


def test_a_rank_reaching_rank_zero_on_another_network_joins_a_secret_group() -> None:
    # Rank 0's store and links listened on the address of one network only: a 3-node group
    # with a secret, one node measuring rank 0 on another address, never formed.
    reports = run_rank_processes(_rank_reaching_rank_zero_elsewhere, (), 3, GROUP_DEADLINE_S)
    ran = {report[1]: report[2:] for report in reports if report[0] == "ran"}
    assert ran == {rank: (5, [6.0] * 4) for rank in range(3)}


def _rank_with_a_published_address_others_cannot_reach(
    rank: int, world_size: int, port: int, results: Any
) -> None:
    """A rank of a 3-rank mesh in which rank 1 publishes 192.0.2.1 (TEST-NET-1: no route,
    as an address of a network rank 2 is not on) and rank 2 is told where it reaches rank
    1 (the measured topology's `ConnectToGroup.link_addresses`)."""
    try:
        import datetime

        import torch
        import torch.distributed as dist

        from exo.worker.engines.torch.comm.tcp_mesh import RankLinks

        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=rank == 0,
            timeout=datetime.timedelta(seconds=30),
        )  # fmt: skip
        published = {0: "127.0.0.1", 1: "192.0.2.1", 2: "127.0.0.1"}[rank]
        links = RankLinks.connect(
            store, rank, world_size, published, 30, None,
            rank_zero_host="127.0.0.1", link_hosts={1: "127.0.0.1"} if rank == 2 else None,
        )  # fmt: skip
        summed = torch.full((4,), float(rank + 1))
        links.all_reduce_sum(summed)
        results.put(("ran", rank, summed.tolist()))
        links.close()
        results.put(("done", rank))
    except BaseException:
        results.put(("error", "", rank, traceback.format_exc()))


def test_ranks_link_where_the_topology_says_they_reach_each_other() -> None:
    # Each rank listened on the address it reaches rank 0 from and the others linked to
    # it there: two ranks that reach rank 0 on different networks could not link.
    reports = run_rank_processes(
        _rank_with_a_published_address_others_cannot_reach, (), 3, GROUP_DEADLINE_S
    )
    ran = {report[1]: report[2] for report in reports if report[0] == "ran"}
    assert ran == {rank: [6.0] * 4 for rank in range(3)}, reports
