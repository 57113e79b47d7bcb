"""Open WebUI 0.12.4 (the pip package, in a virtual environment of its own) in front of a live
node, driven in headless chromium: with its OpenAI connection at the node's `/v1` and its
Ollama connection at the node's root, its model list shows the node's model from both, and a
chat message sent through each gets the node's streamed answer.

The node serves a tiny random-weight model with SmolLM2's tokenizer, marked with the engine's
test seam (`exo.testing.seam`) so that the question gets a chosen reply: the text in the page
is compared with what the node answers for the same message asked directly, and the node's
`/metrics` must have counted Open WebUI's requests on each dialect's route.

Slow (`-m slow`): the environment holds torch with its CUDA libraries (about 7.5 GB). When it
is missing, `.ci/install-open-webui` makes it first (`EXO_OPENWEBUI`, default
`~/.cache/exo-openwebui`); a failed install fails the test with pip's output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect

from exo.testing.ports import free_port
from exo.testing.processes import ExoNode, wait_until
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_model

REPOSITORY = Path(__file__).resolve().parents[2]
INSTALL_SCRIPT = REPOSITORY / ".ci" / "install-open-webui"
OPENWEBUI_VERSION = "0.12.4"
VENV = Path(os.environ.get("EXO_OPENWEBUI", Path.home() / ".cache" / "exo-openwebui"))
SMOLLM2_TOKENIZER = Path.home() / ".cache/exo-test-models/HuggingFaceTB--SmolLM2-135M-Instruct"
# Bounds, not measures: pip fetches ~3 GB of wheels; Open WebUI imports torch and runs its
# database migrations before it answers (over a minute on a loaded 2-core machine).
INSTALL_TIMEOUT_SECONDS = 3600
START_TIMEOUT_SECONDS = 300.0
READY_TIMEOUT_SECONDS = 180.0
# Open WebUI 0.12.4 sends its 36 built-in tools with every chat from its page (about 7k tokens
# with SmolLM2's tokenizer): the model needs a context above that.
CONTEXT = 16_384
ANSWER_TIMEOUT_MS = 120_000
PAGE_TIMEOUT_MS = 60_000
QUESTION = "Tell me about the pineapple."
REPLY = "Pineapples grow on low plants in warm places."
# Each connection's models get a prefix: the node lists one model under the same name on
# both dialects, and Open WebUI keys its models by name, so without prefixes the Ollama entry
# would shadow the OpenAI one.
OPENAI_PREFIX = "exo-openai"
OLLAMA_PREFIX = "exo-ollama"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(INSTALL_TIMEOUT_SECONDS + 900)]


def installed_open_webui() -> Path:
    """The `open-webui` command of `VENV`, installed first by `.ci/install-open-webui` when
    it is not there.

    Raises:
        pytest.fail.Exception: the install failed (pip's output in the message).
    """
    if not (VENV / f"installed-open-webui-{OPENWEBUI_VERSION}").exists():
        done = subprocess.run(
            [str(INSTALL_SCRIPT)],
            env={**os.environ, "EXO_OPENWEBUI": str(VENV)},
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_SECONDS,
        )
        if done.returncode != 0:
            pytest.fail(f"{INSTALL_SCRIPT} failed ({done.returncode}):\n{done.stderr[-4000:]}")
    return VENV / "bin" / "open-webui"


@dataclass(frozen=True)
class Served:
    node: ExoNode
    model: str
    open_webui_url: str


def open_webui_environment(node_url: str, data_dir: Path) -> dict[str, str]:
    """Open WebUI's settings: the two connections, auth off, and what keeps it offline."""
    return {
        "PATH": os.environ["PATH"],
        "HOME": str(data_dir),
        "LANG": "C.UTF-8",
        "DATA_DIR": str(data_dir),
        "WEBUI_AUTH": "False",
        "WEBUI_SECRET_KEY": "exo-open-webui-test-secret",
        "OPENAI_API_BASE_URL": f"{node_url}/v1",
        "OPENAI_API_KEY": "unused",
        "OPENAI_API_CONFIGS": json.dumps({"0": {"prefix_id": OPENAI_PREFIX}}),
        "OLLAMA_BASE_URL": node_url,
        "OLLAMA_API_CONFIGS": json.dumps({"0": {"prefix_id": OLLAMA_PREFIX}}),
        # HF_HUB_OFFLINE=1, no version check, no download of the default embedding model
        # (sentence-transformers/all-MiniLM-L6-v2; its load fails and is logged, and only
        # document retrieval needs it).
        "OFFLINE_MODE": "True",
        "NO_PROXY": "127.0.0.1,localhost",
    }


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, browser: Browser) -> Iterator[Served]:
    if not (SMOLLM2_TOKENIZER / "tokenizer.json").exists():
        pytest.skip("SmolLM2's converted files are not in the test models cache")
    command = installed_open_webui()
    root = tmp_path_factory.mktemp("open-webui")
    model_dir = save_tiny_model(
        root / "tiny-chat", "llama", SMOLLM2_TOKENIZER, n_layers=2,
        max_position_embeddings=CONTEXT,
    )  # fmt: skip
    # Open WebUI's own requests (a chat's title, tags and follow-ups) quote the conversation,
    # so they get the same reply.
    mark_model_dir(model_dir, replies=[("pineapple", REPLY)])
    node = ExoNode(root / "node", extra_args=("--no-default-model",))
    process: subprocess.Popen[bytes] | None = None
    log_path = root / "open-webui.log"
    try:
        node.launch()
        node.wait_api()
        model, _ = node.serve_local_model(model_dir, timeout=READY_TIMEOUT_SECONDS)
        data_dir = root / "open-webui-data"
        data_dir.mkdir()
        port = free_port()
        with log_path.open("wb") as log:
            process = subprocess.Popen(
                [str(command), "serve", "--host", "127.0.0.1", "--port", str(port)],
                cwd=data_dir,
                env=open_webui_environment(node.url, data_dir),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        url = f"http://127.0.0.1:{port}"

        def healthy() -> bool:
            assert process is not None
            if process.poll() is not None:
                raise AssertionError(
                    f"open-webui exited with {process.returncode}:\n{log_path.read_text()[-4000:]}"
                )
            return httpx.get(f"{url}/health", timeout=2).status_code == 200

        wait_until(healthy, timeout=START_TIMEOUT_SECONDS, interval=0.5, what="Open WebUI")
        dismiss_release_notes(browser, url)
        yield Served(node, model, url)
    finally:
        if process is not None and process.poll() is None:
            os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)
        node.stop()


