"""Browser access on one real node: CORS preflights from loopback pages succeed, pages from
elsewhere and requests addressed to a foreign name (DNS rebinding) are refused."""

from __future__ import annotations

import httpx

from exo.testing.processes import ExoNode

PREFLIGHT = {
    "Origin": "http://localhost:3000",
    "Access-Control-Request-Method": "POST",
    "Access-Control-Request-Headers": "authorization,content-type",
}


def test_loopback_page_preflight_and_foreign_names(default_node: ExoNode) -> None:
    url = default_node.url
    preflight = httpx.options(f"{url}/v1/chat/completions", headers=PREFLIGHT)
    assert preflight.status_code == 200, preflight.text
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()

    node_id = httpx.get(f"{url}/node_id", headers={"Origin": "http://127.0.0.1:8080"})
    assert node_id.status_code == 200
    assert node_id.headers["access-control-allow-origin"] == "http://127.0.0.1:8080"

    foreign_page = httpx.options(
        f"{url}/v1/chat/completions", headers={**PREFLIGHT, "Origin": "https://evil.example"}
    )
    assert foreign_page.status_code == 403
    assert "access-control-allow-origin" not in foreign_page.headers

    rebound = httpx.post(f"{url}/v1/messages", json={}, headers={"Host": "evil.example:52415"})
    assert rebound.status_code == 403
    assert rebound.json()["type"] == "error"
    assert rebound.json()["error"]["type"] == "permission_error"
