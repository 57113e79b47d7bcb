"""Every snippet of the Integrations view works against the running node: the values are
read from the rendered page (its own address and the running model's name) and used with
the real clients: the Python snippets run as written (openai, anthropic, ollama), the curl
snippet runs in a shell, Continue's config drives its CLI (when `.ci/run` installed it), and
the settings of tools that cannot run here (the OpenAI JS SDK, Claude Code, Codex, Open WebUI,
the ollama CLI) are used with the client speaking the same API with the same URL, headers and
model. (Open WebUI itself is driven in chromium by the slow `test_open_webui.py`.)"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest
import yaml
from playwright.sync_api import Browser

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode
from tests.browser.dashboard_pages import DashboardPage

CONTINUE = (
    Path(os.environ.get("EXO_AGENT_CLIENTS", Path.home() / ".cache" / "exo-agent-clients"))
    / "node_modules"
    / ".bin"
    / "cn"
)
SNIPPETS = (
    "openai-python",
    "openai-js",
    "anthropic-python",
    "claude-code",
    "codex",
    "opencode",
    "continue",
    "open-webui",
    "ollama-cli",
    "ollama-python",
    "curl",
)


@pytest.fixture(scope="module")
def rendered(
    browser: Browser, dashboard_node: ExoNode, screenshot_dir: Path
) -> Iterator[dict[str, str]]:
    """Each snippet's code as the page shows it."""
    dashboard = DashboardPage(browser, dashboard_node)
    try:
        page = dashboard.open("integrations").page
        page.locator("[data-snippet='curl'] pre").wait_for()
        codes = {
            name: page.locator(f"[data-snippet='{name}'] pre").inner_text() for name in SNIPPETS
        }
        page.screenshot(path=screenshot_dir / "integrations-snippets-desktop.png", full_page=True)
        assert dashboard.errors == []
        yield codes
    finally:
        dashboard.close()


RUNNABLE = ("openai-python", "anthropic-python", "ollama-python", "curl")


