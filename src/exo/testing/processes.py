"""Start and stop real `exo` node processes for multi-process tests."""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil

from exo.node.event_log import decode_record
from exo.shared.types.nodes import NodeSpeed
from exo.testing.ports import free_port as free_port  # re-exported for the tests
from exo.utils.process_title import RUNNER_TITLE_PREFIX

# In the command line of multiprocessing's fork server (a node's runner server), and of
# each runner it forks until the runner names itself.
RUNNER_SERVER_MARK = "from multiprocessing.forkserver import main"

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
READY_TIMEOUT_SECONDS = 600.0
# A bound on a node's start until its API answers (imports, zenoh), not a measure of it: on
# a loaded 2-core machine it has taken over 90 s.
API_TIMEOUT_SECONDS = 180.0
# Environment variables naming model stores of the machine running the tests.
MACHINE_MODEL_STORES = frozenset(
    {"HF_HOME", "HF_HUB_CACHE", "OLLAMA_MODELS", "EXO_MODELS_DIRS", "EXO_MODELS_READ_ONLY_DIRS"}
)
# The machine's cluster secret: a test node joins only the cluster its test sets up.
MACHINE_CLUSTER_SECRET = "EXO_CLUSTER_SECRET"


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_this_thread() -> Callable[[], None] | None:
    """A `preexec_fn` that makes a test's node die (SIGKILL) when the test process dies, or
    None where that cannot be asked.

    A node runs in its own session (so a test can kill it and its runners as one group), so
    a test process killed from outside (CI's `timeout` sends SIGTERM; an OOM kill; SIGKILL)
    runs no fixture finalizer and would leave its nodes serving for good. Linux's parent-death
    signal ends them instead (their runners die with them: `runner/process.py`). It is sent
    when the *thread* that started the child ends, so it is asked only from the main thread:
    a node started from a worker thread (a thread pool's) would be killed when that thread
    exits. The libc function is looked up here, before the fork: the child only calls it.
    """
    if not sys.platform.startswith("linux") or threading.current_thread() is not (
        threading.main_thread()
    ):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl

    def ask() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)

    return ask


def exo_command() -> str:
    """The installed `exo` console script (the one next to this Python first)."""
    beside = Path(sys.executable).parent / "exo"
    if beside.exists():
        return str(beside)
    found = shutil.which("exo")
    if found is None:
        raise RuntimeError("the `exo` command is not installed: run `pip install -e .`")
    return found


