"""Pieces of `exo.routing.zenoh_router` that run beside its zenoh session: the outbox thread
that performs puts in call order (with BLOCK congestion control a put waits while a slow
peer's queue is full, which must not stall the event loop), closing a session, and picking
a listen address."""

from __future__ import annotations

import ipaddress
import queue
import socket
import threading
from collections.abc import Callable

import zenoh
from loguru import logger


class Outbox:
    """Runs zenoh puts on one thread, in call order. With BLOCK congestion control a put
    waits while a slow peer's queue is full; that wait must not stall the event loop."""

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[Callable[[], object] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def send(self, put: Callable[[], object]) -> None:
        self._queue.put(put)

    def stop(self, timeout: float) -> None:
        """Send what is queued, then end the thread (waits at most `timeout` seconds)."""
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning(f"{self._thread.name}: unsent messages after {timeout} s")

    def _run(self) -> None:
        while (put := self._queue.get()) is not None:
            try:
                put()
            except zenoh.ZError as error:
                logger.warning(f"{self._thread.name}: a message was not sent: {error}")
            except Exception:
                logger.exception(f"{self._thread.name}: a message was not sent")


def close_session(session: zenoh.Session, token: zenoh.LivelinessToken | None) -> None:
    """Withdraw the node's liveliness token, then close the session (blocking)."""
    if token is not None:
        token.undeclare()
    session.close()


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (a name is not)."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_tcp_port(host: str) -> int:
    """A port nothing listens on right now (another process could take it before zenoh:
    `NetworkRouter.start` picks again when it did)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        port: int = probe.getsockname()[1]
        return port
