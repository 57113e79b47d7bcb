"""The nodes a bench runs against: fresh local `exo` processes (optionally each pinned to
its own CPU core) or a running cluster's API; placing and deleting instances through the
API; sampling the local nodes' memory."""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from exo.benchmark.client import ApiTarget
from exo.shared.parallelism import PARALLELISMS
from exo.shared.types.shards import Sharding
from exo.testing.processes import ExoNode, wait_until

MEMORY_SAMPLE_SECONDS = 0.2
PLACE_TIMEOUT_SECONDS = 900.0
UNLOAD_TIMEOUT_SECONDS = 120.0
PEERS_TIMEOUT_SECONDS = 120.0
PREDICTION_TIMEOUT_SECONDS = 30.0


class BenchSetupError(RuntimeError):
    """The nodes could not be started, or a placement could not be made ready."""


@dataclass(frozen=True)
class Placement:
    """A placement the bench asks for: `sharding` over `nodes` nodes ("single" is one)."""

    sharding: Sharding
    nodes: int

    @classmethod
    def parse(cls, text: str) -> Placement:
        """ "single", "pipeline", "pipelineN"/"pipeline:N"/"pipeline×N", "tensor..." alike.

        Raises:
            ValueError: another spelling.
        """
        lowered = text.strip().lower().replace("×", "x")
        if lowered == "single":
            return cls("pipeline", 1)
        for sharding in PARALLELISMS:
            if lowered.startswith(sharding):
                count = lowered[len(sharding) :].lstrip(":x") or "2"
                if count.isdigit() and int(count) >= 1:
                    return cls(sharding, int(count))
        raise ValueError(f"placement {text!r}: use single, pipeline:N or tensor:N")

    @property
    def label(self) -> str:
        return "single" if self.nodes == 1 else f"{self.sharding} x{self.nodes}"


