"""Model file transfer on loopback: a verified Hub download, a peer transfer from another
node's file route and the time to a first token from a model fetched from a peer.

Printed:

1. a verified Hub download (repository of random weight files served by the loopback Hub
   server, `exo.testing.hf_server`), MB/s;
2. a peer transfer of the same files from node A's real API file route (uvicorn on
   loopback) into node B's models directory, verified, MB/s;
3. time from starting an `exo` node B to the first streamed token of a model B fetched
   from node A (two real `exo` processes, a tiny random model, no Hub request).

Usage: python bench/bench_download.py [--files 4] [--file-mb 64] [--runs 3] [--no-cluster]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import cast

import httpx
import uvicorn

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.download.hub_download import HubDownload, download_from_hub
from exo.download.peers import PeerSource, peer_credential
from exo.shared.types.common import NodeId
from exo.testing.hf_server import HubServer
from exo.testing.hub_models import save_layered_checkout
from exo.testing.processes import ExoNode, wait_until
from exo.testing.scripted_cluster import ScriptedCluster

REPO = "bench/random-weights"
TINY_REPO = "bench/tiny-peer"
NAMESPACE = "bench-download"


def serve_peer_route(models: Path) -> tuple[str, uvicorn.Server, threading.Thread]:
    """Node A's API app (its file route reads `EXO_MODELS_DIRS`) on a loopback port."""
    os.environ["EXO_MODELS_DIRS"] = str(models)
    app = create_app(cast(ClusterClient, ScriptedCluster()))
    app.state.peer_namespace = NAMESPACE
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="critical", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    return f"http://127.0.0.1:{listener.getsockname()[1]}", server, thread


def transfers(args: argparse.Namespace, scratch: Path) -> None:
    files = {
        f"model-{index + 1:05d}-of-{args.files:05d}.safetensors": os.urandom(args.file_mb * 2**20)
        for index in range(args.files)
    }
    files["config.json"] = json.dumps({"architectures": ["LlamaForCausalLM"]}).encode()
    total = sum(len(data) for data in files.values())
    what = f"{args.files} x {args.file_mb} MiB, verified"
    with HubServer() as hub:
        hub.add_repository(REPO, files)
        os.environ["HF_ENDPOINT"] = hub.url
        os.environ["HF_HUB_DISABLE_TELEMETRY"] = "1"
        for run in range(args.runs):
            directory = scratch / "hub" / f"run-{run}" / "bench--random-weights"
            started = time.perf_counter()
            download_from_hub(HubDownload(REPO, REPO, "main", None, directory))
            seconds = time.perf_counter() - started
            print(f"hub download  (loopback, {what}): {total / 1e6 / seconds:.0f} MB/s")
        url, server, thread = serve_peer_route(scratch / "hub" / "run-0")
        peer = PeerSource(NodeId("node-a"), url, peer_credential(NAMESPACE))
        try:
            for run in range(args.runs):
                before = len(hub.requests)
                directory = scratch / "peer" / f"run-{run}" / "bench--random-weights"
                started = time.perf_counter()
                download_from_hub(HubDownload(REPO, REPO, "main", None, directory), peers=[peer])
                seconds = time.perf_counter() - started
                assert hub.requests[before:] == [], "the peer transfer asked the Hub"
                print(f"peer transfer (loopback, {what}): {total / 1e6 / seconds:.0f} MB/s")
        finally:
            server.should_exit = True
            thread.join(10)


def first_token_from_peer(scratch: Path) -> None:
    """Seconds from launching node B to the first token of a model it fetched from A."""
    with HubServer() as hub:
        hub.add_directory(TINY_REPO, save_layered_checkout(scratch / "tiny"))
        env = {
            "HF_ENDPOINT": hub.url,
            "HF_HUB_DISABLE_TELEMETRY": "1",
            "HF_HUB_CACHE": str(scratch / "hf-cache"),
            "OLLAMA_MODELS": str(scratch / "no-ollama"),
        }
        first = ExoNode(scratch / "a", scratch / "a-models", ("--no-default-model",), env=env)
        second = ExoNode(
            scratch / "b",
            scratch / "b-models",
            ("--no-default-model",),
            env=env,
            namespace=first.namespace,
            bootstrap=(first,),
        )
        try:
            first.start()
            a_id = first.node_id()
            wait_until(lambda: a_id in first.state()["node_info"], 60, what="A's master")
            for path, body in (
                ("/models/add", {"model_id": TINY_REPO}),
                ("/download/start", {"model": TINY_REPO}),
            ):
                httpx.post(f"{first.url}{path}", json=body, timeout=60).raise_for_status()
            wait_until(
                lambda: first.state()["downloads"][a_id][TINY_REPO]["kind"] == "DownloadCompleted",
                60,
                what="A's copy",
            )
            before = len(hub.requests)
            started = time.perf_counter()
            second.start()
            wait_until(lambda: len(second.state()["node_info"]) == 2, 60, what="one cluster")
            placed = httpx.post(
                f"{second.url}/place_instance",
                json={"model_id": TINY_REPO, "node_ids": [second.node_id()]},
                timeout=60,
            )
            placed.raise_for_status()
            second.wait_ready(TINY_REPO, timeout=120)
            request = {"model": TINY_REPO, "prompt": "w1 w2", "max_tokens": 4, "stream": True}
            with httpx.stream(
                "POST", f"{second.url}/v1/completions", json=request, timeout=60
            ) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        break
            seconds = time.perf_counter() - started
            assert hub.requests[before:] == [], "node B asked the Hub"
            print(f"exo start -> first token, tiny model fetched from a peer: {seconds:.1f} s")
        finally:
            for node in (second, first):
                node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--file-mb", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-cluster", action="store_true", help="skip the exo processes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="exo-bench-") as scratch:
        transfers(args, Path(scratch))
        if not args.no_cluster:
            first_token_from_peer(Path(scratch))


if __name__ == "__main__":
    main()
