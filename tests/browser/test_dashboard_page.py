"""The dashboard in a real headless Chromium against a real node: it loads without console
errors under its CSP, shows the node in the topology, renders model output safely, applies
JSON patches correctly, is usable on a phone, and every view is screenshotted (desktop and
phone, light and dark) into the pytest tmp dir."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from playwright.sync_api import Browser, Route, expect

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from tests.browser.dashboard_pages import PHONE, VIEWS, DashboardPage


@pytest.fixture
def screenshots(screenshot_dir: Path) -> Path:
    """The session's screenshot folder (tests/browser/conftest.py), named in the summary."""
    return screenshot_dir


def test_page_loads_and_shows_the_node(dashboard: DashboardPage, screenshots: Path) -> None:
    dashboard.open("cluster")
    node_id = dashboard.node.node_id()
    page = dashboard.page
    # Marked master once the page has asked the node who the master is (GET /cluster).
    node = page.locator(f"svg.topology g.node.master[data-node-id='{node_id}']")
    node.wait_for()
    text = node.text_content() or ""
    # Name, short id, master mark, memory, CPU, GPU and disk are all in the picture.
    assert "★" in text and node_id[:8] in text
    assert "RAM" in text and "cores" in text and "GPU" in text and "disk" in text
    card = page.locator(f".node-card[data-node-id='{node_id}']")
    card.locator(".badge-master").wait_for()
    # The default model's runner and its status are listed on the node.
    card.locator(".runner .runner-status").first.wait_for()
    assert "SmolLM2-135M-Instruct" in (card.locator(".runner-list").text_content() or "")
    for view in VIEWS:
        dashboard.show(view)
        page.wait_for_timeout(300)
        page.screenshot(path=screenshots / f"{view}-desktop.png")
    assert dashboard.errors == []


def test_phone_viewport_and_dark_theme(
    browser: Browser, dashboard_node: ExoNode, screenshots: Path
) -> None:
    phone = DashboardPage(browser, dashboard_node, viewport=PHONE)
    try:
        page = phone.page
        page.emulate_media(color_scheme="dark")
        phone.open("chat")
        # The chat fits the phone's width: input, send button and model picker are visible
        # and inside the viewport, and the page does not scroll sideways.
        for selector in ("#chat-input", "#send-button", "#chat-model", "#attach-button"):
            box = page.locator(selector).bounding_box()
            assert box is not None and box["x"] >= 0 and box["x"] + box["width"] <= PHONE["width"]
        assert page.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]
        background = page.evaluate("getComputedStyle(document.body).backgroundColor")
        assert background == "rgb(15, 18, 23)"  # the dark theme's --bg
        for view in VIEWS:
            phone.show(view)
            page.wait_for_timeout(300)
            page.screenshot(path=screenshots / f"{view}-phone-dark.png")
        # The toggle switches to light and is remembered across a reload.
        page.click("#theme-toggle")
        assert page.evaluate("document.documentElement.dataset.theme") == "light"
        page.reload()
        page.wait_for_selector("#live-indicator:has-text('live')")
        assert (
            page.evaluate("getComputedStyle(document.body).backgroundColor") == "rgb(246, 247, 249)"
        )
        assert phone.errors == []
    finally:
        phone.close()


def _sse(chunks: list[dict[str, Any]]) -> str:
    return "".join(f"data: {json.dumps(chunk)}\n\n" for chunk in chunks) + "data: [DONE]\n\n"


HOSTILE_ANSWER = (
    "Here you go: <script>window.__pwned = 'script'</script>\n\n"
    '<img src="x" onerror="window.__pwned = \'img\'">\n\n'
    "[click](javascript:window.__pwned='link') and ![pic](http://198.51.100.1/track.png)\n\n"
    "```python\nprint('hello')\n```\n"
)