@dataclass
class MemorySampler:
    """Peak RSS (bytes) of each local node process plus its descendants (its runners),
    sampled every `MEMORY_SAMPLE_SECONDS` on a thread between `start` and `stop`.

    The processes are listed once per `start` (finding a process's descendants reads every
    process of the machine: ~5% of a core at this rate on the 2-core VM, taken from the
    pinned ranks the bench measures); each sample then reads only their resident sizes.
    """

    processes: dict[str, int]
    """Label -> node pid."""
    peaks: dict[str, int] = field(default_factory=dict)
    _tracked: dict[str, list[psutil.Process]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def _track(self, excluded: set[int]) -> None:
        skipped: set[int] = set()
        for pid in excluded:
            with contextlib.suppress(psutil.Error):
                skipped |= {pid, *(child.pid for child in psutil.Process(pid).children(True))}
        self._tracked = {}
        for label, pid in self.processes.items():
            tracked: list[psutil.Process] = []
            with contextlib.suppress(psutil.Error):
                root = psutil.Process(pid)
                tracked = [root, *root.children(recursive=True)]
            self._tracked[label] = [p for p in tracked if p.pid not in skipped]

    def _sample(self) -> None:
        for label, tracked in self._tracked.items():
            total = 0
            for process in tracked:
                with contextlib.suppress(psutil.Error):
                    total += process.memory_info().rss
            self.peaks[label] = max(self.peaks.get(label, 0), total)

    def _loop(self) -> None:
        while not self._stop.wait(MEMORY_SAMPLE_SECONDS):
            self._sample()

    def start(self, excluded: set[int] | None = None) -> None:
        """Sample from now on, anew, the node processes and their descendants as they are
        now, leaving out `excluded` (pids) and their descendants."""
        self.peaks = {}
        self._track(set(excluded or ()))
        self._stop.clear()
        self._sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> dict[str, int]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._sample()
        return dict(self.peaks)


class BenchNodes:
    """A cluster the bench talks to: its API target and node ids (rank order preferred)."""

    def __init__(self, target: ApiTarget, node_ids: list[str]) -> None:
        self.target = target
        self.node_ids = node_ids
        self.memory = MemorySampler({})
        self.pinned = False
        self.no_prediction_reason: str | None = None
        """Why the last `predicted` returned nothing (None when it returned figures)."""
        self._speed_wait_over = False

    def instance_processes(self, instance_id: str) -> set[int]:
        """The local processes of `instance_id`'s runners (none for a remote cluster)."""
        return set()

    def get(self, path: str, **params: Any) -> Any:
        response = httpx.get(
            f"{self.target.url}{path}",
            params=params,
            headers=self.target.request_headers(),
            timeout=30,
        )
        response.raise_for_status()
        return response.json()

    def add_local_model(self, path: Path) -> str:
        """Add a local model directory to the cluster's catalog; returns its model id."""
        response = httpx.post(
            f"{self.target.url}/models/add",
            json={"model_id": str(path)},
            headers=self.target.request_headers(),
            timeout=120,
        )
        if response.status_code != 200:
            raise BenchSetupError(f"adding {path}: HTTP {response.status_code} {response.text}")
        model_id: str = response.json()["model_id"]
        return model_id

    def place(self, model_id: str, placement: Placement) -> str:
        """Place `model_id` on the first `placement.nodes` nodes and wait until every runner
        is ready; returns the instance id.

        Raises:
            BenchSetupError: the placement was refused, or was not ready in time.
        """
        if placement.nodes > len(self.node_ids):
            raise BenchSetupError(
                f"{placement.label} needs {placement.nodes} nodes; the cluster has "
                f"{len(self.node_ids)}"
            )
        body = {
            "model_id": model_id,
            "sharding": placement.sharding,
            "min_nodes": placement.nodes,
            "node_ids": self.node_ids[: placement.nodes],
        }
        response = httpx.post(
            f"{self.target.url}/place_instance",
            json=body,
            headers=self.target.request_headers(),
            timeout=120,
        )
        if response.status_code != 200:
            raise BenchSetupError(
                f"placing {model_id} {placement.label}: HTTP {response.status_code} {response.text}"
            )
        instance_id: str = response.json()["instance_id"]
        try:
            wait_until(
                lambda: self._ready(instance_id),
                timeout=PLACE_TIMEOUT_SECONDS,
                interval=1.0,
                what=f"{model_id} {placement.label} ready",
            )
        except TimeoutError as error:
            raise BenchSetupError(str(error)) from None
        return instance_id

    def _ready(self, instance_id: str) -> bool:
        state = self.get("/state")
        instance = state["instances"].get(instance_id)
        if instance is None:
            raise BenchSetupError(f"instance {instance_id} disappeared (its runner failed?)")
        statuses = [
            state["runners"].get(runner_id, {}).get("kind")
            for runner_id in instance["shard_assignments"]["runner_to_shard"]
        ]
        if "RunnerFailed" in statuses:
            raise BenchSetupError(f"a runner of {instance_id} failed: {state['runners']}")
        return all(status in ("RunnerReady", "RunnerRunning") for status in statuses)

    def delete(self, instance_id: str) -> None:
        """Delete the instance and wait until its runners are gone from the state."""
        instance = self.get("/state")["instances"].get(instance_id) or {}
        runner_ids = set(instance.get("shard_assignments", {}).get("runner_to_shard", {}))
        httpx.delete(
            f"{self.target.url}/instance/{instance_id}",
            headers=self.target.request_headers(),
            timeout=60,
        )

        def gone() -> bool:
            state = self.get("/state")
            return instance_id not in state["instances"] and not runner_ids & set(state["runners"])

        wait_until(gone, timeout=UNLOAD_TIMEOUT_SECONDS, interval=0.5, what="instance deleted")

    def predicted(
        self, model_id: str, placement: Placement, prompt_tokens: int
    ) -> dict[str, float]:
        """The cluster's prediction for this placement with a prompt of `prompt_tokens`:
        `decode_tok_s` (one stream) and `ttft_s`, from the placement preview of the same
        sharding and node count (preferring the same nodes); empty when the previews carry
        none, with the reason in `no_prediction_reason`. The first call waits up to
        `PREDICTION_TIMEOUT_SECONDS` while there is no such preview yet or a node has no
        settled speed figures (the preview's figures are null then: a fresh node measures
        a few seconds after it starts, a busy machine's node only once it is quiet); later
        calls do not wait."""
        deadline = time.monotonic() + (0.0 if self._speed_wait_over else PREDICTION_TIMEOUT_SECONDS)
        self.no_prediction_reason = None
        while True:
            try:
                previews = self.get(
                    "/instance/previews", model_id=model_id, prompt_tokens=prompt_tokens
                )
            except (httpx.HTTPError, ValueError) as error:
                self.no_prediction_reason = f"the placement previews failed: {error}"
                return {}
            matching = [
                preview
                for preview in previews
                if preview.get("sharding") == placement.sharding
                and preview.get("node_count") == placement.nodes
                and not preview.get("error")
            ]
            if not matching and time.monotonic() < deadline:
                time.sleep(1.0)  # a fresh node lists the model's previews a little later
                continue
            if not matching or "predicted_decode_tokens_per_second" not in matching[0]:
                self._speed_wait_over = True
                self.no_prediction_reason = (
                    f"no valid {placement.label} preview"
                    if not matching
                    else "the cluster's previews carry no predictions (an older exo)"
                )
                return {}
            wanted = set(self.node_ids[: placement.nodes])
            matching.sort(key=lambda preview: set(preview.get("node_ids", [])) != wanted)
            preview = matching[0]
            decode = preview.get("predicted_decode_tokens_per_second")
            ttft = preview.get("predicted_ttft_seconds")
            if decode is not None and ttft is not None:
                return {"decode_tok_s": float(decode), "ttft_s": float(ttft)}
            if time.monotonic() >= deadline:
                self._speed_wait_over = True
                self.no_prediction_reason = self._unmeasured_nodes(preview.get("node_ids", []))
                return {}
            time.sleep(1.0)

    def _unmeasured_nodes(self, node_ids: list[str]) -> str:
        """Why a valid preview predicts nothing: which of its nodes report no speed."""
        try:
            node_info = self.get("/state").get("node_info", {})
        except (httpx.HTTPError, ValueError) as error:
            return f"no speed figures, and the state failed: {error}"
        unmeasured = [
            node_id[:8] for node_id in node_ids if not (node_info.get(node_id) or {}).get("speed")
        ]
        return (
            f"node(s) {', '.join(unmeasured) or '?'} report no settled speed figures after "
            f"{PREDICTION_TIMEOUT_SECONDS:.0f} s (a node measures a few seconds after it "
            "starts, and on a busy machine only once it is quiet: see the node's log)"
        )

    def close(self) -> None:
        """Stop what the bench started (nothing, for a running cluster)."""


class LocalNodes(BenchNodes):
    """`count` fresh `exo` nodes on loopback with their own homes and ports, joined into one
    cluster; with `pin_cores`, node i and its runners run on CPU core i only."""

    def __init__(
        self,
        count: int,
        models_dir: Path,
        pin_cores: bool,
        threads: int | None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.nodes: list[ExoNode] = []
        self._instance_pids: dict[str, set[int]] = {}
        self._directory = tempfile.TemporaryDirectory(prefix="exo-bench-")
        root = Path(self._directory.name)
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        if pin_cores and len(cores) < count:
            raise BenchSetupError(f"--pin-cores needs {count} cores; this process has {cores}")
        env = {"OMP_NUM_THREADS": str(threads)} if threads else {}
        try:
            for index in range(count):
                home = root / f"node{index}"
                node = ExoNode(
                    home,
                    models_dir=models_dir,
                    extra_args=("--offline", "--no-default-model", *extra_args),
                    # Each node measures its speed afresh (the test nodes' shared cache holds
                    # figures measured while tests loaded the machine).
                    env={
                        **env,
                        "EXO_SPEED_PROBE": "1",
                        "EXO_SPEED_PROBE_CACHE": str(home / "speed_probe.json"),
                    },
                    namespace=f"exo-bench-{os.getpid()}",
                    bootstrap=tuple(self.nodes),
                    cpu_cores=(cores[index],) if pin_cores else None,
                )
                self.nodes.append(node.launch())
            for node in self.nodes:
                node.wait_api()
            node_ids = [node.node_id() for node in self.nodes]
            first = self.nodes[0]
            wait_until(
                lambda: set(node_ids[1:]) <= set(first.cluster()["peers"]),
                timeout=PEERS_TIMEOUT_SECONDS,
                interval=0.5,
                what="the local nodes to see each other",
            )
        except BaseException:
            self.close()
            raise
        super().__init__(ApiTarget(first.url), node_ids)
        self.pinned = pin_cores
        assert first.process is not None
        self.memory = MemorySampler(
            {
                node_id: node.process.pid
                for node_id, node in zip(node_ids, self.nodes, strict=True)
                if node.process is not None
            }
        )

    def _runner_pids(self) -> set[int]:
        return {process.pid for node in self.nodes for process in node.runner_processes()}

    def place(self, model_id: str, placement: Placement) -> str:
        """`BenchNodes.place`, noting which runner processes the new instance started."""
        before = self._runner_pids()
        instance_id = super().place(model_id, placement)
        self._instance_pids[instance_id] = self._runner_pids() - before
        return instance_id

    def instance_processes(self, instance_id: str) -> set[int]:
        return set(self._instance_pids.get(instance_id, ()))

    def affinities(self) -> dict[str, list[list[int]]]:
        """Per node: the CPU affinity of the node and each of its runners (to check the
        pinning reached the runners)."""
        result: dict[str, list[list[int]]] = {}
        for node_id, node in zip(self.node_ids, self.nodes, strict=True):
            assert node.process is not None
            processes = [psutil.Process(node.process.pid), *node.runner_processes()]
            result[node_id] = [sorted(process.cpu_affinity() or []) for process in processes]
        return result

    def close(self) -> None:
        """Stop every node side by side (each waits for its runners), then remove their
        homes."""

        def stop(node: ExoNode) -> None:
            with contextlib.suppress(Exception):
                node.stop()

        stoppers = [threading.Thread(target=stop, args=(node,)) for node in self.nodes]
        for thread in stoppers:
            thread.start()
        for thread in stoppers:
            thread.join()
        self._directory.cleanup()
