"""A split instance in a cluster with a secret, end to end: two `exo` nodes started with
the secret place the default model as a 2-rank pipeline over both, their runners form the
group through the authenticated rendezvous store (the key reaches them from the node),
and the instance answers as one node does; torch's own store client pointed at the
instance's rendezvous port gets nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, wait_until
from tests.test_cluster_secret import SECRET, TlsNode
from tests.test_sharding import greedy_answer, place, ready_statuses, run_placement

pytestmark = pytest.mark.slow

FORM_TIMEOUT_SECONDS = 60.0
READY_TIMEOUT_SECONDS = 300.0


@pytest.fixture
def members(
    tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path
) -> Iterator[list[TlsNode]]:
    root = tmp_path_factory.mktemp("secret-split")
    secret_env = {"EXO_CLUSTER_SECRET": SECRET}
    first = TlsNode(root / "a", shared_models_dir, ("--no-default-model",), secret_env)
    second = TlsNode(
        root / "b", shared_models_dir, ("--no-default-model",), secret_env,
        namespace=first.namespace, bootstrap=(first,),
    )  # fmt: skip
    nodes = [first, second]
    try:
        for node in nodes:
            node.launch()
        for node in nodes:
            node.wait_api()
        ids = [node.node_id() for node in nodes]
        wait_until(
            lambda: all(len(first.state()["topology"].get(node_id, {})) == 1 for node_id in ids),
            FORM_TIMEOUT_SECONDS,
            what="the link between the members",
        )
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_a_pipeline_split_forms_and_serves_under_the_secret(members: list[TlsNode]) -> None:
    import torch.distributed as dist

    first, second = members
    expected, _tokens, _statuses = run_placement(members, DEFAULT_MODEL_ID, "pipeline", 1)
    response = place(first, DEFAULT_MODEL_ID, "pipeline", [first.node_id(), second.node_id()])
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    started = time.monotonic()
    wait_until(
        lambda: ready_statuses(first, instance_id),
        READY_TIMEOUT_SECONDS,
        interval=0.5,
        what="the split instance ready",
    )
    print(f"split instance ready in {time.monotonic() - started:.1f}s")
    rendezvous = first.state()["instances"][instance_id]["rendezvous"]
    address = next(iter(rendezvous["addresses"].values()))  # 127.0.0.1: one machine
    assert greedy_answer(second, DEFAULT_MODEL_ID)[0] == expected
    with pytest.raises((RuntimeError, dist.DistError)):
        dist.TCPStore(address, rendezvous["port"], is_master=False, timeout=timedelta(seconds=2))
    assert greedy_answer(first, DEFAULT_MODEL_ID)[0] == expected
