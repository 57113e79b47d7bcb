"""API keys (`exo.api.guards.auth`): the official clients of every dialect with and without a key
against a real server, the session cookie, key files and the generated key."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
from loguru import logger
from starlette.testclient import TestClient

from exo.api.guards.auth import (
    API_KEY_FILE_NAME,
    SESSION_COOKIE,
    ApiAuth,
    Credentials,
    KeyFileError,
    is_loopback,
    load_or_create_key,
    read_key_file,
)
from exo.api.security import ApiSecurity
from exo.api.tests.serving import scripted_app, serving
from exo.download.peers import PEER_CREDENTIAL_HEADER, peer_credential
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

KEY = "test-key-7f3a9c1e5b2d4680"
OTHER_KEY = "test-key-other-0a1b2c3d"
WRONG_KEY = "test-key-wrong-99887766"
NAMESPACE = "auth-test"
QUESTION = [{"role": "user", "content": "Hi"}]


def keyed_app(*keys: str, mode: str = "keys") -> TestClient:
    auth = ApiAuth(mode, keys, node_credential=peer_credential(NAMESPACE))  # type: ignore[arg-type]
    return TestClient(scripted_app(ScriptedCluster(), ApiSecurity(auth=auth)))


@pytest.fixture
def captured_logs(caplog: pytest.LogCaptureFixture) -> Iterator[list[str]]:
    """Every loguru message (debug included) and every standard-logging record (uvicorn's)."""
    lines: list[str] = []
    sink = logger.add(lambda message: lines.append(str(message)), level="DEBUG")
    caplog.set_level(logging.DEBUG)
    try:
        yield lines
    finally:
        logger.remove(sink)
        lines.extend(record.getMessage() for record in caplog.records)


@pytest.fixture
def server_url() -> Iterator[str]:
    auth = ApiAuth("keys", (KEY,))
    with serving(scripted_app(ScriptedCluster(), ApiSecurity(auth=auth))) as (url, _):
        yield url


def test_openai_client_needs_the_key(server_url: str, captured_logs: list[str]) -> None:
    for key in (WRONG_KEY, "unused"):
        client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as refused:
            client.chat.completions.create(model=SMOLLM2, messages=QUESTION)  # type: ignore[arg-type]
        assert refused.value.status_code == 401
        assert refused.value.response.headers["www-authenticate"].startswith("Bearer")
        error = refused.value.response.json()["error"]
        assert error["type"] == "authentication_error"
        assert "not valid" in error["message"]
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    client = openai.OpenAI(base_url=f"{server_url}/v1", api_key=KEY, max_retries=0)
    completion = client.chat.completions.create(model=SMOLLM2, messages=QUESTION)  # type: ignore[arg-type]
    assert completion.choices[0].message.content == SCRIPTED_ANSWER
    assert [model.id for model in client.models.list()] == [SMOLLM2]
    assert not any(secret in line for line in captured_logs for secret in (KEY, WRONG_KEY))


def test_anthropic_client_needs_the_key(server_url: str, captured_logs: list[str]) -> None:
    client = anthropic.Anthropic(base_url=server_url, api_key=WRONG_KEY, max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client.messages.create(model=SMOLLM2, max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]
    assert refused.value.response.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "the API key is not valid"},
    }
    assert "www-authenticate" in refused.value.response.headers
    # x-api-key (api_key) and Authorization: Bearer (auth_token) both carry it.
    for client in (
        anthropic.Anthropic(base_url=server_url, api_key=KEY, max_retries=0),
        anthropic.Anthropic(base_url=server_url, auth_token=KEY, max_retries=0),
    ):
        message = client.messages.create(model=SMOLLM2, max_tokens=8, messages=QUESTION)  # type: ignore[arg-type]
        assert message.content[0].text == SCRIPTED_ANSWER  # type: ignore[union-attr]
    assert not any(secret in line for line in captured_logs for secret in (KEY, WRONG_KEY))


