"""Revocation reaches responses already open (`AuthMiddleware._serve_revocable`): a stream
served to a key ends when a reload removes the key, one served to a dashboard session ends
when the session signs out or its key goes, a response not begun becomes a 401, and a
signed-out session's cookie replayed is a 401.

Found by trial 40: an `/events` stream opened with a key went on streaming the cluster
state after the key was removed and the node got SIGHUP; and `DELETE /auth/session` only
cleared the cookie in the browser, so the same cookie replayed kept working.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import anyio
from starlette.responses import JSONResponse
from starlette.testclient import TestClient
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.guards.auth import SESSION_COOKIE, ApiAuth, AuthMiddleware
from exo.api.security import ApiSecurity
from exo.api.tests.serving import scripted_app
from exo.testing.scripted_cluster import ScriptedCluster

KEY = "test-key-revoked-1a2b3c4d"
KEPT_KEY = "test-key-kept-5e6f7a8b"
DEADLINE_SECONDS = 5.0


def _respond(
    path: str, status: int, error_type: str, message: str, headers: Mapping[str, str]
) -> ASGIApp:
    return JSONResponse({"error": {"type": error_type, "message": message}}, status, headers)


async def _endless_stream(scope: Scope, receive: Receive, send: Send) -> None:
    """A response that never ends by itself (as `/events` between changes)."""
    await send({"type": "http.response.start", "status": 200, "headers": []})
    while True:
        await send({"type": "http.response.body", "body": b"data: {}\n\n", "more_body": True})
        await anyio.sleep(0.01)


async def _never_answers(scope: Scope, receive: Receive, send: Send) -> None:
    """A response that has not begun (a generation waiting for its first token)."""
    await anyio.sleep_forever()


def _scope(headers: list[tuple[bytes, bytes]]) -> Scope:
    return {
        "type": "http", "method": "GET", "path": "/events", "headers": headers,
        "client": ("10.0.0.7", 50000), "query_string": b"",
    }  # fmt: skip


class _Call:
    """One request through `AuthMiddleware`, its sent messages recorded."""

    def __init__(self, app: ASGIApp, auth: ApiAuth, headers: list[tuple[bytes, bytes]]):
        self.middleware = AuthMiddleware(app, auth, _respond)
        self.scope = _scope(headers)
        self.sent: list[Message] = []
        self.done = anyio.Event()

    async def run(self) -> None:
        async def receive() -> Message:
            await anyio.sleep_forever()
            raise AssertionError  # never reached

        async def send(message: Message) -> None:
            self.sent.append(message)

        await self.middleware(self.scope, receive, send)
        self.done.set()

    async def wait_for_body(self) -> None:
        with anyio.fail_after(DEADLINE_SECONDS):
            while not any(m["type"] == "http.response.body" for m in self.sent):
                await anyio.sleep(0.01)


def _bearer(key: str) -> list[tuple[bytes, bytes]]:
    return [(b"authorization", f"Bearer {key}".encode())]


def test_a_stream_of_a_removed_key_ends_and_another_keys_stream_goes_on(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\n{KEPT_KEY}\n")
    auth = ApiAuth("keys", key_file=key_file)
    revoked, kept = (
        _Call(_endless_stream, auth, _bearer(KEY)),
        _Call(_endless_stream, auth, _bearer(KEPT_KEY)),
    )

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(revoked.run)
            group.start_soon(kept.run)
            await revoked.wait_for_body()
            await kept.wait_for_body()
            key_file.write_text(f"{KEPT_KEY}\n")
            auth.reload()
            with anyio.fail_after(DEADLINE_SECONDS):
                await revoked.done.wait()
            await anyio.sleep(0.1)
            assert not kept.done.is_set(), "the stream of a key still valid was ended"
            group.cancel_scope.cancel()

    anyio.run(main)
    assert revoked.sent[0]["status"] == 200
    assert revoked.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_response_not_begun_for_a_removed_key_is_a_401(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\n{KEPT_KEY}\n")
    auth = ApiAuth("keys", key_file=key_file)
    call = _Call(_never_answers, auth, _bearer(KEY))

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(call.run)
            await anyio.sleep(0.05)
            key_file.write_text(f"{KEPT_KEY}\n")
            auth.reload()
            with anyio.fail_after(DEADLINE_SECONDS):
                await call.done.wait()

    anyio.run(main)
    assert call.sent[0]["type"] == "http.response.start" and call.sent[0]["status"] == 401


def test_a_sessions_stream_ends_on_sign_out_and_when_its_key_is_removed(
    tmp_path: Path,
) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"{KEY}\n{KEPT_KEY}\n")
    auth = ApiAuth("keys", key_file=key_file)
    signed_out_cookie, revoked_cookie = auth.session_cookie(KEY), auth.session_cookie(KEY)
    assert signed_out_cookie is not None and revoked_cookie is not None
    signed_out, revoked = (
        _Call(_endless_stream, auth, [(b"cookie", f"{SESSION_COOKIE}={cookie}".encode())])
        for cookie in (signed_out_cookie, revoked_cookie)
    )

    async def main() -> None:
        async with anyio.create_task_group() as group:
            group.start_soon(signed_out.run)
            group.start_soon(revoked.run)
            await signed_out.wait_for_body()
            await revoked.wait_for_body()
            auth.end_session(signed_out_cookie)
            with anyio.fail_after(DEADLINE_SECONDS):
                await signed_out.done.wait()
            assert not revoked.done.is_set(), "another session of the same key was ended"
            key_file.write_text(f"{KEPT_KEY}\n")
            auth.reload()
            with anyio.fail_after(DEADLINE_SECONDS):
                await revoked.done.wait()

    anyio.run(main)
    for call in (signed_out, revoked):
        assert call.sent[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


def test_a_signed_out_sessions_cookie_replayed_is_a_401(tmp_path: Path) -> None:
    auth = ApiAuth("keys", (KEY,))
    client = TestClient(scripted_app(ScriptedCluster(), ApiSecurity(auth=auth)))
    assert client.post("/auth/session", json={"api_key": KEY}).status_code == 204
    cookie = client.cookies[SESSION_COOKIE]
    assert client.get("/state").status_code == 200
    signed_out = client.delete("/auth/session")
    assert signed_out.status_code == 204
    assert SESSION_COOKIE not in client.cookies
    client.cookies.set(SESSION_COOKIE, cookie)  # the cookie captured before, replayed
    assert client.get("/state").status_code == 401
    # Signing in again makes a new session; the old cookie stays dead.
    client.cookies.clear()
    assert client.post("/auth/session", json={"api_key": KEY}).status_code == 204
    assert client.cookies[SESSION_COOKIE] != cookie
    client.cookies.clear()
    assert client.get("/state", headers={"cookie": f"{SESSION_COOKIE}={cookie}"}).status_code == 401
