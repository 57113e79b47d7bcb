"""Which web pages may use the API from a browser, and which names the API answers to.

Browser chat UIs call the API cross-origin, so it answers CORS preflights. By default only
pages served from this machine's loopback names may (`localhost`, `127.0.0.1`, `[::1]`, any
port, http or https — Ollama's default): a random website the user visits must not drive
the cluster. `--cors-origins` widens that list (`*`: every page).

A page may still reach the API through DNS rebinding (its own name, re-pointed at this
machine). Browsers send that name as `Host`, so requests whose `Host` is not one of this
node's names or addresses are refused: allowed are IP literals, `localhost` (and
`*.localhost`, which resolve to loopback), this machine's hostname (and `hostname.local`),
and the hosts of the configured origins. A request from a page whose origin is not allowed
is refused too: a "simple" cross-origin POST needs no preflight, and would otherwise run.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

ANY_ORIGIN = "*"
# Fully matched (starlette's `allow_origin_regex` uses `re.fullmatch` too).
LOOPBACK_ORIGIN_PATTERN = r"https?://(localhost|127\.0\.0\.1|\[::1\])(:[0-9]{1,5})?"
_LOOPBACK_ORIGIN = re.compile(LOOPBACK_ORIGIN_PATTERN)


def parse_cors_origins(text: str) -> tuple[str, ...]:
    """The origins of a comma-separated `--cors-origins` value, normalised as browsers send
    them (lower case, no trailing slash).

    Args:
        text: e.g. "https://chat.example.com, http://192.168.1.7:3000" or "*".

    Raises:
        ValueError: an entry that is neither `*` nor `scheme://host[:port]`.
    """
    origins: list[str] = []
    for entry in (part.strip() for part in text.split(",")):
        if not entry:
            continue
        if entry == ANY_ORIGIN:
            origins.append(ANY_ORIGIN)
            continue
        origin = entry.rstrip("/").lower()
        try:
            parts = urlsplit(origin)
            parts.port  # noqa: B018 - raises ValueError for a port out of range
        except ValueError as error:
            raise ValueError(f"CORS origin {entry!r}: {error}") from None
        if not parts.scheme or not parts.hostname or parts.path or parts.query or parts.fragment:
            raise ValueError(f"CORS origin {entry!r} must look like scheme://host[:port] (or be *)")
        origins.append(origin)
    return tuple(dict.fromkeys(origins))


def host_name(host_header: str) -> str:
    """The name or address of a `Host` header, without port, brackets or trailing dot, in
    lower case ("[::1]:52415" -> "::1", "Box.local.:80" -> "box.local")."""
    host = host_header.strip().lower()
    if host.startswith("["):
        return host[1 : host.find("]")] if "]" in host else host[1:]
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class BrowserAccess:
    """The API's answer to browsers: origins allowed besides loopback pages, and the names
    (besides IP literals and `localhost`) requests may address this node by.

    Args:
        extra_origins: from `parse_cors_origins`; `*` allows every origin and every name.
        host_names: this machine's own names, lower case (`this_machine_names`).
        check_host: refuse requests addressed to other names (off only for in-process
            test clients, which call the server `testserver`).
    """

    extra_origins: tuple[str, ...] = ()
    host_names: frozenset[str] = frozenset()
    check_host: bool = True

    @property
    def any_origin(self) -> bool:
        return ANY_ORIGIN in self.extra_origins

    def origin_allowed(self, origin: str, host_header: str | None) -> bool:
        """Whether a page at `origin` may use the API: a loopback page, a configured origin,
        or the page this API itself served (same host and port)."""
        origin = origin.rstrip("/").lower()
        if self.any_origin or origin in self.extra_origins:
            return True
        if _LOOPBACK_ORIGIN.fullmatch(origin):
            return True
        return host_header is not None and urlsplit(origin).netloc == host_header.strip().lower()

    def host_allowed(self, host_header: str | None) -> bool:
        """Whether a request addressed to `host_header` is meant for this node (a missing
        header, sent only by HTTP/1.0 clients and never by browsers, is)."""
        if not self.check_host or self.any_origin or host_header is None:
            return True
        name = host_name(host_header)
        if _is_ip_literal(name) or name == "localhost" or name.endswith(".localhost"):
            return True
        if name in self.host_names:
            return True
        return any(urlsplit(origin).hostname == name for origin in self.extra_origins)


def this_machine_names(hostname: str | None = None) -> frozenset[str]:
    """This machine's hostname and its mDNS name (`hostname.local`), lower case.

    Args:
        hostname: the name to use (default `socket.gethostname()`).
    """
    name = (hostname if hostname is not None else socket.gethostname()).strip().lower()
    name = name.rstrip(".")
    if not name:
        return frozenset()
    short = name.split(".", 1)[0]
    return frozenset({name, short, f"{short}.local"})


RefuseResponder = Callable[[str, str], Callable[[Scope, Receive, Send], Awaitable[None]]]
"""(request path, message) -> an ASGI response refusing the request with 403."""


class BrowserAccessMiddleware:
    """Refuse (403, through `refuse`) requests addressed to a name that is not this node's,
    and requests a web page sent from an origin that is not allowed."""

    def __init__(self, app: ASGIApp, access: BrowserAccess, refuse: RefuseResponder) -> None:
        self.app = app
        self.access = access
        self.refuse = refuse

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        host = _header(scope["headers"], b"host")
        origin = _header(scope["headers"], b"origin")
        message: str | None = None
        if not self.access.host_allowed(host):
            message = (
                f"this node does not answer to the name {host!r}: use its address, "
                "localhost or its hostname (names of --cors-origins are allowed too)"
            )
        elif origin is not None and not self.access.origin_allowed(origin, host):
            message = (
                f"web pages from {origin} may not use this API; start exo with "
                f"--cors-origins {origin} to allow them"
            )
        if message is None:
            await self.app(scope, receive, send)
            return
        await self.refuse(scope["path"], message)(scope, receive, send)


def _header(headers: Iterable[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
