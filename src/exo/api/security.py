"""How the API app guards and measures itself: API keys (`exo.api.guards.auth`), limits on
clients (`exo.api.guards.limits`) and metrics (`exo.api.serving.metrics`), installed as
middleware around the routes.

Order, outermost first: metrics (it counts every answer, refusals included), the browser
checks (Host / Origin, 403), CORS (preflights answered before any key is asked for, and
CORS headers on a 401 so a page can read it), API keys (401), limits (429, 413, 408), the
JSON body normalisation, the routes.
"""

from __future__ import annotations

import argparse
import os
import signal
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import anyio
import fastapi.routing
from fastapi import FastAPI
from loguru import logger
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp

from exo.api.guards.auth import (
    API_KEY_FILE_NAME,
    ApiAuth,
    AuthMiddleware,
    ErrorResponder,
    KeyFileError,
    check_key,
    load_or_create_key,
    read_key_file,
)
from exo.api.guards.limits import (
    DEFAULT_BODY_TIMEOUT_SECONDS,
    DEFAULT_HEADER_TIMEOUT_SECONDS,
    DEFAULT_MAX_BODY_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_GENERATIONS_PER_CLIENT,
    ApiLimits,
    LimitsMiddleware,
)
from exo.api.guards.throttle import DEFAULT_MAX_AUTH_FAILURES, AuthThrottle
from exo.api.serving.metrics import AdmissionCounts, ApiMetrics, MetricsMiddleware
from exo.shared.types.runners import KVCacheUse
from exo.shared.types.state import State

ErrorResponseFactory = Callable[[str, int, str, str], Response]
"""(request path, HTTP status, OpenAI-style error type, message) -> the dialect's error."""


@dataclass(frozen=True, slots=True)
class ApiSecurity:
    """The node's API keys, client limits, and what the metrics read besides the state.

    Args:
        auth: who may call the API (default: everyone, as in-process test apps need).
        limits: body size, timeouts, connections, generations per client, rate, failed
            keys, trusted proxies.
        master_event_index: the last event index the elected master announced, for the
            replay-lag metric (None: no such metric).
        auth_throttle: the brute-force throttle (None: one with `limits.max_auth_failures`
            and the default policy; tests pass one with their own clock).
    """

    auth: ApiAuth = field(default_factory=ApiAuth.open)
    limits: ApiLimits = field(default_factory=ApiLimits)
    master_event_index: Callable[[], int | None] | None = None
    auth_throttle: AuthThrottle | None = None


def responder(error_response: ErrorResponseFactory) -> ErrorResponder:
    """An `ErrorResponder` from the app's dialect-aware error response factory."""

    def respond(
        path: str, status: int, error_type: str, message: str, headers: Mapping[str, str]
    ) -> ASGIApp:
        response = error_response(path, status, error_type, message)
        for name, value in headers.items():
            response.headers[name] = value
        return response

    return respond


def install_client_guards(
    app: FastAPI, security: ApiSecurity, error_response: ErrorResponseFactory
) -> None:
    """Add the key check (with the brute-force throttle, `app.state.auth_throttle`) and the
    limits; call right after the innermost middleware (the JSON body normalisation), before
    CORS."""
    respond = responder(error_response)
    throttle = security.auth_throttle
    if throttle is None:
        throttle = AuthThrottle(security.limits.max_auth_failures)
    app.state.auth = security.auth
    app.state.auth_throttle = throttle
    app.add_middleware(LimitsMiddleware, limits=security.limits, respond=respond)
    app.add_middleware(AuthMiddleware, auth=security.auth, respond=respond, throttle=throttle)


def install_metrics(
    app: FastAPI,
    security: ApiSecurity,
    current_state: Callable[[], State],
    admission: AdmissionCounts | None = None,
    kv_cache: Callable[[], list[KVCacheUse]] = list,
) -> None:
    """Add the metrics (`app.state.metrics`, served at `GET /metrics`); call after every
    other middleware, so that it runs first. `kv_cache`: this node's runners' KV use."""
    metrics = ApiMetrics(
        current_state,
        security.master_event_index,
        admission,
        kv_cache,
        auth_throttle=getattr(app.state, "auth_throttle", None),
    )
    app.state.metrics = metrics
    flattened: list[BaseRoute] = []

    def routes() -> Sequence[BaseRoute]:
        # Every route is added before the first request; flattened once then.
        if not flattened:
            flattened.extend(fastapi.routing.iter_route_contexts(app.routes))  # type: ignore[arg-type]
        return flattened

    app.add_middleware(MetricsMiddleware, metrics=metrics, routes=routes)


# ------------------------------------------------------------------ node options


@dataclass(frozen=True, slots=True)
class SecurityOptions:
    """The command line's API keys and limits (`add_security_arguments`)."""

    api_keys: tuple[str, ...] = ()
    api_key_file: Path | None = None
    no_auth: bool = False
    limits: ApiLimits = field(default_factory=ApiLimits)