def wait_until(
    condition: Callable[[], Any], timeout: float, interval: float = 0.2, what: str = "condition"
) -> Any:
    """Poll `condition` until it returns something truthy; fail after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while time.monotonic() < deadline:
        try:
            result = condition()
        except (httpx.HTTPError, OSError, ValueError, KeyError) as error:
            last_error = error
            result = None
        if result:
            return result
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout:.0f}s waiting for {what} (last error: {last_error})"
    )


def seed_speed_cache(path: Path, speed: NodeSpeed) -> None:
    """Write `speed` as this machine's settled figures to the speed-probe cache `path`, for
    a test node that must report a speed (`env={"EXO_SPEED_PROBE": "1",
    "EXO_SPEED_PROBE_CACHE": str(path)}`) without measuring on a machine busy with tests,
    where no measurement settles."""
    from exo.node.speed_probe import ProbeResult, probe_key, runner_threads, write_cache

    write_cache(path, probe_key(runner_threads()), ProbeResult(speed, settled=True))


class ExoNode:
    """One `exo` subprocess with its own port and data directory."""

    def __init__(
        self,
        home: Path,
        models_dir: Path | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
        namespace: str | None = None,
        bootstrap: tuple[ExoNode, ...] = (),
        cpu_cores: tuple[int, ...] | None = None,
    ) -> None:
        self.home = home
        # Run the node (and so its runners, which inherit it) on these CPUs only (taskset).
        self.cpu_cores = cpu_cores
        self.models_dir = models_dir
        self.port = free_port()
        self.zenoh_port = free_port()
        # Each test cluster gets its own namespace; peers are found through bootstrap
        # endpoints on loopback (multicast discovery is tested inside a network namespace).
        self.namespace = namespace or f"test-{home.name}-{self.port}"
        self.bootstrap = bootstrap
        self.extra_args = extra_args
        self.extra_env = env or {}
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = home / "exo.log"
        # The node's processes (runners, its runner server) still running 10 s after its
        # last `stop`, which killed them.
        self.leftovers: list[int] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def zenoh_endpoint(self) -> str:
        return f"tcp/127.0.0.1:{self.zenoh_port}"

    def environment(self) -> dict[str, str]:
        """The node's environment: this process's, without the machine's model stores (its
        Hugging Face cache, Ollama store, extra model directories) so a node sees only what
        its test gives it, whatever the machine holds or earlier runs left there; then the
        node's home and models directory, then the test's `env` (which may name stores)."""
        inherited = {
            name: value
            for name, value in os.environ.items()
            if name not in MACHINE_MODEL_STORES and name != MACHINE_CLUSTER_SECRET
        }
        env = {
            **inherited,
            "HF_HUB_CACHE": str(self.home / "hf-cache"),
            "OLLAMA_MODELS": str(self.home / "ollama-models"),
            "EXO_HOME": str(self.home),
            # Test nodes do not measure their speed: on a machine busy with tests no
            # measurement settles, so each node start measured again (25-180 s of both cores;
            # a test that needs the figures sets EXO_SPEED_PROBE=1 in `env`). Where one does,
            # every test node on this machine shares one cache (keyed by CPU, affinity,
            # threads and torch version).
            "EXO_SPEED_PROBE": "0",
            "EXO_SPEED_PROBE_CACHE": str(Path(tempfile.gettempdir()) / "exo-test-speed.json"),
            **self.extra_env,
        }
        if self.models_dir is not None:
            env["EXO_MODELS_DIR"] = str(self.models_dir)
        return env

    def launch(self) -> ExoNode:
        """Start the process without waiting for it (see `wait_api`)."""
        self.home.mkdir(parents=True, exist_ok=True)
        env = self.environment()
        log = self.log_path.open("ab")
        pin = ("taskset", "-c", ",".join(map(str, self.cpu_cores))) if self.cpu_cores else ()
        self.process = subprocess.Popen(
            [
                *pin,
                exo_command(),
                *("--host", "127.0.0.1"),
                *("--api-port", str(self.port)),
                *("--zenoh-port", str(self.zenoh_port)),
                *("--namespace", self.namespace),
                "--no-multicast",
                *("--bootstrap-peers", ",".join(p.zenoh_endpoint for p in self.bootstrap)),
                *self.extra_args,
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_this_thread(),
        )
        return self

    def wait_api(self) -> ExoNode:
        wait_until(self._api_up, timeout=API_TIMEOUT_SECONDS, what=f"exo API on port {self.port}")
        return self

    def start(self) -> ExoNode:
        return self.launch().wait_api()

    def node_id(self) -> str:
        node_id: str = httpx.get(f"{self.url}/node_id", timeout=5).json()
        return node_id

    def cluster(self) -> dict[str, Any]:
        view: dict[str, Any] = httpx.get(f"{self.url}/cluster", timeout=5).json()
        return view

    def kill(self) -> None:
        """SIGKILL the node and its runners at once (a crashed machine)."""
        assert self.process is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def _api_up(self) -> bool:
        assert self.process is not None
        if self.process.poll() is not None:
            raise RuntimeError(f"exo exited with {self.process.returncode}:\n{self.log()}")
        return httpx.get(f"{self.url}/node_id", timeout=2).status_code == 200

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def state(self) -> dict[str, Any]:
        response = httpx.get(f"{self.url}/state", timeout=10)
        response.raise_for_status()
        state: dict[str, Any] = response.json()
        return state

    def ready_runner_ids(self, model_id: str = DEFAULT_MODEL_ID) -> list[str]:
        state = self.state()
        ready = []
        for instance in state["instances"].values():
            assignments = instance["shard_assignments"]
            if assignments["model_id"] != model_id:
                continue
            for runner_id in assignments["runner_to_shard"]:
                status = state["runners"].get(runner_id, {})
                if status.get("kind") in ("RunnerReady", "RunnerRunning"):
                    ready.append(runner_id)
        return ready

    def wait_ready(
        self, model_id: str = DEFAULT_MODEL_ID, timeout: float = READY_TIMEOUT_SECONDS
    ) -> str:
        runner_ids: list[str] = wait_until(
            lambda: self.ready_runner_ids(model_id),
            timeout=timeout,
            interval=0.5,
            what=f"{model_id} ready",
        )
        return runner_ids[0]

    def serve_local_model(
        self, model_dir: Path, timeout: float = READY_TIMEOUT_SECONDS
    ) -> tuple[str, str]:
        """Add the model in `model_dir` (`POST /models/add` of a local directory), place it
        and wait until it is ready; its model id and ready runner's id.

        Raises:
            AssertionError: the node refused to add or place it (its answer in the message).
            TimeoutError: it was not ready within `timeout` seconds.
        """
        added = httpx.post(f"{self.url}/models/add", json={"model_id": str(model_dir)}, timeout=60)
        assert added.status_code == 200, added.text
        model_id: str = added.json()["model_id"]
        placed = httpx.post(f"{self.url}/place_instance", json={"model_id": model_id}, timeout=60)
        assert placed.status_code == 200, placed.text
        return model_id, self.wait_ready(model_id, timeout=timeout)

    def serving(self, instance_id: str) -> dict[str, Any] | None:
        """The instance (its JSON in `/state`) when every runner of its current placement
        is ready and it is not unavailable (after losing a node); else None."""
        state = self.state()
        instance: dict[str, Any] | None = state["instances"].get(instance_id)
        if instance is None or instance_id in state["unavailable_instances"]:
            return None
        ready = all(
            state["runners"].get(runner_id, {}).get("kind") in ("RunnerReady", "RunnerRunning")
            for runner_id in instance["shard_assignments"]["runner_to_shard"]
        )
        return instance if ready else None

    def events(self) -> list[dict[str, Any]]:
        """The events of this node's log after its snapshot, as JSON."""
        lines = (self.home / "event_log.jsonl").read_bytes().splitlines()
        return [
            decode_record(line).model_dump(mode="json")["event"] for line in lines if line.strip()
        ]

    def runner_processes(self) -> list[psutil.Process]:
        """The runner subprocesses of this node: forked by its runner server (a child of
        the node) or spawned (`exo.worker.runner.start_method`)."""
        assert self.process is not None
        try:
            children = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []
        runners = []
        for child in children:
            try:
                cmdline = " ".join(child.cmdline())
                parent = child.ppid()
            except psutil.Error:
                continue
            # A runner names itself (`exo runner <model> rank N`) once it starts; before
            # that it is still a fork of the runner server (whose command line it shares,
            # the server being the node's child) or multiprocessing's spawned interpreter.
            titled = cmdline.startswith(RUNNER_TITLE_PREFIX)
            forked = RUNNER_SERVER_MARK in cmdline and parent != self.process.pid
            if titled or forked or ("spawn_main" in cmdline and "resource_tracker" not in cmdline):
                runners.append(child)
        return runners

    def runner_server_processes(self) -> list[psutil.Process]:
        """This node's runner server (`exo.worker.runner.start_method`): none before it
        starts or where runners are spawned, else one."""
        assert self.process is not None
        try:
            children = psutil.Process(self.process.pid).children()
        except psutil.NoSuchProcess:
            return []
        servers = []
        for child in children:
            try:
                if RUNNER_SERVER_MARK in " ".join(child.cmdline()):
                    servers.append(child)
            except psutil.Error:
                continue
        return servers

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Stop the node with `sig` and return its exit code; kill it if it hangs, and any
        of its processes still running 10 s after it ended (their pids: `leftovers`)."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        descendants = psutil.Process(self.process.pid).children(recursive=True)
        self.process.send_signal(sig)
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            code = self.process.wait(timeout=10)
        _, alive = psutil.wait_procs(descendants, timeout=10)
        for leftover in alive:
            leftover.kill()
        self.leftovers = [leftover.pid for leftover in alive]
        return code


def stop_all(nodes: list[ExoNode]) -> None:
    """Stop every node in `nodes` at once (`ExoNode.stop` on a thread each), not one after
    another: a node's graceful stop (its runners ended, its links closed, its process
    reaped) takes seconds on a loaded machine, and the stops of a cluster's nodes need not
    wait for each other. Every node is stopped even when one's stop fails; then the first
    failure is raised."""
    errors: list[BaseException] = []

    def stop(node: ExoNode) -> None:
        try:
            node.stop()
        except BaseException as error:  # raised below, after every other stop
            errors.append(error)

    threads = [threading.Thread(target=stop, args=(node,), daemon=True) for node in nodes]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
