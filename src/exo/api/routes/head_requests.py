"""`HEAD` on every `GET` route, as HTTP asks (RFC 9110 §9.3.2) and as Ollama's clients
use it (`HEAD /`, `HEAD /api/version`): the request is served as a `GET` whose status and
headers are sent and whose body is not, and the handler is stopped once its headers are
out (so an endless stream such as `/events` ends at once).
"""

from __future__ import annotations

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HeadAsGetMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        async with anyio.create_task_group() as group:

            async def headers_only(message: Message) -> None:
                if message["type"] != "http.response.start":
                    return
                await send(message)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                group.cancel_scope.cancel()

            async def as_get() -> None:
                await self.app({**scope, "method": "GET"}, receive, headers_only)

            group.start_soon(as_get)
