"""A real uvicorn server (the node's configuration: `exo.api.guards.limits.server_config`) in a
thread on 127.0.0.1, for tests that need real connections: official SDK clients, raw
sockets, concurrent streams."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from exo.api.app import create_app
from exo.api.guards.limits import ApiLimits, server_config
from exo.api.security import ApiSecurity
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.scripted_cluster import ScriptedCluster

START_TIMEOUT_SECONDS = 10.0


@contextmanager
def serving(app: ASGIApp, limits: ApiLimits | None = None) -> Iterator[tuple[str, int]]:
    """Serve `app` until the block ends; yields (base URL, port). The server is stopped
    (and its thread joined) however the block ends."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))  # the kernel picks a free port
    listener.listen(64)
    port: int = listener.getsockname()[1]
    server = uvicorn.Server(server_config(app, "WARNING", limits or ApiLimits()))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not server.started and thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert server.started, "uvicorn did not start"
        yield f"http://127.0.0.1:{port}", port
    finally:
        server.should_exit = True
        thread.join(timeout=10.0)
        listener.close()
        assert not thread.is_alive(), "uvicorn did not stop within 10 s"


def scripted_app(cluster: ScriptedCluster, security: ApiSecurity | None = None) -> FastAPI:
    """The API app over a stand-in cluster (`exo.testing.scripted_cluster`)."""
    return create_app(cast(ClusterClient, cluster), security=security)
