"""A second node joining the cluster shows up in the open page without a reload (from the
`/events` stream), with the measured link between the nodes; when it stops, the page
shows it lost or gone, still without a reload."""

from __future__ import annotations

from pathlib import Path

import pytest
from playwright.sync_api import Browser

from exo.testing.processes import ExoNode, wait_until
from tests.browser.conftest import joined_node
from tests.browser.dashboard_pages import DashboardPage


def test_second_node_appears_and_leaves_live(
    browser: Browser,
    dashboard_node: ExoNode,
    tmp_path_factory: pytest.TempPathFactory,
    screenshot_dir: Path,
) -> None:
    dashboard = DashboardPage(browser, dashboard_node)
    try:
        page = dashboard.open("cluster").page
        # A mark that a reload would erase.
        page.evaluate("window.__noReload = true")
        with joined_node(dashboard_node, tmp_path_factory.mktemp("dashboard-second")) as second:
            second_id = second.node_id()
            # First the cluster (the dashboard node's state), then the page, which must
            # follow within seconds.
            wait_until(
                lambda: second_id in dashboard_node.state()["node_info"],
                timeout=90,
                what="the second node in the dashboard node's state",
            )
            node = page.locator(f"svg.topology g.node[data-node-id='{second_id}']")
            node.wait_for(timeout=15_000)
            page.locator(f".node-card[data-node-id='{second_id}']").wait_for()
            # The link between the two is labelled with its measured latency and bandwidth.
            label = page.locator("svg.topology .link-label").first
            label.wait_for(timeout=60_000)
            text = label.text_content() or ""
            assert " ms · " in text and "Mbit/s" in text
            page.screenshot(path=screenshot_dir / "cluster-two-nodes-desktop.png")
        # Stopped: lost (greyed) or removed from the state, either way without a reload.
        page.wait_for_function(
            """id => {
                const g = document.querySelector(`svg.topology g.node[data-node-id='${id}']`);
                return !g || g.classList.contains('lost');
            }""",
            arg=second_id,
            timeout=60_000,
        )
        assert page.evaluate("window.__noReload") is True
        assert dashboard.errors == []
    finally:
        dashboard.close()
