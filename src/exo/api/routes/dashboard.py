"""The dashboard: its page and files, the live state stream it reads, and the page as the
answer to any other browser navigation that is not an API route.

- `GET /` is the page (`exo/dashboard/static/index.html`), `GET /static/<path>` its files;
  both revalidate with ETags (`Cache-Control: no-cache`), so an upgraded node never serves a
  stale page and an unchanged one answers 304.
- `GET /events` streams the cluster state (`exo.api.serving.live_state`).
- A `GET` of an unknown path whose `Accept` names `text/html`, outside every API route's
  first path segment (read from the app's routes, so routes added later count too), gets
  the page; every other unknown path keeps the API's JSON 404.
- Every dashboard response carries a strict Content-Security-Policy: scripts, styles and
  connections only from this node, no inline script or style, no `eval`, no plugins, no
  framing. Model output the page shows can therefore never run script, whatever it holds.
"""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import fastapi.routing
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.gzip import GZipMiddleware
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

import exo
from exo.api.serving.live_state import StateChanges, state_stream

STATIC_DIR = Path(exo.__file__).parent / "dashboard" / "static"
STATIC_PREFIX = "/static"
INDEX_FILE = "index.html"

CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS: tuple[tuple[str, str], ...] = (
    ("content-security-policy", CONTENT_SECURITY_POLICY),
    ("x-content-type-options", "nosniff"),
    ("referrer-policy", "no-referrer"),
)
# Fixed here rather than read from the system's mime.types, which differ between machines
# (and nosniff makes browsers refuse a script served under a wrong type).
MEDIA_TYPES: dict[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".json": "application/json",
    ".map": "application/json",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".webp": "image/webp",
    ".woff2": "font/woff2",
    ".txt": "text/plain; charset=utf-8",
    ".md": "text/plain; charset=utf-8",
}

GZIP_MINIMUM_BYTES = 1024
"""Smaller files are sent as they are: compressing them saves less than a packet."""

router = APIRouter()


def _with_security_headers(headers: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    names = {name.decode("latin-1").lower() for name, _ in headers}
    extra = [
        (name.encode("latin-1"), value.encode("latin-1"))
        for name, value in SECURITY_HEADERS
        if name not in names
    ]
    return [*headers, *extra]


def _add_security_headers(response: Response) -> Response:
    for name, value in SECURITY_HEADERS:
        response.headers[name] = value
    return response


class SecurityHeaders:
    """ASGI wrapper adding `SECURITY_HEADERS` to every response of the app it wraps (304s
    and errors included)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": _with_security_headers(message["headers"])}
            await send(message)

        await self.app(scope, receive, send_with_headers)


class DashboardFiles(StaticFiles):
    """The page's files, with fixed content types and `Cache-Control: no-cache` (always
    revalidated through the ETag); a missing file is a plain 404."""

    async def get_response(self, path: str, scope: Scope) -> Response:
        try:
            return await super().get_response(path, scope)
        except StarletteHTTPException as error:
            if error.status_code != 404:
                raise
            return Response("not found", status_code=404, media_type="text/plain")

    def file_response(
        self,
        full_path: str | os.PathLike[str],
        stat_result: os.stat_result,
        scope: Scope,
        status_code: int = 200,
    ) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        suffix = Path(full_path).suffix.lower()
        if suffix in MEDIA_TYPES and response.status_code == status_code:
            response.headers["content-type"] = MEDIA_TYPES[suffix]
        response.headers["cache-control"] = "no-cache"
        return response


def _files_of(scope: Scope) -> DashboardFiles:
    files: DashboardFiles = scope["app"].state.dashboard_files
    return files


async def serve_static(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI app mounted at `/static`: the app's `DashboardFiles`, gzipped for clients
    that accept it (the scripts shrink to about a third)."""
    files = SecurityHeaders(_files_of(scope))
    await GZipMiddleware(files, minimum_size=GZIP_MINIMUM_BYTES)(scope, receive, send)


async def page_response(scope: Scope) -> Response:
    """The dashboard page (200, or 304 when the client's ETag matches)."""
    files = _files_of(scope)
    directory = Path(str(files.directory))
    if not (directory / INDEX_FILE).is_file():
        # A broken installation, not a missing route: say so instead of a bare 404.
        return _add_security_headers(
            Response(
                f"the dashboard's files are missing from this installation ({directory})",
                status_code=500,
                media_type="text/plain",
            )
        )
    response = await files.get_response(INDEX_FILE, {**scope, "method": "GET"})
    if scope["method"] == "HEAD":
        response = Response(status_code=response.status_code, headers=dict(response.headers))
    return _add_security_headers(response)


