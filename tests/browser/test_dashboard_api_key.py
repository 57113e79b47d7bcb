"""A node that requires an API key: the page shows the key screen, refuses a wrong key,
and after the right one (POST /auth/session sets the session cookie) the live stream and
every call work, and the integration snippets carry the key header, which the node takes."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser

from exo.testing.processes import ExoNode, wait_until
from tests.browser.dashboard_pages import DashboardPage

KEY = "dashboard-test-key-0123456789"


@pytest.fixture(scope="module")
def keyed_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    node = ExoNode(
        tmp_path_factory.mktemp("exo-keyed"), extra_args=("--no-default-model", "--api-key", KEY)
    )
    node.launch()
    try:
        wait_until(lambda: keyed_node_id(node), timeout=60, what="the keyed node's API")
        yield node
    finally:
        node.stop()


def test_key_screen_signs_in_and_snippets_carry_the_key(
    browser: Browser, keyed_node: ExoNode, screenshot_dir: Path
) -> None:
    dashboard = DashboardPage(browser, keyed_node)
    try:
        page = dashboard.page
        page.goto(f"{keyed_node.url}/#/integrations")
        page.locator("#key-screen").wait_for()
        page.screenshot(path=screenshot_dir / "key-screen-desktop.png")
        page.fill("#api-key-input", "not-the-key")
        page.press("#api-key-input", "Enter")
        page.locator(".key-error:has-text('not valid')").wait_for()
        page.fill("#api-key-input", KEY)
        page.click("#api-key-submit")
        page.locator("#key-screen").wait_for(state="detached")
        # The EventSource got in with the cookie: live, and the node is in the topology.
        page.locator("#live-indicator:has-text('live')").wait_for()
        dashboard.show("cluster")
        page.locator(f"svg.topology g.node[data-node-id='{keyed_node_id(keyed_node)}']").wait_for()
        dashboard.show("integrations")
        curl = page.locator("[data-snippet='curl'] pre").inner_text()
        header = re.search(r'-H "(Authorization: Bearer \$EXO_API_KEY)"', curl)
        assert header is not None, curl
        assert 'env_key = "EXO_API_KEY"' in page.locator("[data-snippet='codex'] pre").inner_text()
        # The header as the snippet writes it, with the key in EXO_API_KEY, is accepted.
        name, value = header[1].replace("$EXO_API_KEY", KEY).split(": ", 1)
        assert httpx.get(f"{keyed_node.url}/v1/models", headers={name: value}).status_code == 200
        assert httpx.get(f"{keyed_node.url}/v1/models").status_code == 401
        # The only console errors are the browser's reports of the two expected 401s (the
        # first call without a cookie and the wrong key).
        unexpected = [e for e in dashboard.errors if "status of 401" not in e]
        assert unexpected == []
    finally:
        dashboard.close()


def keyed_node_id(node: ExoNode) -> str:
    """The node's id (its own routes need the key too)."""
    answer = httpx.get(f"{node.url}/node_id", headers={"authorization": f"Bearer {KEY}"}, timeout=5)
    answer.raise_for_status()
    return str(answer.json())
