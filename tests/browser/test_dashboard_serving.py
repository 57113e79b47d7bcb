"""What the node serves to a real browser: the page loads under its Content-Security-Policy
with no console error, the browser enforces that policy, and `/events` reaches the page's
`EventSource` as a snapshot and then a patch when the cluster changes."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from playwright.sync_api import Page

from exo.api.routes.dashboard import CONTENT_SECURITY_POLICY
from exo.testing.processes import ExoNode
from exo.testing.tiny_models import save_tiny_checkout
from tests.browser.conftest import PageErrors

LISTEN = """() => {
    window.__events = [];
    const source = new EventSource('/events');
    for (const name of ['snapshot', 'patch']) {
        source.addEventListener(name, (e) => window.__events.push([name, JSON.parse(e.data)]));
    }
    window.__source = source;
}"""


def test_the_page_loads_under_its_policy(
    page: Page, dashboard_node: ExoNode, screenshot: Callable[[Page, str], list[Path]]
) -> None:
    response = page.goto(f"{dashboard_node.url}/")
    assert response is not None and response.status == 200
    assert response.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    page.wait_for_load_state("networkidle")
    assert page.title()
    # Every script and stylesheet came from the node itself and loaded.
    scripts = page.eval_on_selector_all("script[src]", "nodes => nodes.map(n => n.src)")
    assert scripts and all(src.startswith(dashboard_node.url) for src in scripts)
    screenshot(page, "landing")


def test_the_browser_enforces_the_policy(
    page: Page, dashboard_node: ExoNode, page_errors: PageErrors
) -> None:
    page.goto(f"{dashboard_node.url}/")
    page.wait_for_load_state("networkidle")
    outcome = page.evaluate(
        """async () => {
            const violations = [];
            document.addEventListener('securitypolicyviolation',
                (e) => violations.push(e.violatedDirective));
            window.__inline = false;
            const script = document.createElement('script');
            script.textContent = 'window.__inline = true;';
            document.body.appendChild(script);
            const img = document.createElement('div');
            img.innerHTML = '<img src="data:," onerror="window.__inline = true">';
            document.body.appendChild(img);
            const style = document.createElement('style');
            style.textContent = 'body { display: none; }';
            document.head.appendChild(style);
            await new Promise((resolve) => setTimeout(resolve, 300));
            return {
                inline: window.__inline,
                hidden: getComputedStyle(document.body).display === 'none',
                violations,
            };
        }"""
    )
    # (Playwright's own `evaluate` is exempt from the policy, so `eval` cannot be tried
    # from here; what a model's answer could smuggle in is markup, tried below.)
    assert outcome["inline"] is False
    assert outcome["hidden"] is False
    assert {"script-src-elem", "script-src-attr", "style-src-elem"} <= set(outcome["violations"])
    # The refusals are reported on the console: expected here, and only these.
    assert page_errors.errors and all(
        "Content Security Policy" in error for error in page_errors.errors
    ), page_errors.errors
    page_errors.errors.clear()


def test_events_reach_the_page_as_a_snapshot_then_a_patch(
    page: Page, dashboard_node: ExoNode, tmp_path: Path
) -> None:
    page.goto(f"{dashboard_node.url}/")
    page.evaluate(LISTEN)
    page.wait_for_function("() => window.__events.length >= 1")
    [[name, snapshot]] = page.evaluate("window.__events.slice(0, 1)")
    assert name == "snapshot"
    assert set(snapshot["state"]) == set(dashboard_node.state())

    # A change the page must hear of: a model added from a local directory.
    checkout = save_tiny_checkout(tmp_path / "tiny")
    added = httpx.post(
        f"{dashboard_node.url}/models/add", json={"model_id": str(checkout)}, timeout=60
    )
    assert added.status_code == 200, added.text
    model_id = added.json()["model_id"]
    try:
        escaped = model_id.replace("~", "~0").replace("/", "~1")
        page.wait_for_function(
            """path => window.__events.some(([name, data]) => name === 'patch'
                && data.patch.some((op) => op.path === path))""",
            arg=f"/custom_cards/{escaped}",
        )
        events: list[Any] = page.evaluate("window.__events")
        patches = [data for name, data in events if name == "patch"]
        assert all(patch["index"] > snapshot["index"] for patch in patches)
        assert [patch["index"] for patch in patches] == sorted(patch["index"] for patch in patches)
    finally:
        page.evaluate("window.__source.close()")
        httpx.delete(f"{dashboard_node.url}/models/custom/{model_id}", timeout=60)
