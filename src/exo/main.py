"""`exo`: start a node. Wires the components together through the router's topics."""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from dataclasses import dataclass

import anyio
from loguru import logger
from rich.console import Console

from exo.api.cluster import ClusterClient, CommandRejectedError, CommandTimeoutError
from exo.api.main import Api, bind_api_socket
from exo.master.decisions import events_after_restart
from exo.master.event_log import EventLog
from exo.master.main import Master
from exo.routing.router import Router
from exo.shared.apply import apply_all
from exo.shared.constants import (
    DEFAULT_API_PORT,
    event_log_path,
    exo_home,
    models_dir,
    node_id_path,
)
from exo.shared.local_events import LocalEventSender
from exo.shared.models.cards import load_builtin_cards
from exo.shared.types.commands import PlaceInstance
from exo.shared.types.common import CommandId, ModelId, NodeId
from exo.shared.types.runners import RunnerReady
from exo.shared.types.state import State
from exo.utils.info_gatherer import InfoGatherer
from exo.worker.main import Worker

DEFAULT_MODEL_ID = ModelId("HuggingFaceTB/SmolLM2-135M-Instruct")


@dataclass(frozen=True)
class Options:
    api_host: str
    api_port: int
    log_level: str
    offline: bool
    default_model: bool


def parse_args(argv: list[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="exo",
        description=(
            "Run an exo node: serve AI models from the machines you own through the "
            f"OpenAI-compatible API on port {DEFAULT_API_PORT}."
        ),
    )
    parser.add_argument(
        "--api-port", type=int, default=DEFAULT_API_PORT, help="HTTP API port (default %(default)s)"
    )
    parser.add_argument(
        "--api-host", default="0.0.0.0", help="address the API listens on (default %(default)s)"
    )
    verbosity = parser.add_mutually_exclusive_group()
    verbosity.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    verbosity.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")
    parser.add_argument(
        "--offline",
        action="store_true",
        help="never download: use only models already on this machine",
    )
    parser.add_argument(
        "--no-default-model",
        action="store_true",
        help=f"do not place {DEFAULT_MODEL_ID} when the cluster has no instance",
    )
    args = parser.parse_args(argv)
    if not 0 < args.api_port < 65536:
        parser.error(f"--api-port must be between 1 and 65535, not {args.api_port}")
    log_level = "WARNING" if args.quiet else ("DEBUG" if args.verbose else "INFO")
    return Options(
        api_host=args.api_host,
        api_port=args.api_port,
        log_level=log_level,
        offline=args.offline,
        default_model=not args.no_default_model,
    )


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
    """One exo process: master, worker, API and info gatherer on one router."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.node_id = load_node_id()
        self.router = Router()
        self.cards = load_builtin_cards()
        self.event_log = EventLog(event_log_path())
        replayed = self.event_log.read_all()
        state = apply_all(State(), replayed)
        if replayed:
            logger.info(f"replayed {len(replayed)} events from {self.event_log.path}")
        local_events = LocalEventSender(self.node_id, self.router.local_events.sender())
        self.master = Master(
            node_id=self.node_id,
            state=state,
            event_log=self.event_log,
            command_subscription=self.router.commands.subscribe(),
            local_event_subscription=self.router.local_events.subscribe(),
            global_event_publisher=self.router.global_events.sender(),
            cards=self.cards,
        )
        self.worker = Worker(
            node_id=self.node_id,
            state=state,
            global_event_subscription=self.router.global_events.subscribe(),
            local_events=local_events,
            publish_chunk=self.router.chunks.publish,
            models_dir=models_dir(),
            offline=options.offline,
            log_level=options.log_level,
        )
        self.cluster = ClusterClient(
            node_id=self.node_id,
            state=state,
            global_event_subscription=self.router.global_events.subscribe(),
            chunk_subscription=self.router.chunks.subscribe(),
            command_publisher=self.router.commands.sender(),
            cards=self.cards,
        )
        self.info_gatherer = InfoGatherer(local_events)
        self._listen_socket = bind_api_socket(options.api_host, options.api_port)
        self.api = Api(self.cluster, self._listen_socket, options.log_level)

    async def run(self) -> None:
        # Whatever this node was running before it stopped is gone now.
        self.master.emit(events_after_restart(self.master.state, self.node_id))
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self._stop_on_signal, task_group.cancel_scope)
                task_group.start_soon(self.master.run)
                task_group.start_soon(self.worker.run)
                task_group.start_soon(self.api.run)
                task_group.start_soon(self.info_gatherer.run)
                task_group.start_soon(self._announce)
                if self.options.default_model:
                    task_group.start_soon(self._place_default_model)
        finally:
            self.event_log.close()
            self._listen_socket.close()
            logger.info("exo stopped")

    async def _stop_on_signal(self, scope: anyio.CancelScope) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for received in signals:
                logger.info(f"received {signal.Signals(received).name}; shutting down runners")
                scope.cancel()
                return

    async def _announce(self) -> None:
        with anyio.move_on_after(30) as waiting:
            while not self.api.started:
                await anyio.sleep(0.05)
        if waiting.cancelled_caught:
            logger.error("the API server did not start within 30 s")
            return
        console = Console(stderr=True)
        port = self.options.api_port
        host = self.options.api_host
        urls = [f"http://{'localhost' if host == '0.0.0.0' else host}:{port}"]
        if host == "0.0.0.0":
            urls.append(f"http://{_lan_address()}:{port}")
        console.rule("[bold]exo")
        console.print(f"  node      {self.node_id}")
        console.print(f"  API       {'  '.join(urls)}")
        console.print(f"  chat      POST {urls[0]}/v1/chat/completions")
        console.print(f"  data      {exo_home()}")
        console.rule()

    async def _place_default_model(self) -> None:
        """On a node with no instance, place the default model so a fresh install answers."""
        state = self.cluster.state
        with anyio.move_on_after(60):
            while self.node_id not in state.node_info:
                await self.cluster.state_changed.wait()
                state = self.cluster.state
        if self.node_id not in state.node_info:
            logger.error("this node's resources never reached the cluster state; not placing")
            return
        if state.instances:
            return
        logger.info(f"placing the default model {DEFAULT_MODEL_ID}")
        try:
            await self.cluster.submit(
                PlaceInstance(command_id=CommandId.new(), model_id=DEFAULT_MODEL_ID)
            )
        except (CommandRejectedError, CommandTimeoutError) as error:
            logger.error(f"could not place the default model: {error}")
            return
        while True:
            await self.cluster.state_changed.wait()
            state = self.cluster.state
            if any(
                isinstance(state.runners.get(runner_id), RunnerReady)
                for instance in state.instances_of_model(DEFAULT_MODEL_ID)
                for runner_id in instance.shard_assignments.runner_to_shard
            ):
                logger.info(f"{DEFAULT_MODEL_ID} is ready")
                return


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


def main(argv: list[str] | None = None) -> None:
    options = parse_args(argv)
    configure_logging(options.log_level)
    try:
        node = Node(options)
    except OSError as error:
        logger.error(f"cannot listen on {options.api_host}:{options.api_port}: {error}")
        raise SystemExit(1) from None
    anyio.run(node.run)


if __name__ == "__main__":
    main()
