"""The FastAPI application: routers plus error handlers that answer in OpenAI's shape."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from exo.api.cluster import ClusterClient, CommandTimeoutError
from exo.api.errors import (
    ApiError,
    describe_validation_errors,
    error_type_for_status,
    openai_error_body,
    openai_error_body_for,
)
from exo.api.routes import chat, cluster


def create_app(cluster_client: ClusterClient) -> FastAPI:
    app = FastAPI(title="exo", version="0.1.0")
    app.state.cluster = cluster_client
    app.include_router(chat.router)
    app.include_router(cluster.router)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(openai_error_body_for(error), status_code=error.status_code)

    @app.exception_handler(CommandTimeoutError)
    async def _timeout(request: Request, error: CommandTimeoutError) -> JSONResponse:
        body = openai_error_body(str(error), "service_unavailable_error")
        return JSONResponse(body, status_code=503)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            # A body that is not JSON at all is a 400 (OpenAI's answer); a schema mismatch 422.
            detail = errors[0].get("ctx", {}).get("error", "invalid JSON")
            body = openai_error_body(
                f"the request body is not valid JSON: {detail}", "invalid_request_error"
            )
            return JSONResponse(body, status_code=400)
        message, param = describe_validation_errors(errors)
        body = openai_error_body(message, "invalid_request_error", param, None)
        return JSONResponse(json.loads(json.dumps(body, default=str)), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        body = openai_error_body(str(error.detail), error_type_for_status(error.status_code))
        return JSONResponse(body, status_code=error.status_code)

    return app
