"""Limits on what one HTTP client can take from a node: request body size, time to send
headers and body, connections, concurrent generations per client, and a per-client
request rate.

- **Body size** (`--max-body-size`, default `DEFAULT_MAX_BODY_BYTES`): a declared
  `Content-Length` past the limit is refused at once (413); a body without one (chunked) is
  counted as it streams in and refused as soon as it passes the limit.
- **Header timeout** (`--header-timeout`): a connection must deliver a request's complete
  headers within this many seconds of opening (or of its first byte, for the next request
  on a kept-alive connection), however slowly it trickles them (slowloris); else it gets a
  408 and is closed. uvicorn 0.54's h11 protocol has no such timeout (its
  `timeout_keep_alive` only runs between requests), so `HeaderTimeoutH11Protocol` adds it.
- **Compressed bodies** (`Content-Encoding` zstd, gzip, deflate): decoded here, the
  decoded size within the same limit (`exo.api.guards.content_encoding`).
- **Body idle timeout** (`--body-timeout`): a body that sends nothing for this long gets a
  408.
- **Connections** (`--max-connections`): uvicorn's `limit_concurrency` (503 past it).
- **Generations per client** (`--max-generations-per-client`): streams and non-streamed
  generations running at once for one client (its API key when it sends one, else its
  address); past it, 429 with `Retry-After`.
- **Rate** (`--rate-limit N`, off by default): requests per minute per client, a token
  bucket holding up to N requests; past it, 429 with `Retry-After`. Operators' reads are
  not counted (`MONITORING_PATHS`: a Prometheus scrape, the dashboard's state stream and
  its polls): they still need a key, but a client's traffic must not blind the operator
  watching it, nor a scrape every 15 s eat a small limit.
- **Failed keys** (`--max-auth-failures N`): an address that presents N credentials that
  are not valid is locked out for a while (`exo.api.guards.throttle`, run by the auth
  middleware).
- **Trusted proxies** (`--trusted-proxy ADDRESS`, none by default): whose
  `X-Forwarded-For` / `X-Forwarded-Proto` name the client (uvicorn's proxy-headers
  middleware, which takes the nearest address in the chain that is not a trusted proxy).
  Without one those headers are ignored, so a client cannot pick the address that the
  throttle, the limits and the loopback exemption of generated keys see.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio
import h11
import uvicorn
from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from exo.api.guards.auth import CLIENT_SCOPE_KEY, ErrorResponder, is_public
from exo.api.guards.content_encoding import BodyDecodingError, decode_body, encodings
from exo.api.guards.throttle import DEFAULT_MAX_AUTH_FAILURES

# Anthropic documents 32 MB as the largest Messages API request; OpenAI's chat bodies are
# of the same order. Text prompts that fill the catalog's longest context (128K tokens, a
# few bytes each, JSON-escaped) stay far below it, and so does an image at
# `--image-max-bytes`' default (16 MiB, 21.3 MiB as base64).
DEFAULT_MAX_BODY_BYTES = 32 * 2**20
# A client sends its headers in one packet, within milliseconds; 10 s (Go servers' common
# ReadHeaderTimeout) leaves room for a slow mobile link and frees a slowloris's slot soon.
DEFAULT_HEADER_TIMEOUT_SECONDS = 10.0
DEFAULT_BODY_TIMEOUT_SECONDS = 30.0
# Below the usual 1024 open-files soft limit, leaving descriptors for runners, model files
# and cluster links; far more than a home cluster's clients need.
DEFAULT_MAX_CONNECTIONS = 512
# Enough for a chat UI plus an agent's parallel calls; small next to the queue a runner's
# admission allows, so one client cannot fill it.
DEFAULT_MAX_GENERATIONS_PER_CLIENT = 8
RETRY_AFTER_SECONDS = 5
GENERATION_PATHS = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/messages",
        "/ollama/api/chat",
        "/ollama/api/generate",
        "/ollama/v1/chat/completions",
        "/ollama/v1/completions",
    }
)
"""The routes that run a generation on the cluster (POST)."""
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_MAX_TRACKED_CLIENTS = 10_000


@dataclass(frozen=True, slots=True)
class ApiLimits:
    """See the module docstring; 0 / None turns a limit off where said."""

    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    header_timeout_seconds: float = DEFAULT_HEADER_TIMEOUT_SECONDS
    body_timeout_seconds: float = DEFAULT_BODY_TIMEOUT_SECONDS
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_generations_per_client: int = DEFAULT_MAX_GENERATIONS_PER_CLIENT
    """0: no limit."""
    rate_limit_per_minute: int | None = None
    """None: no limit."""
    max_auth_failures: int = DEFAULT_MAX_AUTH_FAILURES
    """Failed credentials per address before a lockout; 0: no lockout."""
    trusted_proxies: tuple[str, ...] = ()
    """IP addresses or networks (CIDR) whose forwarded headers are believed."""

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1 or self.max_connections < 1:
            raise ValueError("the body size and connection limits must be at least 1")
        if not (self.header_timeout_seconds > 0 and self.body_timeout_seconds > 0):
            raise ValueError("timeouts must be positive")
        if self.max_generations_per_client < 0:
            raise ValueError("the generations per client must be >= 0")
        if self.rate_limit_per_minute is not None and self.rate_limit_per_minute < 1:
            raise ValueError("the rate limit must be at least 1 request per minute")
        if self.max_auth_failures < 0:
            raise ValueError("the failed API keys before a lockout must be >= 0")
        for proxy in self.trusted_proxies:
            try:
                ipaddress.ip_network(proxy, strict=False)
            except ValueError:
                raise ValueError(
                    f"--trusted-proxy {proxy!r} is not an IP address or network (CIDR)"
                ) from None


# Read-only routes an operator's tools poll (GET/HEAD): Prometheus (`/metrics`), the
# dashboard's state stream and polls (`/events`, `/cluster` every 5 s, `/node_id` when it
# connects) and `/state`. The rate limit bounds what one client takes from the inference
# API; these answer from the node's memory, and throttling them would leave the operator
# blind exactly when a client is busiest.
MONITORING_PATHS = frozenset({"/metrics", "/events", "/state", "/cluster", "/node_id"})


def is_generation(method: str, path: str) -> bool:
    return method == "POST" and path in GENERATION_PATHS


def is_monitoring(method: str, path: str) -> bool:
    """Whether the rate limit leaves this request alone: an operator's read."""
    return method in ("GET", "HEAD") and path in MONITORING_PATHS


