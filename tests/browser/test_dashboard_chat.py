"""The dashboard drives a real node: a model launched from the Launch view reaches ready and
is deleted from it; a chat question gets a streamed answer with TTFT and tok/s; the stop
button (and Esc) cancels a long answer on the cluster and the runner serves the next
request; edit and regenerate resend the conversation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from playwright.sync_api import Page

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until
from tests.browser.dashboard_pages import DashboardPage

LONG_QUESTION = "Write a very long story about a dragon and a knight."


@pytest.fixture
def screenshots(screenshot_dir: Path) -> Path:
    """The session's screenshot folder (tests/browser/conftest.py), named in the summary."""
    return screenshot_dir


def _instance_ids(node: ExoNode) -> set[str]:
    return set(node.state()["instances"])


def test_launch_from_the_page_reaches_ready_then_delete(
    dashboard: DashboardPage, screenshots: Path
) -> None:
    node = dashboard.node
    before = _instance_ids(node)
    page = dashboard.open(f"launch/{DEFAULT_MODEL_ID}").page
    page.wait_for_selector(f"#launch-model option[value='{DEFAULT_MODEL_ID}']", state="attached")
    assert page.input_value("#launch-model") == DEFAULT_MODEL_ID
    page.select_option("#launch-sharding", "pipeline")
    page.select_option("#launch-nodes", "1")
    # The preview of that placement: every layer on this node, with its memory.
    preview = page.locator(".preview[data-sharding='pipeline'][data-node-count='1']")
    preview.wait_for()
    # Its memory (weights and the KV-cache budget sized from the node's memory) in MB or GB.
    assert "layers 0–30" in preview.inner_text()
    assert re.search(r"\d+(\.\d+)? [MG]B", preview.inner_text())
    # Once the node has measured its speed (a few seconds after its start), the preview
    # predicts its decode rate and TTFT.
    prediction = preview.locator(".prediction:has-text('tok/s decode')")
    prediction.wait_for(timeout=60_000)
    assert "TTFT" in prediction.inner_text() and "512-token prompt" in prediction.inner_text()
    # SmolLM2's 9 attention heads cannot be tensor-split over 2 nodes; with one node there
    # is no 2-node preview at all, and the page says why it cannot launch it either way.
    page.locator("#launch-button:not([disabled])").wait_for()
    page.click("#launch-button")
    new_id = wait_until(
        lambda: (_instance_ids(node) - before) or None, timeout=30, what="the new instance"
    )
    [instance_id] = list(new_id)
    card = page.locator(f".instance[data-instance-id='{instance_id}']")
    card.wait_for()
    page.screenshot(path=screenshots / "launch-loading.png")
    card.locator("xpath=self::*[@data-status='ready']").wait_for(timeout=120_000)
    assert "ready" in card.locator(".runner-status").inner_text()
    card.locator(".delete-instance").click()
    card.wait_for(state="detached", timeout=30_000)
    assert instance_id not in _instance_ids(node)
    assert dashboard.errors == []


def _ask(page: Page, question: str) -> None:
    page.fill("#chat-input", question)
    page.press("#chat-input", "Enter")


def _settings(page: Page, max_tokens: int) -> None:
    if page.locator("details.chat-settings[open]").count() == 0:
        page.click("details.chat-settings summary")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", str(max_tokens))
    page.dispatch_event("#chat-max-tokens", "change")


def _cancelled_tasks(node: ExoNode) -> int:
    return sum(
        1
        for event in node.events()
        if event["kind"] == "TaskStatusUpdated" and event["status"]["kind"] == "TaskCancelled"
    )


def test_chat_streams_stops_and_serves_again(dashboard: DashboardPage, screenshots: Path) -> None:
    node = dashboard.node
    page = dashboard.open("chat").page
    page.wait_for_selector(f"#chat-model option[value='{DEFAULT_MODEL_ID}']", state="attached")
    page.select_option("#chat-model", DEFAULT_MODEL_ID)
    _settings(page, 24)
    _ask(page, "What is the capital of France? Answer in one sentence.")
    reply = page.locator(".message.assistant").last
    # Streamed: the stop button shows while tokens arrive, then TTFT and tok/s appear.
    page.locator("#stop-button:not([hidden])").wait_for()
    reply.locator(".stats:has-text('tok/s')").wait_for(timeout=60_000)
    assert "Paris" in reply.locator(".answer").inner_text()
    assert "TTFT" in reply.locator(".stats").inner_text()
    page.screenshot(path=screenshots / "chat-answer.png")

    # A long answer, stopped with Esc after a few words: the node cancels the generation.
    cancelled_before = _cancelled_tasks(node)
    _settings(page, 1500)
    _ask(page, LONG_QUESTION)
    long_reply = page.locator(".message.assistant").last
    wait_until(
        lambda: len(long_reply.locator(".answer").inner_text()) > 40,
        timeout=60,
        what="a few streamed words",
    )
    page.keyboard.press("Escape")
    long_reply.locator(".stats:has-text('stopped')").wait_for(timeout=10_000)
    wait_until(
        lambda: _cancelled_tasks(node) > cancelled_before,
        timeout=30,
        what="the cancelled task in the event log",
    )
    wait_until(lambda: not node.state()["tasks"], timeout=30, what="no task left running")

    # The runner serves the next request; regenerate and edit resend the conversation.
    _settings(page, 8)
    _ask(page, "Say hi.")
    page.locator(".message.assistant").nth(2).locator(".stats:has-text('tokens')").wait_for(
        timeout=60_000
    )
    page.locator(".regenerate-button").click()
    page.locator(".message.assistant").nth(2).locator(".stats:has-text('tokens')").wait_for(
        timeout=60_000
    )
    assert page.locator(".message").count() == 6
    page.locator(".message.user .edit-button").first.click()
    page.fill(".edit-box", "What is the capital of Italy?")
    page.click("text=Save and send")
    page.locator(".message.assistant").first.locator(".stats:has-text('tokens')").wait_for(
        timeout=60_000
    )
    assert page.locator(".message").count() == 2
    assert page.locator(".message.user .user-text").inner_text() == "What is the capital of Italy?"
    # The conversation is kept in localStorage across a reload.
    page.reload()
    page.wait_for_selector(".message.user .user-text:has-text('Italy')")
    assert dashboard.errors == []