@pytest.fixture(scope="module")
def ran(rendered: dict[str, str]) -> dict[str, subprocess.CompletedProcess[str]]:
    """The runnable snippets run as written, all at once (the node batches their requests):
    the Python ones with this Python, curl's in bash."""
    started = {
        name: subprocess.Popen(
            [sys.executable, "-c", rendered[name]]
            if name != "curl"
            else ["bash", "-c", rendered[name]],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in RUNNABLE
    }
    results = {}
    for name, process in started.items():
        try:
            stdout, stderr = process.communicate(timeout=180)
        except subprocess.TimeoutExpired:
            process.kill()
            stdout, stderr = process.communicate()
        results[name] = subprocess.CompletedProcess(
            process.args, process.returncode, stdout, stderr
        )
    return results


def _exports(code: str) -> dict[str, str]:
    """The variables a shell snippet sets (`export NAME="value"` / `NAME="value"` lines)."""
    return {m[1]: m[2] for m in re.finditer(r'^(?:export )?([A-Z_]+)="([^"]*)"$', code, re.M)}


def test_snippets_name_this_node_and_its_model(
    rendered: dict[str, str], dashboard_node: ExoNode
) -> None:
    origin = dashboard_node.url
    for name, code in rendered.items():
        assert origin in code, name
        if name != "ollama-cli":
            assert DEFAULT_MODEL_ID in code, name
    assert f'"{origin}/v1"' in rendered["openai-js"]


@pytest.mark.parametrize("name", ["openai-python", "anthropic-python", "ollama-python"])
def test_python_snippets_run_as_written(
    ran: dict[str, subprocess.CompletedProcess[str]], name: str
) -> None:
    assert ran[name].returncode == 0, ran[name].stderr
    assert ran[name].stdout.strip()


def test_curl_snippet_runs(ran: dict[str, subprocess.CompletedProcess[str]]) -> None:
    assert ran["curl"].returncode == 0, ran["curl"].stderr
    answer = json.loads(ran["curl"].stdout)
    assert answer["model"] == DEFAULT_MODEL_ID and answer["choices"][0]["message"]["content"]


def test_openai_js_settings(rendered: dict[str, str]) -> None:
    # The JS SDK posts to baseURL + "/chat/completions" with a Bearer key.
    code = rendered["openai-js"]
    base_url = re.search(r'baseURL: "([^"]+)"', code)[1]  # type: ignore[index]
    model = re.search(r'model: "([^"]+)"', code)[1]  # type: ignore[index]
    answer = httpx.post(
        f"{base_url}/chat/completions",
        headers={"authorization": "Bearer unused"},
        json={
            "model": model,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 4,
            "temperature": 0,
        },
        timeout=120,
    )
    assert answer.status_code == 200 and answer.json()["model"] == model


def test_claude_code_settings(rendered: dict[str, str]) -> None:
    env = _exports(rendered["claude-code"])
    # Claude Code sends ANTHROPIC_AUTH_TOKEN as a Bearer token to ANTHROPIC_BASE_URL.
    client = anthropic.Anthropic(
        base_url=env["ANTHROPIC_BASE_URL"], auth_token=env["ANTHROPIC_AUTH_TOKEN"], api_key=None
    )
    for model in (env["ANTHROPIC_MODEL"], env["ANTHROPIC_DEFAULT_HAIKU_MODEL"]):
        reply = client.messages.create(
            model=model, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
        assert reply.content and reply.model == DEFAULT_MODEL_ID


def test_codex_settings(rendered: dict[str, str]) -> None:
    config = tomllib.loads(rendered["codex"])
    provider = config["model_providers"][config["model_provider"]]
    assert provider["wire_api"] == "responses"
    client = openai.OpenAI(
        base_url=provider["base_url"], api_key=os.environ.get(provider.get("env_key", ""), "unused")
    )
    reply = client.responses.create(
        model=config["model"], input="Hi", max_output_tokens=16, temperature=0
    )
    assert reply.output_text


def test_opencode_settings(rendered: dict[str, str]) -> None:
    config = json.loads(rendered["opencode"])
    provider_name, model = config["model"].split("/", 1)
    options = config["provider"][provider_name]["options"]
    # opencode's OpenAI-compatible provider posts to baseURL + "/chat/completions".
    client = openai.OpenAI(base_url=options["baseURL"], api_key="unused")
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0
    )
    assert reply.choices[0].message.content


def test_continue_settings(rendered: dict[str, str], tmp_path: Path) -> None:
    config = yaml.safe_load(rendered["continue"])
    (model,) = config["models"]
    assert model["provider"] == "openai"
    client = openai.OpenAI(base_url=model["apiBase"], api_key="unused")
    reply = client.chat.completions.create(
        model=model["model"], messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert reply.choices[0].message.content is not None
    if not CONTINUE.exists():
        return  # its CLI is installed by .ci/run; the settings were checked with the SDK
    (tmp_path / "config.yaml").write_text(rendered["continue"], encoding="utf-8")
    turn = subprocess.run(
        [str(CONTINUE), "-p", "Say hi", "--config", str(tmp_path / "config.yaml")],
        cwd=tmp_path,
        env={**os.environ, "HOME": str(tmp_path), "CONTINUE_CLI_ENABLE_TELEMETRY": "0"},
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert turn.returncode == 0, turn.stdout + turn.stderr


def test_open_webui_settings(rendered: dict[str, str]) -> None:
    env = _exports(rendered["open-webui"])
    client = openai.OpenAI(base_url=env["OPENAI_API_BASE_URL"], api_key=env["OPENAI_API_KEY"])
    # Open WebUI lists the models first, then chats.
    assert env["DEFAULT_MODELS"] in [m.id for m in client.models.list()]
    reply = client.chat.completions.create(
        model=env["DEFAULT_MODELS"],
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
    )
    assert reply.choices[0].message.content


def test_ollama_cli_settings(rendered: dict[str, str]) -> None:
    first = rendered["ollama-cli"].splitlines()[0]
    words = shlex.split(first)
    host = words[0].removeprefix("OLLAMA_HOST=")
    model = words[3]
    assert words[1:3] == ["ollama", "run"]
    # The Python client reads OLLAMA_HOST as the CLI does (a path after the port is kept).
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import ollama, sys; print(ollama.Client().generate(model=sys.argv[1], prompt='Hi',"
            " options={'num_predict': 4, 'temperature': 0}).response)",
            model,
        ],
        env={**os.environ, "OLLAMA_HOST": host},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert model in [m.model for m in ollama.Client(host=host).list().models]