def client_of(scope: Scope) -> str:
    """The identity the auth middleware gave the request, else its address."""
    identity: str | None = scope.get(CLIENT_SCOPE_KEY)
    if identity is not None:
        return identity
    client = scope.get("client")
    return f"address:{client[0] if client else None}"


@dataclass(slots=True)
class _Bucket:
    tokens: float
    updated: float


@dataclass(slots=True)
class RateLimiter:
    """A token bucket per client: `per_minute` requests, refilled evenly over the minute.

    Args:
        per_minute: the bucket's size and its refill per minute.
        clock: monotonic seconds.
    """

    per_minute: int
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[str, _Bucket] = field(default_factory=dict)

    def take(self, client: str) -> float | None:
        """Take one request for `client`: None when allowed, else the seconds until one
        more would be."""
        now = self.clock()
        rate = self.per_minute / 60.0
        bucket = self._buckets.get(client)
        if bucket is None:
            if len(self._buckets) >= _MAX_TRACKED_CLIENTS:
                self._forget_full(now)
            bucket = self._buckets[client] = _Bucket(float(self.per_minute), now)
        bucket.tokens = min(float(self.per_minute), bucket.tokens + (now - bucket.updated) * rate)
        bucket.updated = now
        if bucket.tokens >= 1.0:
            bucket.tokens -= 1.0
            return None
        return (1.0 - bucket.tokens) / rate

    def _forget_full(self, now: float) -> None:
        # A bucket full again is the same as no bucket: forget those.
        idle = 60.0
        for client, bucket in list(self._buckets.items()):
            if now - bucket.updated >= idle:
                del self._buckets[client]