@router.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
async def dashboard_page(request: Request) -> Response:
    """The dashboard."""
    return await page_response(request.scope)


class EventStreamResponse(Response):
    """A `text/event-stream` response that ends when the client disconnects (however long
    its stream would otherwise wait for the next message) or when the server stops
    (`close_event_streams`)."""

    media_type = "text/event-stream"

    def __init__(self, messages: AsyncGenerator[str, None]) -> None:
        super().__init__(
            headers={
                "cache-control": "no-cache",
                # nginx and similar proxies would otherwise hold messages back.
                "x-accel-buffering": "no",
                **dict(SECURITY_HEADERS),
            },
        )
        # No body was given, so Response declared `content-length: 0`: the stream has none.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self._messages = messages
        self._scope = anyio.CancelScope()
        self._disconnected = False

    def close(self) -> None:
        """End the stream (the client reconnects to another server, or to this one later)."""
        self._scope.cancel()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        open_streams: set[EventStreamResponse] = scope["app"].state.event_streams
        open_streams.add(self)
        try:
            with self._scope:
                await self._stream(receive, send)
        finally:
            open_streams.discard(self)
        if not self._disconnected:
            # Closed by the server: end the response properly (unless the client has
            # stopped reading too, and the socket is full).
            with anyio.move_on_after(1):
                await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _stream(self, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        async with anyio.create_task_group() as task_group:

            async def cancel_on_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self._disconnected = True
                task_group.cancel_scope.cancel()

            task_group.start_soon(cancel_on_disconnect)
            async with aclosing(self._messages) as messages:
                async for text in messages:
                    body = text.encode("utf-8")
                    await send({"type": "http.response.body", "body": body, "more_body": True})


def close_event_streams(app: FastAPI) -> None:
    """End every `/events` stream of `app` (the server is stopping: an open stream would
    otherwise hold the connection until the process exits)."""
    streams: set[EventStreamResponse] = getattr(app.state, "event_streams", set())
    for stream in list(streams):
        stream.close()


@router.get("/events", include_in_schema=False)
async def state_events(request: Request) -> EventStreamResponse:
    """Server-Sent Events of the cluster state: a snapshot, then a JSON Patch per change
    (`exo.api.serving.live_state`)."""
    cluster = request.app.state.cluster
    changes = StateChanges(
        current_state=lambda: cluster.state,
        wait_for_change=lambda: cluster.state_changed.wait(),
    )
    return EventStreamResponse(state_stream(changes))


def api_path_segments(app: FastAPI) -> frozenset[str]:
    """The first path segment of every route of `app` except the dashboard's own page:
    paths under them are the API's, and their 404s stay JSON."""
    # FastAPI 0.16x keeps included routers nested; `iter_route_contexts` flattens them
    # (earlier releases list every route in `app.routes` already).
    flatten: Any = getattr(fastapi.routing, "iter_route_contexts", None)
    routes = flatten(app.routes) if flatten is not None else app.routes
    segments: set[str] = set()
    for route in routes:
        path: str | None = getattr(route, "path", None)
        if path is None:
            continue
        first = path.lstrip("/").split("/", 1)[0]
        if first and not first.startswith("{"):
            segments.add(first)
    return frozenset(segments)


def wants_page(request: Request) -> bool:
    """Whether an unmatched request is a browser navigation the page should answer: a GET
    (or HEAD) asking for HTML, outside every API route's first segment."""
    if request.method not in ("GET", "HEAD"):
        return False
    if "text/html" not in request.headers.get("accept", ""):
        return False
    first = request.url.path.lstrip("/").split("/", 1)[0]
    return first not in api_path_segments(request.app)


ExceptionHandler = Callable[[Request, Exception], Awaitable[Response]]


def install(app: FastAPI, directory: Path = STATIC_DIR) -> None:
    """Serve the dashboard from `app`: its routes, its files under `/static`, and the page
    for browser navigations that match no route (other 404s go to the app's own handler
    for `HTTPException`, looked up when they happen).

    Args:
        directory: the page's files (`app.state.dashboard_files` may replace them later).
    """
    app.state.dashboard_files = DashboardFiles(directory=directory, check_dir=False)
    app.state.event_streams = set()
    """The `/events` responses streaming now (for tests and metrics)."""
    app.include_router(router)
    app.mount(STATIC_PREFIX, serve_static, name="dashboard-static")

    async def not_found(request: Request, error: Exception) -> Response:
        if wants_page(request):
            return await page_response(request.scope)
        handler: Any = app.exception_handlers.get(StarletteHTTPException)
        if handler is None:
            raise error
        response: Response = await handler(request, error)
        return response

    app.add_exception_handler(404, not_found)
