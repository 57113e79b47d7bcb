"""The API component: the HTTP server and the cluster client behind it."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Callable, Iterator

import anyio
import uvicorn

from exo.api.app import create_app
from exo.api.guards.browser_access import BrowserAccess
from exo.api.guards.limits import server_config
from exo.api.routes.dashboard import close_event_streams
from exo.api.security import ApiSecurity
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import ClusterClient

# uvicorn's `main_loop` wakes every 0.1 s to look at `should_exit` (and refreshes the
# `date` header every tenth time); ours waits for `should_exit` and wakes once a second.
SERVER_TICK_SECONDS = 1.0
# uvicorn's tick counter counts tenths of a second and wraps at a day of them.
_UVICORN_TICKS_PER_SECOND = 10
_UVICORN_TICK_WRAP = 864000
# What a client whose generation this node was streaming reads as the node stops.
SHUTTING_DOWN_MESSAGE = "the node is shutting down"


class _EmbeddedServer(uvicorn.Server):
    """A uvicorn server that leaves signal handling to the node and, when idle, wakes
    once a second instead of ten times (an idle node's event loop had no busier timer).

    Args:
        before_shutdown: called once as the server stops, before it waits for the open
            responses to end (`shutdown`).
    """

    _exit_requested: anyio.Event | None = None
    _should_exit = False

    def __init__(
        self, config: uvicorn.Config, before_shutdown: Callable[[], None] = lambda: None
    ) -> None:
        super().__init__(config)
        self._before_shutdown = before_shutdown
        self._shutting_down = False

    @property
    def should_exit(self) -> bool:
        return self._should_exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        self._should_exit = value
        if value and self._exit_requested is not None:
            self._exit_requested.set()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's graceful shutdown (stop accepting, close idle connections, wait at most
        `timeout_graceful_shutdown` for the open responses, then cancel them), once, after
        `before_shutdown` has told the open streams to end."""
        if self._shutting_down:
            return
        self._shutting_down = True
        self._before_shutdown()
        await super().shutdown(sockets)

    async def main_loop(self) -> None:
        """uvicorn's loop, with `on_tick` once a second (the `date` header still changes
        every second) and an exit as soon as `should_exit` is set."""
        self._exit_requested = anyio.Event()
        if self.should_exit:
            self._exit_requested.set()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            with anyio.move_on_after(SERVER_TICK_SECONDS):
                await self._exit_requested.wait()
            counter = (counter + _UVICORN_TICKS_PER_SECOND) % _UVICORN_TICK_WRAP
            should_exit = await self.on_tick(counter)


def bind_api_socket(host: str, port: int) -> socket.socket:
    """Bind the API's listening socket up front so a busy port is a clear startup error.

    Raises:
        OSError: the address is in use or not available.
    """
    # IPPROTO_TCP, not the default 0: asyncio turns Nagle's algorithm off (TCP_NODELAY) only
    # on accepted sockets whose `proto` says TCP. With it on, a response written in two parts
    # (headers, then body) waited ~40 ms for the client's delayed ACK on kept-alive connections.
    listen_socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    listen_socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listen_socket.bind((host, port))
    except OSError:
        listen_socket.close()
        raise
    listen_socket.listen(2048)
    listen_socket.setblocking(False)
    return listen_socket


class Api:
    def __init__(
        self,
        cluster: ClusterClient,
        listen_socket: socket.socket,
        log_level: str,
        browser_access: BrowserAccess,
        admission: Admission | None = None,
        security: ApiSecurity | None = None,
    ) -> None:
        self.cluster = cluster
        self.app = create_app(cluster, browser_access, admission, security)
        config = server_config(self.app, log_level, (security or ApiSecurity()).limits)
        self._socket = listen_socket
        self._server = _EmbeddedServer(config, self._end_open_streams)

    @property
    def started(self) -> bool:
        return self._server.started

    async def run(self) -> None:
        """Serve until cancelled (the node stops), then shut the server down gracefully:
        an open generation stream ends with its dialect's in-band error rather than being
        cut, within uvicorn's `timeout_graceful_shutdown`."""
        try:
            async with anyio.create_task_group() as task_group:
                task_group.start_soon(self.cluster.run)
                await self._server.serve(sockets=[self._socket])
                task_group.cancel_scope.cancel()
        finally:
            self._server.should_exit = True
            if self._server.started:
                # The node's cancellation interrupted `serve` before its own shutdown.
                with anyio.CancelScope(shield=True):
                    await self._server.shutdown(sockets=[self._socket])
            self._end_open_streams()

    def _end_open_streams(self) -> None:
        self.cluster.end_streams(SHUTTING_DOWN_MESSAGE)
        close_event_streams(self.app)