def add_security_arguments(parser: argparse.ArgumentParser) -> None:
    """The API key and client limit flags of `exo`."""
    group = parser.add_argument_group("API keys and limits")
    group.add_argument(
        "--api-key",
        action="append",
        default=[],
        metavar="KEY",
        help="accept this API key, repeatable (default: a generated key, needed off this "
        "machine; env EXO_API_KEY)",
    )
    group.add_argument(
        "--api-key-file",
        type=Path,
        metavar="PATH",
        help="accept the keys in this file, one per line, read again on SIGHUP (default: none)",
    )
    group.add_argument(
        "--no-auth",
        action="store_true",
        help="let anyone who reaches the API use it without a key (default: clients off "
        "this machine need one)",
    )
    group.add_argument(
        "--max-body-size",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="largest request body in bytes, larger gets 413 (default %(default)s: 32 MiB)",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="seconds a connection has to send a request's headers, else 408 (default %(default)s)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="longest pause in seconds while a request body is sent, else 408 (default "
        "%(default)s)",
    )
    group.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help="connections and requests served at once, past it 503 (default %(default)s)",
    )
    group.add_argument(
        "--max-generations-per-client",
        type=int,
        default=DEFAULT_MAX_GENERATIONS_PER_CLIENT,
        metavar="N",
        help="generations one client may run at once, past it 429 (default %(default)s; 0: "
        "no limit)",
    )
    group.add_argument(
        "--rate-limit",
        type=int,
        default=None,
        metavar="N",
        help="requests per minute per client, past it 429 (default: no limit)",
    )
    group.add_argument(
        "--max-auth-failures",
        type=int,
        default=DEFAULT_MAX_AUTH_FAILURES,
        metavar="N",
        help="failed API keys per address in 10 minutes before a 429 lockout (default "
        "%(default)s; 0: none)",
    )
    group.add_argument(
        "--trusted-proxy",
        action="append",
        default=[],
        metavar="ADDRESS",
        help="a reverse proxy (IP or CIDR) whose X-Forwarded-For names the client, "
        "repeatable (default: none)",
    )


def security_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> SecurityOptions:
    """The `SecurityOptions` of parsed arguments; `parser.error` for unusable values."""
    keys = list(args.api_key)
    environment_key = os.environ.get("EXO_API_KEY", "").strip()
    if environment_key:
        keys.append(environment_key)
    try:
        keys = [check_key(key, "API key") for key in keys]
        if args.api_key_file is not None:
            read_key_file(args.api_key_file)
    except KeyFileError as error:
        parser.error(str(error))
    if args.no_auth and (keys or args.api_key_file is not None):
        parser.error("--no-auth cannot be combined with --api-key, --api-key-file or EXO_API_KEY")
    try:
        limits = ApiLimits(
            max_body_bytes=args.max_body_size,
            header_timeout_seconds=args.header_timeout,
            body_timeout_seconds=args.body_timeout,
            max_connections=args.max_connections,
            max_generations_per_client=args.max_generations_per_client,
            rate_limit_per_minute=args.rate_limit,
            max_auth_failures=args.max_auth_failures,
            trusted_proxies=tuple(args.trusted_proxy),
        )
    except ValueError as error:
        parser.error(str(error))
    return SecurityOptions(tuple(keys), args.api_key_file, args.no_auth, limits)


def build_auth(
    options: SecurityOptions, home: Path, node_credential: str
) -> tuple[ApiAuth, str | None]:
    """The node's `ApiAuth`, and its generated key when none was configured (created in
    `home` on first start).

    Raises:
        KeyFileError: a key file (configured or generated) holds no usable key.
    """
    if options.no_auth:
        return ApiAuth.open(), None
    if options.api_keys or options.api_key_file is not None:
        auth = ApiAuth(
            "keys", options.api_keys, options.api_key_file, node_credential=node_credential
        )
        return auth, None
    key, created = load_or_create_key(home)
    if created:
        logger.info(f"created this node's API key in {home / API_KEY_FILE_NAME} (mode 0600)")
    return ApiAuth("generated", (key,), node_credential=node_credential), key


def banner_lines(auth: ApiAuth, generated_key: str | None, home: Path) -> list[str]:
    """The start banner's lines about API keys (a configured key is never shown)."""
    if auth.mode == "open":
        return ["  [bold red]auth      OFF (--no-auth): anyone who reaches this port may use "
                "and reconfigure the cluster[/]"]  # fmt: skip
    if generated_key is not None:
        return [
            f"  API key   {generated_key}",
            f"            required from clients not on this machine "
            f"(kept in {home / API_KEY_FILE_NAME})",
        ]
    return [f"  API keys  {auth.describe()}"]


async def reload_keys_on_sighup(auth: ApiAuth) -> None:
    """Read the key file again on every SIGHUP (`ApiAuth.reload`)."""
    with anyio.open_signal_receiver(signal.SIGHUP) as signals:
        async for _ in signals:
            auth.reload()