def test_model_html_is_shown_as_text(dashboard: DashboardPage, screenshots: Path) -> None:
    """A crafted streamed answer (the chat request is intercepted: this tests rendering,
    not the model) with a script, an img onerror, a javascript: link, a remote image,
    thinking and a tool call."""
    body = _sse(
        [
            {
                "id": "chatcmpl-test",
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "role": "assistant",
                            "reasoning_content": "Let me think <b>hard</b>.",
                        },
                    }
                ],
            },
            {
                "id": "chatcmpl-test",
                "choices": [{"index": 0, "delta": {"content": HOSTILE_ANSWER}}],
            },
            {
                "id": "chatcmpl-test",
                "choices": [
                    {
                        "index": 0,
                        "delta": {
                            "tool_calls": [
                                {
                                    "index": 0,
                                    "id": "call_1",
                                    "type": "function",
                                    "function": {
                                        "name": "get_weather",
                                        "arguments": '{"city": "Paris"}',
                                    },
                                }
                            ]
                        },
                    }
                ],
            },
            {
                "id": "chatcmpl-test",
                "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
            },
            {
                "id": "chatcmpl-test",
                "choices": [],
                "usage": {"prompt_tokens": 5, "completion_tokens": 40, "total_tokens": 45},
            },
        ]
    )

    def answer(route: Route) -> None:
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=body)

    page = dashboard.page
    page.route("**/v1/chat/completions", answer)
    dashboard.open("chat")
    page.fill("#chat-input", "Say something dangerous")
    page.press("#chat-input", "Enter")
    reply = page.locator(".message.assistant").last
    reply.locator(".stats:has-text('40 tokens')").wait_for()
    page.wait_for_timeout(300)
    answer_box = reply.locator(".answer")
    text = answer_box.inner_text()
    assert "<script>window.__pwned = 'script'</script>" in text
    assert "onerror=" in text
    assert answer_box.locator("script, img, iframe, [onerror], [style]").count() == 0
    assert answer_box.locator("a[href^='javascript']").count() == 0
    assert page.evaluate("window.__pwned") is None
    # The code block is a real <pre><code> with a copy button; thinking and the tool call are
    # collapsed <details>, the thinking's HTML shown as text.
    assert answer_box.locator("pre code").inner_text().strip() == "print('hello')"
    thinking = reply.locator("details.thinking")
    assert thinking.get_attribute("open") is None
    assert "<b>hard</b>" in (thinking.text_content() or "")
    assert "get_weather" in reply.locator("details.tool-call summary").inner_text()
    page.screenshot(path=screenshots / "chat-hostile-answer.png")
    assert dashboard.errors == []


# A 1 x 1 PNG (a red dot), as a file picked in the chat.
DOT_PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"
)


def test_chat_attaches_an_image_for_a_vision_model(
    dashboard: DashboardPage, screenshots: Path
) -> None:
    """The Image button shows only for a model whose card has vision (the catalog answer is
    intercepted to give the served model vision: this tests the page, not a vision model);
    the picture goes out as a data: URL in an `image_url` part after the text."""
    page = dashboard.page
    sent: list[Any] = []

    def vision_catalog(route: Route) -> None:
        response = route.fetch()
        cards = response.json()
        for card in cards:
            if card["model_id"] == DEFAULT_MODEL_ID:
                card["capabilities"] = [*card["capabilities"], "vision"]
        route.fulfill(response=response, json=cards)

    def answer(route: Route) -> None:
        sent.append(route.request.post_data_json)
        chunk = {"id": "chatcmpl-test", "choices": [{"index": 0, "delta": {"content": "A dot."}}]}
        route.fulfill(status=200, headers={"content-type": "text/event-stream"}, body=_sse([chunk]))

    dashboard.open("chat")
    page.wait_for_selector(f"#chat-model option[value='{DEFAULT_MODEL_ID}']", state="attached")
    expect(page.locator("#image-button")).to_be_hidden()
    page.route(lambda url: urlsplit(url).path == "/models", vision_catalog)
    page.route("**/v1/chat/completions", answer)
    page.reload()  # the page asks for the catalog again, now through the route
    dashboard.open("chat")
    page.wait_for_selector(f"#chat-model option[value='{DEFAULT_MODEL_ID}']", state="attached")
    page.select_option("#chat-model", DEFAULT_MODEL_ID)
    expect(page.locator("#image-button")).to_be_visible()
    page.set_input_files(
        "#chat-attach-image",
        files=[{"name": "dot.png", "mimeType": "image/png", "buffer": DOT_PNG}],
    )
    page.locator(".attachment:has-text('dot.png')").wait_for()
    page.fill("#chat-input", "What is this?")
    page.press("#chat-input", "Enter")
    page.locator(".message.assistant .answer:has-text('A dot.')").wait_for()
    data_url = "data:image/png;base64," + base64.b64encode(DOT_PNG).decode()
    assert sent[-1]["messages"][-1]["content"] == [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": data_url}},
    ]
    assert page.locator(".message.user img.attachment-image").get_attribute("src") == data_url
    page.screenshot(path=screenshots / "chat-image.png")
    assert dashboard.errors == []


