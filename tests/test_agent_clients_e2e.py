"""The real coding agents from npm, on their default settings, against a live node: Claude
Code (`claude -p`), Codex (`codex exec`) and opencode (`opencode run`) each complete a turn
with exit 0, and a tool round trip (the client runs a read-only tool the model called and
sends its result back).

Settings given to each client are only the base URL, the model name, a key where it needs
one and the variables that keep it offline; no tool is disabled and no token limit set.
The node serves a tiny random-weight model with SmolLM2's tokenizer and a 64k context (their
default prompts are 10-20k tokens), marked with the engine's test seam so that chosen
prompts get chosen replies (`exo.testing.seam`).

The clients are installed by `.ci/run` (`npm install --prefix $EXO_AGENT_CLIENTS`, versions
pinned in `AGENT_CLIENTS` there); without them the tests are skipped. Part of the default
run (about two minutes on a quiet 2-core machine, four under heavy contention): they are
the acceptance of the agent clients issue.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from exo.testing.processes import ExoNode
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_models import save_tiny_model

CLIENTS = Path(os.environ.get("EXO_AGENT_CLIENTS", Path.home() / ".cache" / "exo-agent-clients"))
BIN = CLIENTS / "node_modules" / ".bin"
SMOLLM2_TOKENIZER = Path.home() / ".cache/exo-test-models/HuggingFaceTB--SmolLM2-135M-Instruct"
CONTEXT = 65_536
READY_TIMEOUT_SECONDS = 180.0
CLIENT_TIMEOUT_SECONDS = 120
MARKER = "secret-content-42"
MARKER_FILE = "marker-file-result.txt"
OFFLINE = {
    "DISABLE_TELEMETRY": "1",
    "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
    "DISABLE_AUTOUPDATER": "1",
    "OPENCODE_DISABLE_AUTOUPDATE": "1",
    "OPENCODE_DISABLE_SHARE": "1",
}


def _call(name: str, arguments: dict[str, str]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


@dataclass(frozen=True)
class Served:
    url: str
    model: str
    workdir: Path
    home: Path


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    if not BIN.is_dir():
        pytest.skip(f"the agent clients are not installed in {CLIENTS} (.ci/run installs them)")
    if not (SMOLLM2_TOKENIZER / "tokenizer.json").exists():
        pytest.skip("SmolLM2's converted files are not in the test models cache")
    root = tmp_path_factory.mktemp("agents")
    workdir = root / "work"
    workdir.mkdir()
    (workdir / MARKER_FILE).write_text(MARKER + "\n")
    model_dir = save_tiny_model(
        root / "tiny-agent", "llama", SMOLLM2_TOKENIZER, n_layers=2,
        max_position_embeddings=CONTEXT,
    )  # fmt: skip
    # The first rule that matches a prompt decides: a tool's result (in the next request)
    # ends the turn; each client's request asks for a call of one of its read-only tools.
    mark_model_dir(
        model_dir,
        replies=[
            (MARKER, "All read."),
            (MARKER_FILE, "Listed."),
            ("read the marker", _call("Read", {"file_path": str(workdir / MARKER_FILE)})),
            ("run ls now", _call("exec_command", {"cmd": "ls"})),
            # opencode's glob and grep run ripgrep, which it downloads from GitHub: offline,
            # its read tool.
            ("use read now", _call("read", {"filePath": str(workdir / MARKER_FILE)})),
            ("pineapple", "pineapple"),
        ],
    )
    node = ExoNode(root / "node", extra_args=("--no-default-model",))
    try:
        node.launch()
        node.wait_api()
        model, _ = node.serve_local_model(model_dir, timeout=READY_TIMEOUT_SECONDS)
        home = root / "home"
        home.mkdir()
        yield Served(node.url, model, workdir, home)
    finally:
        node.stop()


def _run(served: Served, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run a client in the work directory with a fresh home; a client that loops (a tool
    result the scripted replies do not expect) ends at `CLIENT_TIMEOUT_SECONDS`."""
    environment = {
        "PATH": os.environ["PATH"],
        "HOME": str(served.home),
        "LANG": "C.UTF-8",
        **OFFLINE,
        **env,
    }
    return subprocess.run(
        argv, cwd=served.workdir, env=environment, capture_output=True, text=True,
        timeout=CLIENT_TIMEOUT_SECONDS,
    )  # fmt: skip


