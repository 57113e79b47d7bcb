"""Ollama's sizes mean what Ollama means: `/api/tags` `size` is the bytes of the model's
files on this node's disk, `/api/ps` `size` the bytes its loaded weights take (as its
runners reported them) and `size_vram` the part on GPUs (0 on CPU) — never the card's
storage size of the float checkpoint (538 MB for SmolLM2, whose converted files are 113 MB
and whose loaded weights 209 MB in the trial of session 41). `/api/ps` `context_length` is
the context as loaded (Ollama's runner `num_ctx`): the model's, or the most tokens the
instance's KV cache holds for a request where that is less (`--kv-cache-tokens 2048` on
SmolLM2 reported 8192 in the trial of session 44, then refused a 3,031-token prompt)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.ollama.model_listings import bytes_on_disk, resident_bytes
from exo.api.serving.cluster_client import ClusterClient
from exo.shared.models.memory import resident_weight_bytes
from exo.shared.types.nodes import DownloadCompleted, GpuInfo
from exo.shared.types.runners import RunnerLoading, RunnerReady, RunnerRunning, RunnerStatus
from exo.testing.builders import SMOLLM2, make_instance, make_node_info, make_state, smollm2_card
from exo.testing.scripted_cluster import ScriptedCluster

WEIGHTS = 209_000_000  # what the runner reported


def _listings(cluster: ScriptedCluster) -> tuple[dict[str, Any], dict[str, Any]]:
    with TestClient(create_app(cast(ClusterClient, cluster))) as http:
        tags = {tag["model"]: tag for tag in http.get("/ollama/api/tags").json()["models"]}
        ps = {model["model"]: model for model in http.get("/ollama/api/ps").json()["models"]}
    return tags[SMOLLM2], ps[SMOLLM2]


def _cluster(
    status: RunnerStatus | None, download: Path | None = None, gpus: bool = False
) -> ScriptedCluster:
    cluster = ScriptedCluster()
    instance = make_instance(cluster.node_id)
    runner_id = next(iter(instance.shard_assignments.runner_to_shard))
    node = make_node_info(4096)
    if gpus:
        node = node.model_copy(update={"gpus": (GpuInfo(name="GPU", total_memory_bytes=2**34),)})
    cluster.state = make_state(
        nodes={cluster.node_id: node},
        instances=[instance],
        runners={runner_id: (cluster.node_id, status)} if status is not None else None,
        downloads=(
            {cluster.node_id: {SMOLLM2: DownloadCompleted(path=str(download))}}
            if download is not None
            else None
        ),
    )
    return cluster


def _checkout(directory: Path) -> int:
    """A model directory of known file sizes; returns the bytes that count."""
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(b"\0" * 5000)
    (directory / "tokenizer.json").write_bytes(b"{}" * 100)
    (directory / ".exo-complete").write_text("marker, not the model")
    (directory / ".cache").mkdir()
    (directory / ".cache" / "lock").write_bytes(b"\0" * 999)
    return 5000 + 200


def test_tags_size_is_the_files_on_disk(tmp_path: Path) -> None:
    files = _checkout(tmp_path / "smollm2")
    assert bytes_on_disk(tmp_path / "smollm2") == files
    tag, _ = _listings(_cluster(RunnerReady(weight_bytes=WEIGHTS), tmp_path / "smollm2"))
    assert tag["size"] == files


def test_tags_size_without_a_copy_here_is_the_cards() -> None:
    tag, _ = _listings(_cluster(RunnerReady(weight_bytes=WEIGHTS)))
    assert tag["size"] == smollm2_card().storage_size_bytes


@pytest.mark.parametrize(
    "status", [RunnerReady(weight_bytes=WEIGHTS), RunnerRunning(weight_bytes=WEIGHTS)]
)
def test_ps_size_is_the_loaded_weights(status: RunnerStatus) -> None:
    _, process = _listings(_cluster(status))
    assert (process["size"], process["size_vram"]) == (WEIGHTS, 0)
    _, on_gpu = _listings(_cluster(status, gpus=True))
    assert (on_gpu["size"], on_gpu["size_vram"]) == (WEIGHTS, WEIGHTS)


@pytest.mark.parametrize("status", [None, RunnerLoading(layers_loaded=1, total_layers=30)])
def test_ps_size_before_the_runner_reports_is_what_the_engine_holds(
    status: RunnerStatus | None,
) -> None:
    card = smollm2_card()
    _, process = _listings(_cluster(status))
    assert process["size"] == resident_weight_bytes(card, "int4") < card.storage_size_bytes
    assert process["size_vram"] == 0
    assert resident_bytes(card, [status], on_gpus=True) == resident_weight_bytes(card, "float32")


def test_a_running_runner_keeps_its_weight_bytes_and_old_records_their_bytes() -> None:
    assert RunnerRunning(weight_bytes=WEIGHTS).model_dump()["weight_bytes"] == WEIGHTS
    assert "weight_bytes" not in RunnerRunning().model_dump_json()


@pytest.mark.parametrize(("held", "expected"), [(2048, 2048), (10**6, 8192)])
def test_ps_context_length_is_what_a_request_may_hold(held: int, expected: int) -> None:
    assert smollm2_card().context_length == 8192
    _, process = _listings(_cluster(RunnerReady(weight_bytes=WEIGHTS, kv_cache_tokens=held)))
    assert process["context_length"] == expected
