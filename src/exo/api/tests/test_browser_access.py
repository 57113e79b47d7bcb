"""CORS for browser clients and the `Host` check against DNS rebinding: the pure decisions,
then the application answering preflights and refusals in each dialect's shape."""

from __future__ import annotations

from collections.abc import Iterator
from typing import cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.guards.browser_access import (
    BrowserAccess,
    host_name,
    parse_cors_origins,
    this_machine_names,
)
from exo.api.serving.cluster_client import ClusterClient

NODE = BrowserAccess(host_names=this_machine_names("studio"))
PREFLIGHT = {
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_cors_origins_are_parsed_and_normalised() -> None:
    assert parse_cors_origins("") == ()
    assert parse_cors_origins(" https://Chat.Example.com/ , http://10.0.0.2:3000,*") == (
        "https://chat.example.com",
        "http://10.0.0.2:3000",
        "*",
    )
    assert parse_cors_origins("http://a.test,http://a.test") == ("http://a.test",)


@pytest.mark.parametrize(
    "entry", ["chat.example.com", "http://", "https://x.test/path", "http://x.test:99999"]
)
def test_malformed_cors_origin_is_refused(entry: str) -> None:
    with pytest.raises(ValueError, match="CORS origin"):
        parse_cors_origins(entry)


@pytest.mark.parametrize(
    ("header", "name"),
    [
        ("localhost:52415", "localhost"),
        ("[::1]:52415", "::1"),
        ("[fe80::1]", "fe80::1"),
        ("Studio.Local.", "studio.local"),
        ("192.168.1.7:80", "192.168.1.7"),
        ("::1", "::1"),
    ],
)
def test_host_name_of_a_header(header: str, name: str) -> None:
    assert host_name(header) == name


@pytest.mark.parametrize(
    "host",
    [
        "localhost",
        "localhost:52415",
        "app.localhost:3000",
        "127.0.0.1:52415",
        "127.0.0.5",
        "[::1]:52415",
        "192.168.1.7:52415",
        "[fe80::1]:52415",
        "studio",
        "STUDIO.local:52415",
        None,
    ],
)
def test_this_nodes_names_and_addresses_are_allowed(host: str | None) -> None:
    assert NODE.host_allowed(host)


@pytest.mark.parametrize(
    "host", ["evil.example.com", "evil.example.com:52415", "studio.evil.com", "localhost.evil"]
)
def test_other_names_are_refused(host: str) -> None:
    assert not NODE.host_allowed(host)


def test_configured_origins_widen_the_names_and_star_allows_all() -> None:
    widened = BrowserAccess(parse_cors_origins("https://exo.home.arpa"), NODE.host_names)
    assert widened.host_allowed("exo.home.arpa:52415")
    assert not widened.host_allowed("evil.example.com")
    assert BrowserAccess(("*",)).host_allowed("anything.example.com")


@pytest.mark.parametrize(
    "origin",
    [
        "http://localhost:3000",
        "https://localhost",
        "http://127.0.0.1:8080",
        "http://[::1]:5173",
    ],
)
def test_loopback_pages_are_allowed_origins(origin: str) -> None:
    assert NODE.origin_allowed(origin, "localhost:52415")


@pytest.mark.parametrize(
    "origin",
    [
        "https://evil.example.com",
        "http://localhost.evil.com",
        "http://127.0.0.1.evil.com",
        "null",
        "http://192.168.1.7:3000",
    ],
)
def test_other_pages_are_not_allowed_origins(origin: str) -> None:
    assert not NODE.origin_allowed(origin, "192.168.1.7:52415")


def test_the_page_the_node_itself_served_is_allowed() -> None:
    assert NODE.origin_allowed("http://192.168.1.7:52415", "192.168.1.7:52415")


# --- the application ------------------------------------------------------------------------


def client(access: BrowserAccess, host: str = "localhost:52415") -> TestClient:
    # No route below reaches the cluster: the answers come from the middleware and the
    # request validation in front of the handlers.
    app = create_app(cast(ClusterClient, object()), access)
    return TestClient(app, base_url=f"http://{host}")


@pytest.fixture(scope="module")
def http() -> Iterator[TestClient]:
    with client(NODE) as test_client:
        yield test_client


@pytest.mark.parametrize(
    "path",
    [
        "/v1/chat/completions",
        "/v1/responses",
        "/v1/messages",
        "/ollama/api/chat",
        "/ollama/v1/chat/completions",
        "/place_instance",
        "/v1/models",
    ],
)
def test_preflight_from_a_loopback_page_succeeds_on_every_route(
    http: TestClient, path: str
) -> None:
    response = http.options(path, headers={"Origin": "http://localhost:3000", **PREFLIGHT})
    assert response.status_code == 200, response.text
    assert response.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "POST" in response.headers["access-control-allow-methods"]
    allowed_headers = response.headers["access-control-allow-headers"].lower()
    assert "authorization" in allowed_headers and "content-type" in allowed_headers


def test_a_loopback_page_reads_answers(http: TestClient) -> None:
    response = http.get("/openapi.json", headers={"Origin": "http://127.0.0.1:5173"})
    assert response.status_code == 200
    assert response.headers["access-control-allow-origin"] == "http://127.0.0.1:5173"


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", {"error"}),
        ("/v1/messages", {"type", "error"}),
        ("/ollama/api/chat", {"error"}),
    ],
)
def test_a_foreign_page_is_refused_even_without_preflight(
    http: TestClient, path: str, shape: set[str]
) -> None:
    # A "simple" cross-origin POST (text/plain) needs no preflight: it must not run.
    preflight = http.options(path, headers={"Origin": "https://evil.example.com", **PREFLIGHT})
    assert preflight.status_code == 403
    assert "access-control-allow-origin" not in preflight.headers
    simple = http.post(
        path,
        content=b'{"model": "m"}',
        headers={"Origin": "https://evil.example.com", "content-type": "text/plain"},
    )
    assert simple.status_code == 403
    assert set(simple.json()) == shape
    assert "--cors-origins" in simple.text