PATCH_CASES: list[tuple[Any, list[dict[str, Any]], Any]] = [
    # RFC 6902 appendix A, and the escaped keys model ids need.
    ({"foo": "bar"}, [{"op": "add", "path": "/baz", "value": "qux"}], {"foo": "bar", "baz": "qux"}),
    (
        {"foo": ["bar", "baz"]},
        [{"op": "add", "path": "/foo/1", "value": "qux"}],
        {"foo": ["bar", "qux", "baz"]},
    ),
    ({"foo": ["bar"]}, [{"op": "add", "path": "/foo/-", "value": "x"}], {"foo": ["bar", "x"]}),
    ({"baz": "qux", "foo": "bar"}, [{"op": "remove", "path": "/baz"}], {"foo": "bar"}),
    ({"foo": ["bar", "qux", "baz"]}, [{"op": "remove", "path": "/foo/1"}], {"foo": ["bar", "baz"]}),
    (
        {"baz": "qux", "foo": "bar"},
        [{"op": "replace", "path": "/baz", "value": "boo"}],
        {"baz": "boo", "foo": "bar"},
    ),
    (
        {"foo": {"bar": "baz", "waldo": "fred"}, "qux": {"corge": "grault"}},
        [{"op": "move", "from": "/foo/waldo", "path": "/qux/thud"}],
        {"foo": {"bar": "baz"}, "qux": {"corge": "grault", "thud": "fred"}},
    ),
    (
        {"foo": ["all", "grass", "cows", "eat"]},
        [{"op": "move", "from": "/foo/1", "path": "/foo/3"}],
        {"foo": ["all", "cows", "eat", "grass"]},
    ),
    (
        {"a": {"b": [1]}},
        [{"op": "copy", "from": "/a", "path": "/c"}],
        {"a": {"b": [1]}, "c": {"b": [1]}},
    ),
    (
        {"baz": "qux", "foo": ["a", 2, "c"]},
        [
            {"op": "test", "path": "/baz", "value": "qux"},
            {"op": "test", "path": "/foo/1", "value": 2},
        ],
        {"baz": "qux", "foo": ["a", 2, "c"]},
    ),
    (
        {"d": {}},
        [
            {"op": "add", "path": "/d/Org~1Model", "value": 1},
            {"op": "add", "path": "/d/a~0b", "value": 2},
        ],
        {"d": {"Org/Model": 1, "a~b": 2}},
    ),
    ({"x": 1}, [{"op": "replace", "path": "", "value": [1]}], [1]),
]
PATCH_FAILURES: list[tuple[Any, list[dict[str, Any]]]] = [
    ({"baz": "qux"}, [{"op": "test", "path": "/baz", "value": "bar"}]),
    ({"foo": "bar"}, [{"op": "add", "path": "/baz/bat", "value": "qux"}]),
    ({"foo": "bar"}, [{"op": "remove", "path": "/nothing"}]),
    ({"foo": "bar"}, [{"op": "replace", "path": "/nothing", "value": 1}]),
    ({"foo": [1]}, [{"op": "add", "path": "/foo/5", "value": 1}]),
    ({"a": {"b": 1}}, [{"op": "move", "from": "/a", "path": "/a/c"}]),
]


def test_json_patch_applier(dashboard: DashboardPage) -> None:
    dashboard.open("cluster")
    results = dashboard.page.evaluate(
        """async ([cases, failures]) => {
            const { applyPatch } = await import('/static/js/jsonpatch.js');
            const ok = cases.map(([doc, ops]) => applyPatch(doc, ops));
            const failed = failures.map(([doc, ops]) => {
                try { applyPatch(doc, ops); return null; } catch (e) { return e.message; }
            });
            return [ok, failed];
        }""",
        [[[doc, ops] for doc, ops, _ in PATCH_CASES], PATCH_FAILURES],
    )
    assert results[0] == [expected for _, _, expected in PATCH_CASES]
    assert all(message is not None for message in results[1]), results[1]


def test_models_catalog_filters_and_downloads(dashboard: DashboardPage, screenshots: Path) -> None:
    page = dashboard.open("models").page
    rows = page.locator("#model-table tbody tr")
    rows.first.wait_for()
    total = rows.count()
    assert total >= 30
    page.fill("#model-search", "qwen3")
    ids = [rows.nth(i).get_attribute("data-model-id") or "" for i in range(rows.count())]
    assert ids and all("qwen3" in model_id.lower() for model_id in ids)
    page.fill("#model-search", "")
    page.check("#cap-thinking")
    page.check("#cap-tools")
    with_both = [rows.nth(i).inner_text() for i in range(rows.count())]
    assert with_both and all("thinking" in r and "tools" in r for r in with_both)
    page.uncheck("#cap-thinking")
    page.uncheck("#cap-tools")
    # "Fits this cluster" asks the node's placement previews: the 70B models do not fit on
    # this machine, the default model does.
    page.check("#model-fits")
    page.locator("#model-count:not(:has-text('checking'))").wait_for()
    fitting = {rows.nth(i).get_attribute("data-model-id") for i in range(rows.count())}
    assert DEFAULT_MODEL_ID in fitting
    assert "meta-llama/Llama-3.1-70B-Instruct" not in fitting
    page.uncheck("#model-fits")
    # Which node holds the default model.
    page.check("#model-downloaded")
    row = page.locator(f"tr[data-model-id='{DEFAULT_MODEL_ID}']")
    assert row.locator(".download[data-kind='DownloadCompleted']").count() >= 1
    assert row.locator(".delete-download").count() == 1
    page.screenshot(path=screenshots / "models-downloaded-desktop.png")
    assert dashboard.errors == []


