"""Dashboard sessions: `POST /auth/session {"api_key"}` checks the key and sets the session
cookie (HttpOnly, SameSite=Strict: an `EventSource` sends it, page scripts cannot read it,
other sites cannot make the browser send it); `DELETE /auth/session` ends the session on the
node (replaying its cookie is then a 401) and clears the cookie.
A key that is not valid counts against the client's address like one in a header
(`exo.api.guards.throttle`); a locked-out address gets 429 before this route runs.

The cookie holds a random session id the node keeps (`exo.api.guards.sessions`), never the
key; it stops working on sign-out, when the key is revoked, after 30 days, and when the
node restarts. Both routes need no key themselves.
"""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from pydantic import BaseModel, ConfigDict, SecretStr

from exo.api.guards.auth import SESSION_COOKIE, SESSION_PATH, ApiAuth, Credentials
from exo.api.guards.sessions import SESSION_MAX_AGE_SECONDS
from exo.api.guards.throttle import AuthThrottle
from exo.api.wire.errors import ApiError

router = APIRouter()


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
            throttle.record_failure(host, body.api_key.get_secret_value())
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
    """End the session of the request's cookie, if any, on the node and clear the cookie
    (204, whether or not the session was open)."""
    auth: ApiAuth | None = getattr(request.app.state, "auth", None)
    session = Credentials.from_headers(request.scope["headers"]).session
    if auth is not None and session is not None:
        auth.end_session(session)
    response = Response(status_code=204)
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict")
    return response