def test_ollama_client_needs_the_key(server_url: str, captured_logs: list[str]) -> None:
    for headers in ({}, {"Authorization": f"Bearer {WRONG_KEY}"}):
        client = ollama.Client(host=f"{server_url}/ollama", headers=headers)
        with pytest.raises(ollama.ResponseError) as refused:
            client.chat(model=SMOLLM2, messages=QUESTION)
        assert refused.value.status_code == 401
        assert "API key" in refused.value.error
    raw = httpx.get(f"{server_url}/ollama/api/tags")
    assert raw.status_code == 401 and set(raw.json()) == {"error"}
    client = ollama.Client(host=f"{server_url}/ollama", headers={"Authorization": f"Bearer {KEY}"})
    assert client.chat(model=SMOLLM2, messages=QUESTION).message.content == SCRIPTED_ANSWER
    assert [model.model for model in client.list().models]
    assert not any(secret in line for line in captured_logs for secret in (KEY, WRONG_KEY))


def test_every_route_kind_needs_a_key_but_the_page_and_preflights() -> None:
    client = keyed_app(KEY)
    for method, path in (
        ("GET", "/state"),
        ("GET", "/metrics"),
        ("GET", "/events"),
        ("POST", "/place_instance"),
        ("GET", "/openapi.json"),
        ("GET", "/node_id"),
        ("GET", "/no/such/route"),
    ):
        response = client.request(method, path)
        assert response.status_code == 401, (method, path)
        assert response.json()["error"]["type"] == "authentication_error"
    assert client.get("/state", headers={"x-api-key": KEY}).status_code == 200
    assert client.get("/metrics", headers={"authorization": f"bearer {KEY}"}).status_code == 200
    # The page loads so that its key screen can show.
    assert client.get("/").status_code == 200
    preflight = client.options(
        "/v1/chat/completions",
        headers={"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST"},
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    # A page's request refused for its key still tells the page why (CORS headers on the 401).
    refused = client.get("/state", headers={"Origin": "http://localhost:3000"})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == "http://localhost:3000"


def test_node_credential_opens_only_what_nodes_ask_each_other() -> None:
    client = keyed_app(KEY)
    node = {PEER_CREDENTIAL_HEADER: peer_credential(NAMESPACE)}
    assert client.get("/node_id", headers=node).status_code == 200
    assert client.get("/bandwidth_probe?size_bytes=16", headers=node).status_code == 200
    assert client.get("/peer/files/a--b/config.json", headers=node).status_code != 401
    assert client.get("/state", headers=node).status_code == 401
    assert client.post("/v1/chat/completions", headers=node, json={}).status_code == 401
    wrong = {PEER_CREDENTIAL_HEADER: peer_credential("another-cluster")}
    assert client.get("/node_id", headers=wrong).status_code == 401


def test_session_cookie_is_a_random_id_that_dies_with_its_key(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text(f"# dashboard keys\n{KEY}\n\n{OTHER_KEY}\n")
    auth = ApiAuth("keys", key_file=key_file)
    client = TestClient(scripted_app(ScriptedCluster(), ApiSecurity(auth=auth)))
    refused = client.post("/auth/session", json={"api_key": WRONG_KEY})
    assert refused.status_code == 401 and SESSION_COOKIE not in client.cookies
    assert client.post("/auth/session", json={}).status_code == 400
    signed_in = client.post("/auth/session", json={"api_key": KEY})
    assert signed_in.status_code == 204
    cookie_header = signed_in.headers["set-cookie"]
    for attribute in ("HttpOnly", "Path=/", "SameSite=strict"):
        assert attribute.lower() in cookie_header.lower()
    cookie = client.cookies[SESSION_COOKIE]
    assert KEY not in cookie and len(cookie) == 43  # 32 random bytes, URL-safe base64
    assert client.get("/state").status_code == 200  # the cookie alone
    key_file.write_text(f"{OTHER_KEY}\n")  # KEY revoked
    auth.reload()
    assert client.get("/state").status_code == 401
    client.cookies.set(SESSION_COOKIE, cookie)
    signed_out = client.delete("/auth/session")
    assert signed_out.status_code == 204 and "max-age=0" in signed_out.headers["set-cookie"].lower()
    assert client.get("/state", headers={"x-api-key": OTHER_KEY}).status_code == 200


def test_generated_mode_serves_loopback_without_a_key() -> None:
    auth = ApiAuth("generated", (KEY,))
    for host, key, expected in (
        ("127.0.0.1", None, "address:127.0.0.1"),
        ("::1", "unused", "address:::1"),  # loopback is served whatever key it sends
        ("::ffff:127.0.0.1", None, "address:::ffff:127.0.0.1"),
        ("10.0.0.2", None, None),
        ("10.0.0.2", WRONG_KEY, None),
    ):
        credentials = Credentials(keys=(key,) if key else ())
        assert auth.client_identity("GET", "/state", host, credentials) == expected, host
    identity = auth.client_identity("GET", "/state", "192.168.1.9", Credentials(keys=(KEY,)))
    assert identity is not None and identity.startswith("key:") and KEY not in identity
    # The page needs no key from anywhere; its data does.
    assert auth.client_identity("GET", "/", "10.0.0.2", Credentials()) is not None
    keys_mode = ApiAuth("keys", (KEY,))
    assert keys_mode.client_identity("GET", "/state", "127.0.0.1", Credentials()) is None
    assert ApiAuth.open().client_identity("GET", "/state", "10.0.0.2", Credentials()) is not None
    assert is_loopback("127.8.9.10") and not is_loopback("10.0.0.1") and not is_loopback(None)


def test_generated_key_is_private_and_stable(tmp_path: Path) -> None:
    key, created = load_or_create_key(tmp_path)
    path = tmp_path / API_KEY_FILE_NAME
    assert created and key.startswith("exo-") and len(key) > 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert [p.name for p in tmp_path.iterdir()] == [API_KEY_FILE_NAME]  # no temporary left
    assert load_or_create_key(tmp_path) == (key, False)
    path.chmod(0o644)  # loosened by hand: tightened again when read
    assert load_or_create_key(tmp_path) == (key, False)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_text("")
    with pytest.raises(KeyFileError):
        load_or_create_key(tmp_path)


def test_key_file_errors_name_the_line_never_the_key(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY}\nnot a key with spaces\n")
    with pytest.raises(KeyFileError) as error:
        read_key_file(path)
    assert "line 2" in str(error.value) and "spaces" not in str(error.value).split(":", 1)[0]
    assert "not a key" not in str(error.value)
    with pytest.raises(KeyFileError):
        read_key_file(tmp_path / "missing")
    path.write_text("# only a comment\n")
    with pytest.raises(KeyFileError):
        ApiAuth("keys", key_file=path)


def test_reload_keeps_the_keys_when_the_file_is_unreadable(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text(f"{KEY}\n")
    auth = ApiAuth("keys", key_file=path)
    os.remove(path)
    auth.reload()
    assert auth.valid_key(KEY) is not None
    path.write_text(f"{OTHER_KEY}\n")
    auth.reload()
    assert auth.valid_key(KEY) is None and auth.valid_key(OTHER_KEY) is not None


def test_command_line_keys_and_limits(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from exo.node_options import parse_args

    monkeypatch.setenv("EXO_API_KEY", "env-key-123")
    options = parse_args(["--api-key", KEY, "--rate-limit", "30", "--max-body-size", "1024"])
    assert options.security.api_keys == (KEY, "env-key-123")
    assert options.security.limits.rate_limit_per_minute == 30
    assert options.security.limits.max_body_bytes == 1024
    monkeypatch.delenv("EXO_API_KEY")
    assert parse_args([]).security.api_keys == ()
    for argv in (
        ["--no-auth", "--api-key", KEY],
        ["--api-key", "has space"],
        ["--api-key-file", str(tmp_path / "missing")],
        ["--max-connections", "0"],
        ["--header-timeout", "0"],
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
