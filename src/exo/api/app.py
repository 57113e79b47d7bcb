"""The FastAPI application: routers plus error handlers that answer in each dialect's shape
(OpenAI's unless a dialect's `ErrorDialect` claims the path)."""

from __future__ import annotations

import json
from types import ModuleType

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api.cluster import ClusterClient, CommandTimeoutError
from exo.api.errors import (
    OPENAI_ERRORS,
    ApiError,
    ErrorDialect,
    describe_validation_errors,
    error_type_for_status,
)
from exo.api.routes import chat, cluster
from exo.api.routes import claude_messages as claude_messages_routes
from exo.api.routes import ollama as ollama_routes
from exo.api.routes import openai_responses as responses_routes

# One line per route module: each has a `router`; a dialect whose errors are not shaped like
# OpenAI's also has an `ERROR_DIALECT`.
ROUTE_MODULES: tuple[ModuleType, ...] = (
    chat,
    cluster,
    claude_messages_routes,
    responses_routes,
    ollama_routes,
)


def error_dialect_for(path: str) -> ErrorDialect:
    """The error shape of the route at `path` (OpenAI's unless a dialect claims it)."""
    for module in ROUTE_MODULES:
        dialect: ErrorDialect | None = getattr(module, "ERROR_DIALECT", None)
        if dialect is not None and dialect.matches(path):
            return dialect
    return OPENAI_ERRORS


def _error_response(
    request: Request,
    status_code: int,
    error_type: str,
    message: str,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    dialect = error_dialect_for(request.url.path)
    body = dialect.render(status_code, error_type, message, param, code)
    # default=str: pydantic error contexts may hold exceptions or other non-JSON values.
    return JSONResponse(json.loads(json.dumps(body, default=str)), status_code=status_code)


class JsonBodyMiddleware:
    """Read every request body as JSON, whatever its content type says.

    `curl -d '{...}'` sends `application/x-www-form-urlencoded`, and Ollama's own examples
    are written that way (Ollama ignores the content type); FastAPI would refuse such a
    body as "not an object". Bodies that are not JSON still get the usual 400.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") in ("POST", "PUT", "PATCH"):
            headers = [(name, value) for name, value in scope["headers"] if name != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        await self.app(scope, receive, send)


def create_app(cluster_client: ClusterClient) -> FastAPI:
    app = FastAPI(title="exo", version="0.1.0")
    app.add_middleware(JsonBodyMiddleware)
    app.state.cluster = cluster_client
    for module in ROUTE_MODULES:
        app.include_router(module.router)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return _error_response(
            request, error.status_code, error.error_type, error.message, error.param, error.code
        )

    @app.exception_handler(CommandTimeoutError)
    async def _timeout(request: Request, error: CommandTimeoutError) -> JSONResponse:
        return _error_response(request, 503, "service_unavailable_error", str(error))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            # A body that is not JSON at all is a 400 (OpenAI's answer); a schema mismatch 422.
            detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
            return _error_response(
                request,
                400,
                "invalid_request_error",
                f"the request body is not valid JSON: {detail}",
            )
        message, param = describe_validation_errors(errors)
        status = error_dialect_for(request.url.path).validation_status
        return _error_response(request, status, "invalid_request_error", message, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        return _error_response(
            request, error.status_code, error_type_for_status(error.status_code), str(error.detail)
        )

    return app