# ---------------------------------------------------------------- Claude Code


def _claude(served: Served, prompt: str) -> subprocess.CompletedProcess[str]:
    # The key (ANTHROPIC_AUTH_TOKEN), base URL and model; the node keeps keys off for
    # loopback clients, so any key works.
    env = {
        "ANTHROPIC_BASE_URL": served.url,
        "ANTHROPIC_AUTH_TOKEN": "unused",
        "ANTHROPIC_MODEL": served.model,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": served.model,
    }
    argv = [str(BIN / "claude"), "-p", prompt, "--output-format", "stream-json", "--verbose"]
    return _run(served, argv, env)


def _events(output: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in output.splitlines() if line.startswith("{")]


def test_claude_code_completes_a_turn(served: Served) -> None:
    done = _claude(served, "say pineapple")
    assert done.returncode == 0, done.stderr
    (result,) = [event for event in _events(done.stdout) if event.get("type") == "result"]
    assert result["subtype"] == "success" and result["result"] == "pineapple"


def test_claude_code_runs_a_tool_and_sends_its_result_back(served: Served) -> None:
    done = _claude(served, "read the marker file")
    assert done.returncode == 0, done.stderr
    events = _events(done.stdout)
    contents = [
        block
        for event in events
        if event.get("type") in ("assistant", "user")
        for block in event["message"]["content"]  # type: ignore[index]
    ]
    uses = [block for block in contents if block["type"] == "tool_use"]
    results = [block for block in contents if block["type"] == "tool_result"]
    assert [use["name"] for use in uses] == ["Read"] and uses[0]["id"].startswith("toolu_")
    assert results and MARKER in json.dumps(results[0]["content"])
    (result,) = [event for event in events if event.get("type") == "result"]
    assert result["result"] == "All read."


# ---------------------------------------------------------------- Codex


def _codex(served: Served, prompt: str) -> subprocess.CompletedProcess[str]:
    config = served.home / ".codex" / "config.toml"
    config.parent.mkdir(exist_ok=True)
    config.write_text(
        f'model = "{served.model}"\nmodel_provider = "exo"\n\n[model_providers.exo]\n'
        f'name = "exo"\nbase_url = "{served.url}/v1"\nwire_api = "responses"\n'
    )
    return _run(served, [str(BIN / "codex"), "exec", "--skip-git-repo-check", prompt], {})


def test_codex_completes_a_turn(served: Served) -> None:
    done = _codex(served, "say pineapple")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "pineapple"


def test_codex_runs_a_command_and_sends_its_output_back(served: Served) -> None:
    done = _codex(served, "run ls now")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "Listed.", done.stderr[-2000:]


# ---------------------------------------------------------------- opencode


def _opencode(served: Served, prompt: str) -> subprocess.CompletedProcess[str]:
    provider = {
        "npm": "@ai-sdk/openai-compatible",
        "name": "exo",
        "options": {"baseURL": f"{served.url}/v1"},
        "models": {served.model: {"name": "tiny"}},
    }
    config = {"provider": {"exo": provider}, "model": f"exo/{served.model}"}
    (served.workdir / "opencode.json").write_text(json.dumps(config))
    return _run(served, [str(BIN / "opencode"), "run", prompt], {})


def test_opencode_completes_a_turn(served: Served) -> None:
    done = _opencode(served, "say pineapple")
    assert done.returncode == 0, done.stderr
    assert "pineapple" in done.stdout


def test_opencode_runs_a_tool_and_sends_its_result_back(served: Served) -> None:
    done = _opencode(served, "use read now")
    assert done.returncode == 0, done.stderr
    assert "All read." in done.stdout, done.stdout + done.stderr[-2000:]


@pytest.mark.parametrize("base", ["", "/ollama"])
def test_codex_oss_uses_the_ollama_api(served: Served, base: str) -> None:
    # `codex --oss` checks the Ollama version (0.13.4 or later) and the model list at the
    # Ollama base URL, then calls /v1/responses there: the node's root or /ollama.
    argv = [str(BIN / "codex"), "exec", "--oss", "--local-provider", "ollama", "-m", served.model]
    argv.append("--skip-git-repo-check")
    done = _run(served, [*argv, "say pineapple"], {"CODEX_OSS_BASE_URL": f"{served.url}{base}/v1"})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "pineapple"
