"""Ollama's API at the node's root as well as under `/ollama`: Ollama clients are pointed
at a host (`OLLAMA_HOST=http://node:52415`) and call `/api/chat`, `/api/tags`, ... there.

`RootOllamaMiddleware` rewrites `/api` and `/api/...` to `/ollama/api/...` before anything
else sees the request (keys, limits, metrics, errors in Ollama's shape all apply as under
`/ollama`), so both are served by the same routes. `/`, `/v1/...` and every other path are
left alone: `GET /` stays the dashboard for browsers (a `HEAD /` answers 200, as Ollama's
liveness check expects), and the OpenAI routes keep `/v1`.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from exo.api.ollama.routes import PREFIX

ROOT_API_PATH = "/api"


def ollama_path(path: str) -> str | None:
    """The `/ollama` path that serves root `path`, or None when `path` is not Ollama's."""
    if path == ROOT_API_PATH or path.startswith(ROOT_API_PATH + "/"):
        return PREFIX + path
    return None


class RootOllamaMiddleware:
    """Serves `/api/...` as `/ollama/api/...` (see the module docstring)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            path = ollama_path(scope["path"])
            if path is not None:
                raw_path: bytes | None = scope.get("raw_path")
                scope = {
                    **scope,
                    "path": path,
                    "raw_path": PREFIX.encode() + raw_path if raw_path is not None else None,
                }
        await self.app(scope, receive, send)
