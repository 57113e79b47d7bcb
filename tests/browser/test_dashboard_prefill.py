"""The chat shows a long prompt's prefill progress while the first token is awaited: the
node's prefill comment lines (exactly as `exo.api.wire.openai_sse.prefill_progress_comment`
writes them) become "done / total tokens" and a bar, replaced by the answer when it comes.

The page runs against the real node, but its chat request is answered in the browser by a
stream the test holds open (a `fetch` stand-in installed before the page's scripts run), so
the state between the progress and the first token lasts as long as the test looks at it:
a real prefill would race the assertions. The server side (progress chunks become those
lines, SDKs skip them) is `src/exo/api/tests/test_chat_completions_client.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from exo.api.wire.openai_sse import prefill_progress_comment
from exo.api.wire.stream import Prefilling
from exo.testing.processes import DEFAULT_MODEL_ID
from tests.browser.dashboard_pages import DashboardPage

ANSWER = "Done reading."


def held_chat_stream(lines: list[str]) -> str:
    """An init script: `fetch` of `/v1/chat/completions` answers a stream that sends the
    role chunk and `lines`, then waits for `window.exoTestRelease()` to send `ANSWER`."""
    return """
(() => {
  const realFetch = window.fetch.bind(window);
  let release;
  const released = new Promise((resolve) => { release = resolve; });
  window.exoTestRelease = () => release();
  const chunk = (delta, finish) => "data: " + JSON.stringify({
    id: "chatcmpl-test", object: "chat.completion.chunk", created: 1, model: "m",
    choices: [{ index: 0, delta, finish_reason: finish ?? null }],
  }) + "\\n\\n";
  window.fetch = async (input, init) => {
    const url = typeof input === "string" ? input : input.url;
    if (!url.endsWith("/v1/chat/completions")) return realFetch(input, init);
    const encoder = new TextEncoder();
    const body = new ReadableStream({
      async start(controller) {
        controller.enqueue(encoder.encode(chunk({ role: "assistant", content: "" })));
        for (const line of LINES) controller.enqueue(encoder.encode(line));
        await released;
        controller.enqueue(encoder.encode(chunk({ content: ANSWER })));
        controller.enqueue(encoder.encode(chunk({}, "stop")));
        controller.enqueue(encoder.encode("data: [DONE]\\n\\n"));
        controller.close();
      },
    });
    return new Response(body, { status: 200, headers: { "content-type": "text/event-stream" } });
  };
})();
""".replace("LINES", json.dumps(lines)).replace("ANSWER", json.dumps(ANSWER))


def test_chat_shows_prefill_progress_until_the_first_token(
    dashboard: DashboardPage, screenshot_dir: Path
) -> None:
    lines = [
        prefill_progress_comment(Prefilling(4096, 1024, 1024)),
        ": keep-alive\n\n",
        prefill_progress_comment(Prefilling(4096, 1024, 3072)),
    ]
    dashboard.context.add_init_script(held_chat_stream(lines))
    page = dashboard.open("chat").page
    page.wait_for_selector(f"#chat-model option[value='{DEFAULT_MODEL_ID}']", state="attached")
    page.select_option("#chat-model", DEFAULT_MODEL_ID)
    page.fill("#chat-input", "Summarise this long document.")
    page.press("#chat-input", "Enter")

    reply = page.locator(".message.assistant").last
    progress = reply.locator(".prefill-progress")
    progress.locator(".prefill-text:has-text('3,072 / 4,096')").wait_for()
    assert progress.inner_text().strip() == (
        "Reading the prompt: 3,072 / 4,096 tokens, 1,024 cached (75 %)"
    )
    bar = progress.locator("progress.prefill-bar")
    assert (bar.get_attribute("max"), bar.get_attribute("value")) == ("4096", "3072")
    page.screenshot(path=screenshot_dir / "chat-prefill-progress.png")

    page.evaluate("window.exoTestRelease()")
    reply.locator(f".answer:has-text('{ANSWER}')").wait_for()
    assert progress.count() == 0
    reply.locator(".stats:has-text('TTFT')").wait_for()
    assert dashboard.errors == []