def test_models_vision_filter_keeps_the_vision_cards(dashboard: DashboardPage) -> None:
    """The "vision" capability box shows exactly the cards that have it (Gemma 3 4B+,
    Qwen-VL, SmolVLM, Mistral Small 3.1), not the text-only default model nor an
    embedding model, and unchecking it shows the whole catalog again."""
    page = dashboard.open("models").page
    rows = page.locator("#model-table tbody tr")
    rows.first.wait_for()
    total = rows.count()
    cards = httpx.get(f"{dashboard.node.url}/models", timeout=30).json()
    expected = {card["model_id"] for card in cards if "vision" in card["capabilities"]}
    assert "google/gemma-3-4b-it" in expected
    page.check("#cap-vision")
    expect(rows).to_have_count(len(expected))
    shown = {rows.nth(i).get_attribute("data-model-id") for i in range(rows.count())}
    assert shown == expected
    assert all("vision" in rows.nth(i).inner_text() for i in range(rows.count()))
    assert DEFAULT_MODEL_ID not in shown and "nomic-ai/nomic-embed-text-v1.5" not in shown
    page.uncheck("#cap-vision")
    expect(rows).to_have_count(total)
    assert dashboard.errors == []


def test_impossible_placement_says_why(dashboard: DashboardPage) -> None:
    model = "meta-llama/Llama-3.1-70B-Instruct"
    page = dashboard.open(f"launch/{model}").page
    page.locator(
        ".preview[data-sharding='pipeline'][data-node-count='1'] .preview-error"
    ).wait_for()
    page.select_option("#launch-sharding", "pipeline")
    page.select_option("#launch-nodes", "1")
    verdict = page.locator("#launch-verdict")
    assert verdict.inner_text().startswith("Impossible: ")
    assert "MiB" in verdict.inner_text()
    assert page.locator("#launch-button").is_disabled()
    assert dashboard.errors == []


def test_download_progress_and_runner_states_render(
    dashboard: DashboardPage, screenshots: Path
) -> None:
    """The page's rendering of states this machine cannot produce on demand (a Hub download
    in flight, a failed runner): `/events` is answered with a crafted snapshot."""
    node = dashboard.node
    state = node.state()
    node_id = node.node_id()
    state["downloads"].setdefault(node_id, {})["Qwen/Qwen3-0.6B"] = {
        "kind": "DownloadOngoing",
        "message": "",
        "progress": {
            "downloaded_bytes": 300_000_000,
            "total_bytes": 1_200_000_000,
            "speed_bytes_per_second": 25_000_000,
            "eta_seconds": 36,
            "files": [],
            "complete": False,
        },
    }
    [runner_id] = list(state["runners"])[:1]
    state["runners"][runner_id] = {"kind": "RunnerFailed", "error_message": "out of memory"}
    snapshot = json.dumps({"index": state["last_event_applied_idx"], "state": state})
    body = f"retry: 60000\n\nevent: snapshot\ndata: {snapshot}\n\n"
    dashboard.page.route(
        "**/events",
        lambda route: route.fulfill(
            status=200, headers={"content-type": "text/event-stream"}, body=body
        ),
    )
    # (Not `open()`: the crafted stream ends at once, so the page never stays "live".)
    page = dashboard.page
    page.goto(f"{node.url}/#/models")
    row = page.locator("tr[data-model-id='Qwen/Qwen3-0.6B']")
    row.locator(".download[data-kind='DownloadOngoing'] [role='progressbar']").wait_for()
    # The crafted stream ends at once, so the page reconnects and redraws the table while
    # the test reads it: the checks wait for their condition (Playwright's expect).
    cell = row.locator(".download-cell")
    for fragment in ("300 MB of 1.2 GB", "25.0 MB/s", "36 s left"):
        expect(cell).to_contain_text(fragment)
    expect(row.locator(".cancel-download")).to_have_count(1)
    expect(row.locator("[role='progressbar']")).to_have_attribute("aria-valuenow", "25")
    page.screenshot(path=screenshots / "models-downloading-desktop.png")
    dashboard.show("launch")
    failed = page.locator(f".instance [data-runner-id='{runner_id}']")
    expect(failed).to_contain_text("failed")
    expect(failed).to_contain_text("out of memory")
    expect(page.locator(".instance[data-status='failed']")).not_to_have_count(0)
    assert dashboard.errors == []
