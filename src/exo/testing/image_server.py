"""A loopback HTTP server of scripted routes, for tests of image URLs (and any other fetch).

Each route answers one way: a body (`Body`), a redirect (`Redirect`), no answer for a while
(`Stall`) or a body sent one byte at a time (`Trickle`); any other path is a 404. Leaving
`serving_routes` releases the stalled and trickling handlers, then stops the server, so no
test waits out a stall or leaves a thread behind.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True, slots=True)
class Body:
    """200 with `data` (and its Content-Length) as `content_type`."""

    data: bytes
    content_type: str = "image/png"


@dataclass(frozen=True, slots=True)
class Redirect:
    """302 to `location` (a path of this server or any URL)."""

    location: str


@dataclass(frozen=True, slots=True)
class Stall:
    """No answer at all for `seconds` (or until the server stops), then the connection closes."""

    seconds: float


@dataclass(frozen=True, slots=True)
class Trickle:
    """200 headers promising `size` bytes, then one byte every `gap_seconds`."""

    size: int
    gap_seconds: float
    content_type: str = "image/png"


Route = Body | Redirect | Stall | Trickle


def _handler(routes: Mapping[str, Route], release: threading.Event) -> type[BaseHTTPRequestHandler]:
    class RouteHandler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            route = routes.get(self.path)
            match route:
                case None:
                    self.send_error(404)
                case Redirect(location):
                    self.send_response(302)
                    self.send_header("Location", location)
                    self.end_headers()
                case Stall(seconds):
                    release.wait(seconds)
                case Trickle(size, gap_seconds, content_type):
                    self.send_response(200)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(size))
                    self.end_headers()
                    for _ in range(size):
                        if release.wait(gap_seconds):
                            return
                        self.wfile.write(b"x")
                        self.wfile.flush()
                case Body(data, content_type):
                    self.send_response(200)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    return RouteHandler


@contextmanager
def serving_routes(routes: Mapping[str, Route]) -> Iterator[str]:
    """Serve `routes` (path -> route) on 127.0.0.1 at a free port; yields the base URL
    (`http://127.0.0.1:PORT`). On exit the stalls end, the server stops and its thread is
    joined (at most 10 s)."""
    release = threading.Event()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(routes, release))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
