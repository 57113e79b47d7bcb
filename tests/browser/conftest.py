"""Fixtures of the dashboard's browser tests: one real node for all of them, Debian's
chromium driven by Playwright, pages that fail their test on any console error, and
screenshots (desktop and phone) under the pytest tmp dir.

Playwright must never download a browser (`playwright install`): it drives the chromium
at `CHROMIUM` (Debian's package; `.ci/run` installs it with apt-get). Without it the
browser tests are skipped, with the reason in the report's header, except under
`CI=true`, where they fail.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from exo.testing.builders import make_node_speed
from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, seed_speed_cache, wait_until

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

    from tests.browser.dashboard_pages import DashboardPage

CHROMIUM = os.environ.get("EXO_TEST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--headless",
    "--no-sandbox",  # tests run as root in CI, where chromium's sandbox refuses to start
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
DESKTOP = {"width": 1280, "height": 900}
PHONE = {"width": 390, "height": 844}
# The machine is slow and busy while tests run in parallel; the page itself answers in ms.
PAGE_TIMEOUT_MS = 30_000
MODEL_READY_TIMEOUT_SECONDS = 300.0


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None when they can."""
    if shutil.which(CHROMIUM) is None:
        return (
            f"{CHROMIUM} is missing: install Debian's chromium "
            "(apt-get install --no-install-recommends chromium) to run the browser tests"
        )
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[test]'"
    return None


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def pytest_report_header(config: pytest.Config) -> str:
    reason = chromium_missing()
    if reason is None:
        return f"dashboard browser tests: {CHROMIUM}"
    return f"dashboard browser tests: {'FAIL' if in_ci() else 'skipped'}: {reason}"


@pytest.fixture(scope="session")
def browser() -> Iterator[Browser]:
    """Debian's chromium, headless, with a fresh profile (Playwright gives every launch
    its own temporary user-data-dir and removes it at close)."""
    reason = chromium_missing()
    if reason is not None:
        if in_ci():
            pytest.fail(f"CI=true and the browser tests cannot run: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS)
        )
        try:
            yield chromium
        finally:
            chromium.close()


@pytest.fixture(scope="session")
def dashboard_node(
    tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path
) -> Iterator[ExoNode]:
    """One node for every browser test, with the default model placed and ready. Its
    models directory is the default node's, so nothing is converted again. It reports a
    speed (settled figures written to its probe cache: on a machine busy with tests a
    measurement never settles), so its previews predict decode rates and TTFT."""
    home = tmp_path_factory.mktemp("exo-dashboard")
    speed_cache = home / "speed_probe.json"
    seed_speed_cache(speed_cache, make_node_speed(threads=2))
    node = ExoNode(
        home,
        models_dir=shared_models_dir,
        env={"EXO_SPEED_PROBE": "1", "EXO_SPEED_PROBE_CACHE": str(speed_cache)},
    )
    node.start()
    try:
        node.wait_ready(timeout=MODEL_READY_TIMEOUT_SECONDS)
        yield node
    finally:
        node.stop()


@pytest.fixture
def dashboard(browser: Browser, dashboard_node: ExoNode) -> Iterator[DashboardPage]:
    """A desktop page on the dashboard node (`DashboardPage`: it records console errors,
    uncaught exceptions and CSP violations), closed at the end of the test."""
    from tests.browser.dashboard_pages import DashboardPage  # imports playwright

    page = DashboardPage(browser, dashboard_node)
    try:
        yield page
    finally:
        page.close()


@contextmanager
def joined_node(
    dashboard_node: ExoNode, home: Path, models_dir: Path | None = None
) -> Iterator[ExoNode]:
    """A second node in the dashboard node's cluster (no model of its own), stopped at the
    end of the block."""
    node = ExoNode(
        home,
        models_dir=models_dir or dashboard_node.models_dir,
        namespace=dashboard_node.namespace,
        bootstrap=(dashboard_node,),
        extra_args=("--no-default-model",),
    )
    node.start()
    try:
        yield node
    finally:
        node.stop()


