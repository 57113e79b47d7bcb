"""Dashboard sessions: `POST /auth/session {"api_key"}` checks the key and sets the session
cookie (HttpOnly, SameSite=Strict: an `EventSource` sends it, page scripts cannot read it,
other sites cannot make the browser send it); `DELETE /auth/session` clears it.
A key that is not valid counts against the client's address like one in a header
(`exo.api.guards.throttle`); a locked-out address gets 429 before this route runs.

The cookie holds an HMAC of the key with the node's session secret (`exo.api.guards.auth`), never
the key; it stops working when the key is revoked. Both routes need no key themselves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, SecretStr

from exo.api.guards.auth import SESSION_COOKIE, SESSION_PATH, ApiAuth
from exo.api.guards.throttle import AuthThrottle
from exo.api.wire.errors import ApiError

router = APIRouter()
SESSION_MAX_AGE_SECONDS = 30 * 24 * 3600
"""A browser keeps the session 30 days (revoking its key ends it at once)."""


class InvalidApiKeyError(ApiError):
    status_code = 401
    error_type = "authentication_error"


class SessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    api_key: SecretStr
    """SecretStr: the key never shows in a repr or a log line."""


@router.post(SESSION_PATH, status_code=204, response_class=Response)
async def sign_in(body: SessionRequest, request: Request) -> Response:
    """Set the session cookie for a valid key (204); 401 for a key that is not valid. With
    `--no-auth` nothing needs a key and no cookie is set."""
    auth: ApiAuth | None = getattr(request.app.state, "auth", None)
    response = Response(status_code=204)
    if auth is None or auth.mode == "open":
        return response
    cookie = auth.session_cookie(body.api_key.get_secret_value())
    if cookie is None:
        throttle: AuthThrottle | None = getattr(request.app.state, "auth_throttle", None)
        host = request.client.host if request.client else None
        if throttle is not None and auth.guesses_matter(host):
            throttle.record_failure(host)
        raise InvalidApiKeyError("the API key is not valid")
    response.set_cookie(
        SESSION_COOKIE,
        cookie,
        max_age=SESSION_MAX_AGE_SECONDS,
        path="/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


@router.delete(SESSION_PATH, status_code=204, response_class=Response)
async def sign_out(request: Request) -> Response:
    """Clear the session cookie (204)."""
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response
