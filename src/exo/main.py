"""`exo`: start a node. Wires the components together through the router's topics (the
command line is `exo.node_options`)."""

from __future__ import annotations

import errno
import signal
import socket
import sys

import anyio
from loguru import logger
from pydantic import TypeAdapter
from rich.console import Console

from exo.api.guards.auth import KeyFileError
from exo.api.guards.browser_access import BrowserAccess, this_machine_names
from exo.api.main import Api, bind_api_socket
from exo.api.security import (
    ApiSecurity,
    banner_lines,
    build_auth,
    reload_keys_on_sighup,
)
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import (
    ClusterClient,
    CommandRejectedError,
    CommandTimeoutError,
    LoadOnRequest,
)
from exo.download.gguf_models import ollama_store, ollama_store_cards
from exo.download.locations import ModelLocations
from exo.download.on_disk import RESCAN_SECONDS, catalog_copies, download_reports
from exo.download.peers import PEER_CREDENTIAL_HEADER, peer_credential
from exo.master.decisions import events_after_restart
from exo.master.main import Master
from exo.node.data_directory import not_writable_message
from exo.node.election import Election, ElectionMessage
from exo.node.event_log import EventLog, history_summary
from exo.node.home_lock import HomeInUseError, HomeLock
from exo.node.info_gatherer import InfoGatherer
from exo.node.replica import Replica
from exo.node.speed_probe import speed_probe_enabled
from exo.node.topology import TopologyProber
from exo.node_options import DEFAULT_MODEL_ID, Options
from exo.routing.cluster_tls import TlsFilesError
from exo.routing.secret_options import (
    cluster_banner_line,
    tls_peer_warnings,
)
from exo.routing.zenoh_router import NetworkRouter, open_failure_message
from exo.shared.constants import (
    event_log_path,
    exo_home,
    models_dir,
    node_id_path,
)
from exo.shared.local_events import LocalEventSender
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import (
    AddCustomModel,
    Command,
    ForwarderCommand,
    KeepAlive,
    PlaceInstance,
)
from exo.shared.types.common import CommandId, InstanceId, NodeId
from exo.shared.types.events import RunnerDeleted, RunnerStatusUpdated
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.utils.heap import trim_heap_periodically
from exo.worker.main import Worker
from exo.worker.runner.options import RunnerOptions
from exo.worker.runner.start_method import start_runner_server


def load_node_id() -> NodeId:
    """This node's id, created once and kept in the data directory."""
    path = node_id_path()
    if path.exists():
        stored = path.read_text(encoding="utf-8").strip()
        if stored:
            return NodeId(stored)
    node_id = NodeId.new()
    temporary = path.with_suffix(".tmp")
    temporary.write_text(node_id, encoding="utf-8")
    temporary.replace(path)
    return node_id


