"""The FastAPI application: routers plus error handlers that answer in each dialect's shape
(OpenAI's unless a dialect's `ErrorDialect` claims the path)."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import Match
from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api.claude_messages import routes as claude_messages_routes
from exo.api.embeddings import routes as embeddings_routes
from exo.api.guards.browser_access import (
    LOOPBACK_ORIGIN_PATTERN,
    BrowserAccess,
    BrowserAccessMiddleware,
)
from exo.api.ollama import file_routes as ollama_files
from exo.api.ollama import routes as ollama_routes
from exo.api.ollama.root_paths import RootOllamaMiddleware
from exo.api.openai_chat import routes as chat
from exo.api.openai_completions import routes as completions
from exo.api.openai_responses import routes as responses_routes
from exo.api.routes import cluster, custom_models, downloads, peer_files, session
from exo.api.routes import dashboard as dashboard_routes
from exo.api.routes import metrics as metrics_routes
from exo.api.routes.head_requests import HeadAsGetMiddleware
from exo.api.security import ApiSecurity, install_client_guards, install_metrics
from exo.api.serving.admission import Admission
from exo.api.serving.cluster_client import ClusterClient, CommandTimeoutError
from exo.api.serving.token_limit import ResponseHeadersMiddleware
from exo.api.wire.errors import (
    OPENAI_ERRORS,
    ApiError,
    ErrorDialect,
    NoCapacityError,
    QueueFullError,
    error_type_for_status,
    without_union_tags,
)
from exo.api.wire.openapi import with_bad_request_responses

# One line per route module: each has a `router`; a dialect whose errors are not shaped like
# OpenAI's (or that words some of them its own way) also has an `ERROR_DIALECT`.
ROUTE_MODULES: tuple[ModuleType, ...] = (
    chat,
    completions,
    cluster,
    custom_models,
    downloads,
    peer_files,
    claude_messages_routes,
    responses_routes,
    ollama_routes,
    ollama_files,
    embeddings_routes,
    metrics_routes,
    session,
)


def error_dialect_for(path: str) -> ErrorDialect:
    """The error shape of the route at `path` (OpenAI's unless a dialect claims it)."""
    for module in ROUTE_MODULES:
        dialect: ErrorDialect | None = getattr(module, "ERROR_DIALECT", None)
        if dialect is not None and dialect.matches(path):
            return dialect
    return OPENAI_ERRORS


def error_response_for_path(
    path: str,
    status_code: int,
    error_type: str,
    message: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """An error response in the shape of the dialect that serves `path`."""
    body = error_dialect_for(path).render(status_code, error_type, message, param, code)
    # default=str: pydantic error contexts may hold exceptions or other non-JSON values.
    return JSONResponse(json.loads(json.dumps(body, default=str)), status_code=status_code)


def _plain_error_response(
    path: str, status_code: int, error_type: str, message: str
) -> JSONResponse:
    return error_response_for_path(path, status_code, error_type, message)


def _refuse(path: str, message: str) -> JSONResponse:
    return error_response_for_path(path, 403, "permission_error", message)


class JsonBodyMiddleware:
    """Read every request body as JSON, whatever its content type says.

    `curl -d '{...}'` sends `application/x-www-form-urlencoded`, and Ollama's own examples
    are written that way (Ollama ignores the content type); FastAPI would refuse such a
    body as "not an object". Bodies that are not JSON still get the usual 400.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH", "DELETE"):
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods some route of `app` takes at the request's path (a 405's `Allow`).
    Starlette's own header names the first route matching the path only, though several
    may share it (`/auth/session` takes POST and DELETE); HEAD wherever GET is, as
    `HeadAsGetMiddleware` serves it."""
    allowed = [
        method
        for method in _METHODS
        if any(
            route.matches({**scope, "method": method})[0] == Match.FULL
            for route in app.router.routes
        )
    ]
    if "GET" in allowed and "HEAD" not in allowed:
        allowed.insert(allowed.index("GET") + 1, "HEAD")
    return allowed


def create_app(
    cluster_client: ClusterClient,
    browser_access: BrowserAccess | None = None,
    admission: Admission | None = None,
    security: ApiSecurity | None = None,
) -> FastAPI:
    """The API application.

    Args:
        cluster_client: what the routes ask the cluster through.
        browser_access: CORS origins and the names requests may address this node by. None:
            loopback origins and no `Host` check (in-process test clients call the server
            `testserver`); the node passes `BrowserAccess` with this machine's names.
        admission: how many generations may be in flight (`--max-queued-requests`); None:
            the defaults of `exo.api.serving.admission`.
        security: API keys, limits on clients, metrics inputs (`exo.api.security`); None:
            no key needed and the default limits.
    """
    app = FastAPI(title="exo", version="0.1.0")
    access = browser_access or BrowserAccess(check_host=False)
    app.add_middleware(JsonBodyMiddleware)
    security = security or ApiSecurity()
    install_client_guards(app, security, _plain_error_response)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(access.extra_origins),
        allow_origin_regex=LOOPBACK_ORIGIN_PATTERN,
        allow_methods=["*"],
        allow_headers=["*"],
        # Chrome asks before a public page (a configured origin) calls a LAN address; only
        # allowed origins ever get this far.
        allow_private_network=True,
    )
    # Added last, so it runs first: a refused request never reaches the CORS answer.
    app.add_middleware(BrowserAccessMiddleware, access=access, refuse=_refuse)
    app.state.cluster = cluster_client
    app.state.admission = admission or Admission()
    for module in ROUTE_MODULES:
        app.include_router(module.router)
    # The page, its files and its live state; browser navigations to unknown paths.
    dashboard_routes.install(app)
    # Added after every other middleware, so it runs first and counts every answer.
    install_metrics(
        app, security, lambda: cluster_client.state, app.state.admission,
        kv_cache=lambda: cluster_client.local_kv_cache(),
    )  # fmt: skip

    # Added last, so they run first: every guard, route and error handler sees a HEAD as
    # the GET it is served as, and a root `/api/...` as the `/ollama/api/...` it is.
    app.add_middleware(ResponseHeadersMiddleware)
    app.add_middleware(HeadAsGetMiddleware)
    app.add_middleware(RootOllamaMiddleware)

    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = with_bad_request_responses(generate_openapi(), error_dialect_for)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        status_code = error.status_code
        if isinstance(error, QueueFullError) and error_dialect_for(request.url.path).name == (
            "anthropic"
        ):
            status_code = 529  # Anthropic's "overloaded", which its clients retry
        response = error_response_for_path(
            request.url.path,
            status_code,
            error.error_type,
            error.message,
            error.param,
            error.code,
        )
        if isinstance(error, NoCapacityError) and error.retry_after_seconds is not None:
            response.headers["Retry-After"] = str(error.retry_after_seconds)
        return response

    @app.exception_handler(CommandTimeoutError)
    async def _timeout(request: Request, error: CommandTimeoutError) -> JSONResponse:
        return error_response_for_path(
            request.url.path, 503, "service_unavailable_error", str(error)
        )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        # A 400, not FastAPI's 422: OpenAI, Anthropic and Ollama all answer a body that is
        # not JSON, or does not match the schema, with 400 (some clients only read 400 as
        # "bad request").
        errors = error.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
            return error_response_for_path(
                request.url.path,
                400,
                "invalid_request_error",
                f"the request body is not valid JSON: {detail}",
            )
        path = request.url.path
        errors = without_union_tags(errors, error.body)
        message, param, code = error_dialect_for(path).describe(path, errors)
        return error_response_for_path(path, 400, "invalid_request_error", message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        response = error_response_for_path(
            request.url.path,
            error.status_code,
            error_type_for_status(error.status_code),
            str(error.detail),
        )
        response.headers.update(error.headers or {})
        if error.status_code == 405:  # RFC 9110: a 405 lists the methods the path takes
            response.headers["Allow"] = ", ".join(allowed_methods(app, request.scope))
        return response

    return app