def requests_counted(node: ExoNode, route: str) -> int:
    """`exo_http_requests_total` answered 200 on `route` (a route template), all methods."""
    text = httpx.get(f"{node.url}/metrics", timeout=10).text
    pattern = re.compile(r"^exo_http_requests_total\{([^}]*)\} ([0-9.e+]+)$", re.MULTILINE)
    total = 0.0
    for labels, value in pattern.findall(text):
        if f'route="{route}"' in labels and 'status="200"' in labels:
            total += float(value)
    return int(total)


def direct_answers(node: ExoNode, model: str) -> tuple[str, str]:
    """The node's streamed answers to `QUESTION` asked directly: (Chat Completions, Ollama)."""
    openai_text = ""
    body = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    with httpx.stream("POST", f"{node.url}/v1/chat/completions", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    openai_text += choice["delta"].get("content") or ""
    ollama_text = ""
    with httpx.stream("POST", f"{node.url}/api/chat", json=body, timeout=60) as reply:
        for line in reply.iter_lines():
            if line.strip():
                ollama_text += json.loads(line)["message"]["content"]
    return openai_text, ollama_text


def open_chat(browser: Browser, url: str, errors: list[str]) -> Page:
    """A fresh page (its own context) on Open WebUI's new chat; its console errors and
    uncaught exceptions go to `errors`."""
    page = browser.new_context(viewport={"width": 1280, "height": 900}).new_page()
    page.set_default_timeout(PAGE_TIMEOUT_MS)
    page.on("console", lambda message: _console_error(message, errors))
    page.on("pageerror", lambda error: errors.append(f"uncaught: {error}"))
    page.goto(url)
    page.locator("#chat-input").wait_for()
    return page


def dismiss_release_notes(browser: Browser, url: str) -> None:
    """Open WebUI shows an admin (with auth off, everyone) its release notes until they are
    dismissed once; the dismissal is saved in the user's settings on the server."""
    errors: list[str] = []
    page = open_chat(browser, url, errors)
    try:
        with page.expect_response(lambda response: "/user/settings/update" in response.url):
            page.get_by_role("button", name="Okay, Let's Go!").click()
    finally:
        page.context.close()
    assert errors == []


def _console_error(message: ConsoleMessage, errors: list[str]) -> None:
    if message.type == "error":
        errors.append(f"console: {message.text}")


def listed_models(page: Page) -> set[str]:
    """The model ids Open WebUI's model selector offers (it stays open)."""
    page.locator("#model-selector-model-button").click()
    options = page.locator("#model-selector-list [role=option]")
    expect(options.first).to_be_visible()
    return {
        options.nth(index).get_attribute("data-value") or "" for index in range(options.count())
    }


def choose_model(page: Page, model_id: str) -> None:
    page.locator("#model-selector-model-button").click()
    page.locator(f"#model-selector-list [role=option][data-value='{model_id}']").click()
    expect(page.locator("#model-selector-model-button")).to_have_attribute(
        "aria-label", f"Selected model: {model_id}"
    )


def ask(page: Page, question: str) -> str:
    """Send `question` in the chat box; the assistant's answer once Open WebUI marks it done
    (its actions, regenerate among them, appear then)."""
    page.locator("#chat-input").click()
    page.keyboard.type(question)
    page.locator("#send-message-button").click()
    answer = page.locator("[id^='message-']:has(#response-content-container)").last
    answer.locator(".regenerate-response-button").first.wait_for(
        state="attached", timeout=ANSWER_TIMEOUT_MS
    )
    return answer.locator("#response-content-container").inner_text().strip()


def test_model_list_shows_the_node_model_from_both_connections(
    served: Served, browser: Browser
) -> None:
    errors: list[str] = []
    page = open_chat(browser, served.open_webui_url, errors)
    try:
        # Both connections' lists arrive before the page offers any model.
        listed = listed_models(page)
    finally:
        page.context.close()
    assert listed == {f"{OPENAI_PREFIX}.{served.model}", f"{OLLAMA_PREFIX}.{served.model}"}
    assert errors == []


@pytest.mark.parametrize(
    ("prefix", "route"),
    [(OPENAI_PREFIX, "/v1/chat/completions"), (OLLAMA_PREFIX, "/ollama/api/chat")],
)
def test_a_chat_gets_the_node_answer_through_each_connection(
    served: Served, browser: Browser, prefix: str, route: str
) -> None:
    openai_text, ollama_text = direct_answers(served.node, served.model)
    assert openai_text == ollama_text == REPLY
    before = requests_counted(served.node, route)
    errors: list[str] = []
    page = open_chat(browser, served.open_webui_url, errors)
    try:
        choose_model(page, f"{prefix}.{served.model}")
        assert ask(page, QUESTION) == openai_text
    finally:
        page.context.close()
    assert requests_counted(served.node, route) > before
    assert errors == []
