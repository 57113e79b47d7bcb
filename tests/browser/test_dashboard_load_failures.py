"""The Launch view lists the models that could not load (`State.load_failures`): the model,
the runner's reason, when it failed and what makes the cluster forget it. A real load
failure needs a broken model placed and loaded three times, so `/events` is answered with
a crafted snapshot of the node's own state with failures added."""

from __future__ import annotations

import json
from pathlib import Path

from playwright.sync_api import expect

from tests.browser.dashboard_pages import DashboardPage

BROKEN = "org/broken-model"
REASON = (
    "loading failed: tensor model.layers.0.mlp.up_proj.weight has shape [8, 4], expected [16, 4]"
)
OLDER = "org/older-model"
FAILED_AT = 1_796_000_000.0  # Unix seconds, 2026-11-30


def test_launch_view_lists_models_that_could_not_load(
    dashboard: DashboardPage, screenshot_dir: Path
) -> None:
    node = dashboard.node
    state = node.state()
    state["load_failures"] = {
        OLDER: {"reason": "warm-up failed: bad config", "failed_at": FAILED_AT - 60},
        BROKEN: {"reason": REASON, "failed_at": FAILED_AT},
    }
    snapshot = json.dumps({"index": state["last_event_applied_idx"], "state": state})
    body = f"retry: 60000\n\nevent: snapshot\ndata: {snapshot}\n\n"
    page = dashboard.page
    page.route(
        "**/events",
        lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=body
        ),
    )
    # (Not `open()`: the crafted stream ends at once, so the page never stays "live".)
    page.goto(f"{node.url}/#/launch")
    cards = page.locator("#load-failures .load-failure")
    expect(cards).to_have_count(2)
    # Newest first: the state keeps them oldest first.
    expect(cards.first).to_have_attribute("data-model-id", BROKEN)
    broken = page.locator(f".load-failure[data-model-id='{BROKEN}']")
    expect(broken.locator("h3")).to_contain_text(BROKEN)
    expect(broken.locator(".load-failure-reason")).to_have_text(REASON)
    when = page.evaluate("seconds => new Date(seconds * 1000).toLocaleString()", FAILED_AT)
    expect(broken.locator(".load-failure-time")).to_contain_text(f"Failed {when}")
    refused_until = page.evaluate(
        "seconds => new Date(seconds * 1000).toLocaleTimeString()", FAILED_AT + 300
    )
    expect(broken.locator(".load-failure-time")).to_contain_text(f"until {refused_until}")
    expect(broken.locator(".load-failure-forgotten")).to_contain_text("added again")
    # The model's instances, if any, are listed above as ever.
    expect(page.locator("#instances .instance")).not_to_have_count(0)
    page.screenshot(path=screenshot_dir / "launch-load-failures-desktop.png")
    assert dashboard.errors == []


def test_no_section_without_load_failures(dashboard: DashboardPage) -> None:
    dashboard.open("launch")
    page = dashboard.page
    expect(page.locator("#instances .instance")).not_to_have_count(0)
    expect(page.locator("#load-failures")).to_be_hidden()
    expect(page.locator("#load-failures .load-failure")).to_have_count(0)
    assert dashboard.errors == []