class Node:
    """One exo process: router, election, replica, master, worker, API, info and topology,
    wired only through topics and state accessors."""

    def __init__(self, options: Options) -> None:
        self.options = options
        # Before anything in the data directory is read or written (raises HomeInUseError).
        self._home_lock = HomeLock(exo_home())
        self.node_id = load_node_id()
        self.cards = load_builtin_cards()
        secret = options.cluster_secret
        self.router = NetworkRouter(
            self.node_id,
            options.namespace,
            zenoh_port=options.zenoh_port,
            listen_host=options.host,
            bootstrap_peers=options.bootstrap_peers,
            multicast=options.multicast,
            tls=secret.write_tls_files(exo_home()) if secret is not None else None,
        )
        election_topic = self.router.election(TypeAdapter(ElectionMessage))
        self.event_log = EventLog(event_log_path())
        state = self.event_log.load()
        if state.last_event_applied_idx >= 0:
            events = self.event_log.held
            last = state.last_event_applied_idx
            logger.info(history_summary(events, self.event_log.base_idx, last))
        # What this node ran before it stopped, decided now: later events are this run's.
        self._stale_on_restart = events_after_restart(state, self.node_id)
        self.local_events = LocalEventSender(self.node_id, self.router.local_events.sender())
        self.election = Election(
            node_id=self.node_id,
            election_publisher=election_topic.sender(),
            election_subscription=election_topic.subscribe(),
            connections=self.router.connections.subscribe(),
            current_peers=lambda: self.router.peers,
            current_state=lambda: self.replica.state,
            force_master=options.force_master,
            last_event_digest=lambda: self.replica.last_event_digest(),
        )
        self.replica = Replica(
            node_id=self.node_id,
            state=state,
            event_log=self.event_log,
            global_events=self.router.global_events.subscribe(),
            send_command=self._send_command,
            election=self.election,
            local_events=self.local_events,
            history_dropped=lambda lost: self.cluster.history_dropped(lost),
        )
        self.master = Master(
            node_id=self.node_id,
            state=state,
            event_log=self.event_log,
            command_subscription=self.router.commands.subscribe(),
            local_event_subscription=self.router.local_events.subscribe(),
            global_event_publisher=self.router.global_events.sender(),
            cards=self.cards,
            is_active=lambda: self.election.master == self.node_id,
            current_state=lambda: self.replica.state,
            last_heard=self.election.last_heard,
            current_peers=lambda: self.router.peers,
            connections=self.router.connections.subscribe(),
        )
        self.worker = Worker(
            node_id=self.node_id,
            current_state=lambda: self.replica.state,
            applied_events=self.replica.applied.subscribe(),
            local_events=self.local_events,
            publish_chunk=self.router.chunks.publish_to,
            models_dir=models_dir(),
            offline=options.offline,
            log_level=options.log_level,
            caught_up=lambda: self.replica.caught_up(),
            resyncing=lambda: self.replica.resyncing,
            runner_options=RunnerOptions(
                max_concurrent_requests=options.max_concurrent_requests,
                stream_interval_seconds=options.stream_interval_seconds,
                prefill_activations=options.prefill_activations,
                decode_activations=options.decode_activations,
                kv_cache_tokens=options.kv_cache_tokens,
                kv_cache_dtype=options.kv_cache_dtype,
                speculative=options.speculative,
                draft_min=options.draft_min,
                draft_max=options.draft_max,
                draft_model=options.draft_model,
                rank_group_key=secret.rank_group_key().hex() if secret is not None else None,
            ),
            peer_credential=peer_credential(options.namespace, secret),
        )
        self.cluster = ClusterClient(
            node_id=self.node_id,
            current_state=lambda: self.replica.state,
            applied_events=self.replica.applied.subscribe(),
            chunk_subscription=self.router.chunks.subscribe(),
            command_publisher=self.router.commands.sender(),
            cards=self.cards,
            election=self.election,
            current_peers=lambda: self.router.peers,
            load_on_request=LoadOnRequest(
                auto_place=options.auto_place,
                idle_unload_seconds=options.idle_unload_seconds,
                offline=options.offline,
                model_aliases=options.model_aliases,
            ),
            record_download=self.worker.record_download,
            local_kv_cache=self.worker.kv_cache_use,
            trust_remote_code=options.trust_remote_code,
            image_policy=options.image_policy,
            caught_up=lambda: self.replica.caught_up(),
            storage_problem=self.event_log.space.problem,
        )
        self.info_gatherer = InfoGatherer(
            self.local_events,
            api_host=options.host,
            api_port=options.api_port,
            models=models_dir(),
            current_state=lambda: self.replica.state,
            offline=options.offline,
            measure_speed=speed_probe_enabled(),
            remeasure_speed=options.remeasure_speed,
            prefill_activations=options.prefill_activations,
            kv_cache_tokens=options.kv_cache_tokens,
            draft_model=options.draft_model,
            draft_on_spare=options.draft_on_spare,
        )
        credential = peer_credential(options.namespace, secret)
        # Other nodes' APIs answer this node's probes and file requests by this credential.
        self.topology = TopologyProber(
            self.node_id,
            lambda: self.replica.state,
            self.local_events,
            headers={PEER_CREDENTIAL_HEADER: credential},
        )
        try:
            self.api_auth, self._generated_api_key = build_auth(
                options.security, exo_home(), credential
            )
        except KeyFileError as error:
            logger.error(str(error))
            raise SystemExit(1) from None
        security = ApiSecurity(
            self.api_auth, options.security.limits, master_event_index=self._master_event_index
        )
        self._listen_socket = bind_api_socket(options.host, options.api_port)
        browser_access = BrowserAccess(options.cors_origins, this_machine_names())
        self.api = Api(
            self.cluster,
            self._listen_socket,
            options.log_level,
            browser_access,
            Admission(options.max_queued_requests),
            security,
        )
        # Model files go to nodes presenting this cluster's peer credential.
        self.api.app.state.peer_credential = credential

    def _master_event_index(self) -> int | None:
        master = self.election.master_message
        return master.last_event_idx if master is not None else None

    def _send_command(self, command: Command) -> None:
        self.router.commands.publish(ForwarderCommand(origin=self.node_id, command=command))

    async def run(self) -> None:
        try:
            await self.router.start()
        except Exception as error:
            self._listen_socket.close()
            self._home_lock.release()
            raise NodeStartError(open_failure_message(error, self.router)) from error
        # Its imports run while the node joins its cluster, not when a runner is wanted.
        start_runner_server()
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._stop_on_signal, task_group.cancel_scope)
                for component in (
                    self.election.run,
                    self.replica.run,
                    self.master.run,
                    self.local_events.run,
                    self.worker.run,
                    self.api.run,
                    self.info_gatherer.run,
                    self.topology.run,
                    self._announce,
                    self._announce_ready_models,
                    self._clean_up_after_restart,
                    self._report_models_on_disk,
                ):
                    task_group.start_soon(component)
                task_group.start_soon(reload_keys_on_sighup, self.api_auth)
                task_group.start_soon(trim_heap_periodically)
                if self.options.default_model:
                    task_group.start_soon(self._place_default_model)
        finally:
            with anyio.CancelScope(shield=True):
                await self.router.close()
            self.event_log.close()
            self._listen_socket.close()
            self._home_lock.release()
            logger.info("exo stopped")

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for received in signals:
                logger.info(f"received {signal.Signals(received).name}; shutting down runners")
                scope.cancel()
                return

    async def _caught_up(self, timeout: float) -> bool:
        """Wait until a master is elected and this node holds the history it has."""
        with anyio.move_on_after(timeout):
            while self.election.master is None or self.replica.behind_master():
                await anyio.sleep(0.1)
            return True
        return False

    async def _clean_up_after_restart(self) -> None:
        """Runners this node ran before it stopped are gone, and so are the clients of the
        requests it was serving: say so, once the node holds the cluster's history. A runner
        already recreated under the same id gets its live status instead of its deletion:
        the replayed state still says the previous life's (`RunnerReady` for ~30 s of the
        new runner's loading, seen by a user, until the new one's first report)."""
        if not await self._caught_up(timeout=60):
            return
        for event in self._stale_on_restart:
            if isinstance(event, RunnerDeleted):
                recreated = self.worker.runners.get(event.runner_id)
                if recreated is not None:
                    event = RunnerStatusUpdated(
                        runner_id=event.runner_id, node_id=self.node_id, status=recreated.status
                    )
            self.local_events.emit(event)

    async def _announce(self) -> None:
        with anyio.move_on_after(30) as waiting:
            while not self.api.started:
                await anyio.sleep(0.05)
        if waiting.cancelled_caught:
            logger.error("the API server did not start within 30 s")
            return
        console = Console(stderr=True)
        port = self.options.api_port
        host = self.options.host
        urls = [f"http://{'localhost' if host == '0.0.0.0' else host}:{port}"]
        if host == "0.0.0.0":
            urls.append(f"http://{_lan_address()}:{port}")
        console.rule("[bold]exo")
        console.print(f"  node      {self.node_id}")
        console.print(f"  API       {'  '.join(urls)}")
        console.print(f"  chat      POST {urls[0]}/v1/chat/completions")
        console.print(
            f"  cluster   namespace {self.options.namespace!r}, links on "
            f"{self.router.listen_endpoint}"
        )
        console.print(cluster_banner_line(self.options.cluster_secret), soft_wrap=True)
        console.print(f"  data      {exo_home()}")
        for line in banner_lines(self.api_auth, self._generated_api_key, exo_home()):
            console.print(line, soft_wrap=True)
        console.rule()

    async def _report_models_on_disk(self) -> None:
        """Models whose files are already on this machine join without a download: Ollama's
        store's become custom models, then every card whose model is whole here (a models
        directory, the Hugging Face cache, an Ollama blob) is reported downloaded on this
        node, the event a download ends with, at start and every `RESCAN_SECONDS`."""
        await self._add_ollama_store_models()
        if not await self._caught_up(timeout=60):
            return
        while True:
            locations = ModelLocations.from_environment(models_dir())
            cards = dict(self.cluster.cards)
            copies = await anyio.to_thread.run_sync(
                catalog_copies, locations, cards, abandon_on_cancel=True
            )
            for event in download_reports(self.node_id, self.cluster.state, copies):
                logger.info(f"{event.model_id} is whole on this node: {copies[event.model_id]}")
                self.local_events.emit(event)
            await anyio.sleep(RESCAN_SECONDS)

    async def _add_ollama_store_models(self) -> None:
        """Models in Ollama's store on this machine become custom models of the cluster,
        named as Ollama names them (`mytiny:latest`), unless a catalog model has the name."""
        cards, skipped = await anyio.to_thread.run_sync(
            lambda: ollama_store_cards(ollama_store(), self.cards), abandon_on_cancel=True
        )
        for line in skipped:
            logger.info(f"Ollama store: not added: {line}")
        if not cards or not await self._caught_up(timeout=60):
            return
        for card in cards:
            known = self.cluster.state.custom_cards.get(card.model_id)
            if known == card:
                continue
            try:
                await self.cluster.submit(AddCustomModel(command_id=CommandId.new(), card=card))
                logger.info(f"added {card.model_id} from Ollama's store")
            except (CommandRejectedError, CommandTimeoutError) as error:
                logger.warning(f"could not add {card.model_id} from Ollama's store: {error}")

    async def _place_default_model(self) -> None:
        """On a cluster with no instance, place the default model so a fresh install
        answers. The master refuses if another node placed something first."""
        if not await self._caught_up(timeout=60):
            logger.error("no master elected within 60 s; not placing the default model")
            return
        with anyio.move_on_after(60):
            while self.node_id not in self.cluster.state.node_info:
                await self.cluster.state_changed.wait()
        if self.node_id not in self.cluster.state.node_info:
            logger.error("this node's resources never reached the cluster state; not placing")
            return
        if self.cluster.state.instances:
            return
        logger.info(f"placing the default model {DEFAULT_MODEL_ID}")
        try:
            await self.cluster.submit(
                PlaceInstance(
                    command_id=CommandId.new(),
                    model_id=DEFAULT_MODEL_ID,
                    node_ids=(self.node_id,),
                    only_if_cluster_empty=True,
                    keep_alive=self._default_keep_alive(),
                )
            )
        except CommandRejectedError as error:
            if error.status_code != 409:
                logger.error(f"could not place the default model: {error}")
            return
        except CommandTimeoutError as error:
            logger.error(f"could not place the default model: {error}")

    def _default_keep_alive(self) -> KeepAlive | None:
        seconds = self.options.idle_unload_seconds
        return KeepAlive(seconds=seconds) if seconds is not None else None

    async def _announce_ready_models(self) -> None:
        """Log `<model> is ready` each time an instance this node takes part in becomes
        ready to answer (every rank ready), after a restart too. This node's own rank is
        judged by its runner's live status: after a restart the replayed state still holds
        the previous life's `RunnerReady` until the new runner reports (the line came ~40 s
        before a restarted node's runner had loaded)."""
        announced: set[InstanceId] = set()
        while not self.replica.caught_up():
            await anyio.sleep(0.2)
        while True:
            await self.cluster.state_changed.wait()
            state = self.cluster.state
            ready = set()
            for instance in state.instances_on_node(self.node_id):
                assignments = instance.shard_assignments
                mine = self.worker.runners.get(assignments.node_to_runner[self.node_id])
                if (
                    mine is not None
                    and isinstance(mine.status, RunnerReady | RunnerRunning)
                    and all(
                        isinstance(state.runners.get(runner_id), RunnerReady | RunnerRunning)
                        for runner_id in assignments.runner_to_shard
                    )
                ):
                    ready.add(instance.instance_id)
            for instance_id in ready - announced:
                logger.info(f"{state.instances[instance_id].model_id} is ready")
            announced = ready


