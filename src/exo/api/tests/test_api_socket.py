"""The API's listening socket: accepted connections have Nagle's algorithm off."""

from __future__ import annotations

import asyncio
import socket

import pytest

from exo.api.main import bind_api_socket


@pytest.mark.anyio
async def test_accepted_connections_have_tcp_nodelay() -> None:
    """asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP; without it, a
    response written as headers then body waits for the client's delayed ACK."""
    listener = bind_api_socket("127.0.0.1", 0)
    accepted: asyncio.Queue[asyncio.BaseTransport] = asyncio.Queue()

    class Accept(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            accepted.put_nowait(transport)

    server = await asyncio.get_running_loop().create_server(Accept, sock=listener)
    try:
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        transport = await asyncio.wait_for(accepted.get(), timeout=10)
        server_side: socket.socket = transport.get_extra_info("socket")
        assert server_side.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
        writer.close()
        transport.close()
    finally:
        server.close()
        await server.wait_closed()
