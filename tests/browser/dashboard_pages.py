"""Helpers for the dashboard's browser tests: open a view of the page and read it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from playwright.sync_api import Browser, ConsoleMessage, Page

from exo.testing.processes import ExoNode

DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
VIEWS = ("cluster", "models", "launch", "chat", "integrations")


class DashboardPage:
    """A browser page on the node's dashboard that records every console error, uncaught
    exception and Content-Security-Policy violation."""

    def __init__(self, browser: Browser, node: ExoNode, viewport: dict[str, int] = DESKTOP):
        self.node = node
        self.context = browser.new_context(viewport=viewport)  # type: ignore[arg-type]
        self.page: Page = self.context.new_page()
        self.errors: list[str] = []
        self.page.on("console", self._on_console)
        self.page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))

    def _on_console(self, message: ConsoleMessage) -> None:
        if message.type == "error":
            self.errors.append(f"console: {message.text}")

    def open(self, view: str = "cluster") -> DashboardPage:
        self.page.goto(f"{self.node.url}/#/{view}")
        self.page.wait_for_selector("#live-indicator:has-text('live')", timeout=30_000)
        return self

    def show(self, view: str) -> None:
        """Switches view in the page (no reload)."""
        self.page.evaluate("view => { location.hash = '#/' + view }", view)
        self.page.wait_for_selector(f"#view-{view}:not([hidden])")

    def close(self) -> None:
        self.context.close()


def wait_for(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls `condition` (every 0.25 s) until truthy; fails after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        result = condition()
        if result:
            return result
        time.sleep(0.25)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