class LimitsMiddleware:
    """Rate limit, generations per client, body size and body idle timeout (in that order)."""

    def __init__(self, app: ASGIApp, limits: ApiLimits, respond: ErrorResponder) -> None:
        self.app = app
        self.limits = limits
        self.respond = respond
        self.rate = (
            RateLimiter(limits.rate_limit_per_minute)
            if limits.rate_limit_per_minute is not None
            else None
        )
        self.generations: dict[str, int] = {}
        """Generations in flight per client."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method: str = scope["method"]
        path: str = scope["path"]
        client = client_of(scope)
        counted = not (is_public(method, path) or is_monitoring(method, path))
        if self.rate is not None and client != "node" and counted:
            wait = self.rate.take(client)
            if wait is not None:
                retry_after = max(1, math.ceil(wait))
                message = (
                    f"rate limit reached: {self.limits.rate_limit_per_minute} requests per "
                    f"minute (--rate-limit); retry after {retry_after} s"
                )
                await self._refuse(
                    scope, receive, send, 429, "rate_limit_error", message, retry_after
                )
                return
        if not is_generation(method, path) or self.limits.max_generations_per_client == 0:
            await self._with_body(scope, receive, send)
            return
        running = self.generations.get(client, 0)
        cap = self.limits.max_generations_per_client
        if running >= cap:
            message = (
                f"this client already has {running} generations running on this node, the "
                f"most one client may (--max-generations-per-client {cap}); retry when one "
                "has finished"
            )
            await self._refuse(
                scope, receive, send, 429, "rate_limit_error", message, RETRY_AFTER_SECONDS
            )
            return
        self.generations[client] = running + 1
        try:
            await self._with_body(scope, receive, send)
        finally:
            left = self.generations[client] - 1
            if left:
                self.generations[client] = left
            else:
                del self.generations[client]

    async def _refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        error_type: str,
        message: str,
        retry_after: int | None = None,
        close: bool = False,
    ) -> None:
        headers: dict[str, str] = {}
        if retry_after is not None:
            headers["Retry-After"] = str(retry_after)
        if close:
            headers["Connection"] = "close"
        await self.respond(scope["path"], status, error_type, message, headers)(
            scope, receive, send
        )

    async def _with_body(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Read the whole body first (bounded in size and idle time), then hand it to the
        app, which reads it as one message."""
        headers = {name.lower(): value for name, value in scope["headers"]}
        declared = headers.get(b"content-length")
        chunked = b"chunked" in headers.get(b"transfer-encoding", b"").lower()
        if scope["method"] not in _BODY_METHODS and declared is None and not chunked:
            await self.app(scope, receive, send)
            return
        limit = self.limits.max_body_bytes
        too_large = (
            f"the request body is larger than this node accepts ({limit} bytes; --max-body-size)"
        )
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._refuse(
                scope, receive, send, 413, "invalid_request_error", too_large, close=True
            )
            return
        parts: list[bytes] = []
        size = 0
        pending: Message | None = None
        while True:
            with anyio.move_on_after(self.limits.body_timeout_seconds) as waiting:
                message = await receive()
            if waiting.cancelled_caught:
                logger.debug(f"api: {scope['path']}: body idle too long; answering 408")
                await self._refuse(
                    scope,
                    receive,
                    send,
                    408,
                    "invalid_request_error",
                    f"the request body sent nothing for {self.limits.body_timeout_seconds:g} "
                    "s (--body-timeout)",
                    close=True,
                )
                return
            if message["type"] != "http.request":
                pending = message  # the client left: the app sees it after the body
                break
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._refuse(
                    scope, receive, send, 413, "invalid_request_error", too_large, close=True
                )
                return
            parts.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(parts)
        applied = encodings(headers.get(b"content-encoding"))
        if applied:
            try:
                body = decode_body(body, applied, limit)
            except BodyDecodingError as error:
                error_type = "invalid_request_error"
                await self._refuse(scope, receive, send, error.status, error_type, error.message)
                return
            kept = [
                (name, value)
                for name, value in scope["headers"]
                if name.lower() not in (b"content-encoding", b"content-length")
            ]
            length = str(len(body)).encode()
            scope = {**scope, "headers": [*kept, (b"content-length", length)]}
        await self.app(scope, _replay(body, pending, receive), send)


def _replay(body: bytes, pending: Message | None, receive: Receive) -> Receive:
    delivered = False

    async def replay() -> Message:
        nonlocal delivered, pending
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        if pending is not None:
            message, pending = pending, None
            return message
        return await receive()

    return replay


_TIMEOUT_RESPONSE = (
    b"HTTP/1.1 408 Request Timeout\r\ncontent-type: text/plain; charset=utf-8\r\n"
    b"connection: close\r\ncontent-length: 36\r\n\r\n"
    b"request headers not received in time"
)


class HeaderTimeoutH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's headers: from the moment
    the connection opens, or the first byte of a following request on a kept-alive
    connection, to the end of its headers. Past it: a 408 and the connection is closed.

    `header_timeout_seconds` is set per server by `with_header_timeout`.
    """

    header_timeout_seconds: float = DEFAULT_HEADER_TIMEOUT_SECONDS

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:
            self._arm_header_timer()  # a request's headers are (still) coming
        else:
            self._cancel_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(
                self.header_timeout_seconds, self._header_timeout
            )

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        client = f"{self.client[0]}:{self.client[1]}" if self.client else "a client"
        logger.debug(f"api: {client} sent no complete request headers in time; closing")
        self.transport.write(_TIMEOUT_RESPONSE)
        self.transport.close()


def with_header_timeout(seconds: float) -> type[HeaderTimeoutH11Protocol]:
    """`HeaderTimeoutH11Protocol` with its deadline set to `seconds` (uvicorn creates the
    protocol from a class, one per connection)."""
    return type(
        "HeaderTimeoutH11Protocol", (HeaderTimeoutH11Protocol,), {"header_timeout_seconds": seconds}
    )


def server_config(app: ASGIApp, log_level: str, limits: ApiLimits) -> uvicorn.Config:
    """The node's uvicorn configuration: h11 with `limits.header_timeout_seconds` for each
    request's headers, uvicorn's keep-alive timeout (5 s) between requests,
    `limits.max_connections` as its `limit_concurrency`, access log at `exo -v`, forwarded
    headers believed only from `limits.trusted_proxies` (uvicorn believes loopback's by
    default).

    Args:
        log_level: the node's (`DEBUG`, `INFO`, `WARNING`).
    """
    verbose = log_level in ("DEBUG", "TRACE")
    return uvicorn.Config(
        app,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        timeout_graceful_shutdown=2,
        http=with_header_timeout(limits.header_timeout_seconds),
        limit_concurrency=limits.max_connections,
        lifespan="off",
        proxy_headers=bool(limits.trusted_proxies),
        forwarded_allow_ips=list(limits.trusted_proxies) or None,
    )