@pytest.mark.parametrize(
    ("path", "shape"),
    [
        ("/v1/chat/completions", {"error"}),
        ("/v1/responses", {"error"}),
        ("/v1/messages", {"type", "error"}),
        ("/ollama/api/chat", {"error"}),
    ],
)
def test_a_rebound_name_is_refused_in_the_dialects_shape(path: str, shape: set[str]) -> None:
    with client(NODE, host="evil.example.com:52415") as rebound:
        response = rebound.post(path, json={"model": "m"})
    assert response.status_code == 403
    assert set(response.json()) == shape
    assert "evil.example.com" in response.text


def test_configured_origin_and_star() -> None:
    origin = "https://chat.example.com"
    with client(BrowserAccess(parse_cors_origins(origin), NODE.host_names)) as widened:
        response = widened.options(
            "/v1/messages",
            headers={
                "Origin": origin,
                "Access-Control-Request-Private-Network": "true",  # Chrome, page to LAN
                **PREFLIGHT,
            },
        )
        assert response.headers["access-control-allow-origin"] == origin
        assert response.headers["access-control-allow-private-network"] == "true"
        other = widened.options(
            "/v1/messages", headers={"Origin": "https://other.example.com", **PREFLIGHT}
        )
        assert other.status_code == 403
    with client(BrowserAccess(("*",)), host="anything.example.com") as everyone:
        response = everyone.options(
            "/v1/chat/completions", headers={"Origin": "https://any.example.com", **PREFLIGHT}
        )
        assert response.status_code == 200
        assert response.headers["access-control-allow-origin"] == "*"


def test_cli_flag_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from exo.node_options import parse_args

    monkeypatch.delenv("EXO_CORS_ORIGINS", raising=False)
    assert parse_args([]).cors_origins == ()
    assert parse_args(["--cors-origins", "https://a.test, *"]).cors_origins == (
        "https://a.test",
        "*",
    )
    monkeypatch.setenv("EXO_CORS_ORIGINS", "http://b.test:8080")
    assert parse_args([]).cors_origins == ("http://b.test:8080",)
    with pytest.raises(SystemExit):
        parse_args(["--cors-origins", "b.test"])