class NodeStartError(RuntimeError):
    pass


def _lan_address() -> str:
    """The address other machines would reach this one on (no packet is sent)."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect(("10.255.255.255", 1))
        address: str = probe.getsockname()[0]
        return address
    except OSError:
        return "127.0.0.1"
    finally:
        probe.close()


def configure_logging(level: str) -> None:
    logger.remove()
    logger.add(
        sys.stderr,
        level=level,
        format="<green>{time:HH:mm:ss}</green> | <level>{level: <7}</level> | {message}",
    )


def run_node(options: Options) -> None:
    """Run a node with `options` until it is stopped.

    Raises:
        SystemExit: status 1 when the node cannot start (the reason logged).
    """
    configure_logging(options.log_level)
    for warning in tls_peer_warnings(options.cluster_secret, options.bootstrap_peers):
        logger.warning(warning)
    try:
        node = Node(options)
    except HomeInUseError as error:
        logger.error(str(error))
        raise SystemExit(1) from None
    except TlsFilesError as error:
        logger.error(str(error))
        raise SystemExit(1) from None
    except OSError as error:
        if (problem := not_writable_message(error, exo_home())) is not None:
            logger.error(problem)
            raise SystemExit(1) from None
        hint = (
            " (another exo or program holds the port: start this node with --api-port and "
            "--zenoh-port of its own)"
            if error.errno == errno.EADDRINUSE
            else ""
        )
        logger.error(f"cannot listen on {options.host}:{options.api_port}: {error}{hint}")
        raise SystemExit(1) from None
    try:
        anyio.run(node.run)
    except NodeStartError as error:
        logger.error(str(error))
        raise SystemExit(1) from None