def ensure_model_ready(node: ExoNode, model_id: str = DEFAULT_MODEL_ID) -> str:
    """An instance of `model_id` on `node` that serves: the one there, else one placed now.

    Returns:
        Its instance id.
    """
    for instance_id in node.state()["instances"]:
        if node.serving(instance_id) is not None:
            return str(instance_id)
    response = httpx.post(f"{node.url}/place_instance", json={"model_id": model_id}, timeout=60)
    response.raise_for_status()
    instance_id = str(response.json()["instance_id"])
    wait_until(
        lambda: node.serving(instance_id),
        timeout=MODEL_READY_TIMEOUT_SECONDS,
        what=f"instance {instance_id} ready",
    )
    return instance_id


class PageErrors:
    """Console errors, uncaught exceptions and failed requests of the pages of one test."""

    def __init__(self) -> None:
        self.errors: list[str] = []

    def watch(self, page: Page) -> Page:
        page.set_default_timeout(PAGE_TIMEOUT_MS)
        page.on(
            "console",
            lambda message: (
                self.errors.append(f"console.{message.type}: {message.text}")
                if message.type == "error"
                else None
            ),
        )
        page.on("pageerror", lambda error: self.errors.append(f"uncaught: {error}"))
        return page


@pytest.fixture
def page_errors() -> PageErrors:
    """What went wrong in this test's pages; the test fails at its end if anything did
    (a test that provokes an error on purpose empties `page_errors.errors` itself)."""
    return PageErrors()


@pytest.fixture
def new_page(
    browser: Browser, page_errors: PageErrors, request: pytest.FixtureRequest
) -> Iterator[Callable[..., Page]]:
    """Open pages in fresh browser contexts (empty localStorage and cookies).

    Call `new_page()` for a desktop page (1280x900), `new_page(viewport=PHONE)` for a
    phone-sized one, `new_page(color_scheme="dark")`, ...; every context closes at the end.
    """
    contexts: list[Any] = []

    def open_page(viewport: dict[str, int] | None = None, **context_options: Any) -> Page:
        context = browser.new_context(viewport=viewport or DESKTOP, **context_options)  # type: ignore[arg-type]
        contexts.append(context)
        return page_errors.watch(context.new_page())

    yield open_page
    for context in contexts:
        context.close()
    if page_errors.errors:
        pytest.fail(
            f"{request.node.name}: the page reported errors:\n" + "\n".join(page_errors.errors)
        )


@pytest.fixture
def page(new_page: Callable[..., Page]) -> Page:
    """A desktop page (1280x900) whose console errors fail the test."""
    return new_page()


@pytest.fixture
def phone_page(new_page: Callable[..., Page]) -> Page:
    """A phone-sized page (390x844, touch) whose console errors fail the test."""
    return new_page(viewport=PHONE, has_touch=True, is_mobile=True)


_screenshot_dirs: list[Path] = []


@pytest.fixture(scope="session")
def screenshot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("dashboard-screenshots")
    _screenshot_dirs.append(directory)
    return directory


@pytest.fixture
def screenshot(screenshot_dir: Path) -> Callable[[Page, str], list[Path]]:
    """`screenshot(page, name)`: the page as it is now at desktop size and at phone size
    (`<name>-desktop.png`, `<name>-phone.png` in `screenshot_dir`); the page gets its
    own size back afterwards.

    Returns:
        The two files' paths.
    """

    def take(page: Page, name: str) -> list[Path]:
        original = page.viewport_size
        paths = []
        for label, size in (("desktop", DESKTOP), ("phone", PHONE)):
            page.set_viewport_size(size)  # type: ignore[arg-type]
            page.wait_for_timeout(150)  # one layout pass after the resize
            path = screenshot_dir / f"{name}-{label}.png"
            page.screenshot(path=str(path), full_page=True)
            paths.append(path)
        if original is not None:
            page.set_viewport_size(original)
        return paths

    return take


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Say why the browser tests did not run, or where their screenshots went (the pytest
    tmp dir changes every run). The header hook above only runs when pytest is pointed at
    this directory; this one runs whenever these tests were collected."""
    reason = chromium_missing()
    if reason is not None:
        verdict = "FAILED (CI=true)" if in_ci() else "skipped"
        terminalreporter.write_line(f"dashboard browser tests {verdict}: {reason}")
    for directory in _screenshot_dirs:
        found = sorted(directory.glob("*.png"))
        if found:
            terminalreporter.write_line(f"dashboard screenshots: {len(found)} in {directory}")
