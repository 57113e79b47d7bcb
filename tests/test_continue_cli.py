"""Continue's CLI (`@continuedev/cli`, pinned in `.ci/run` and installed with the agent
clients into `EXO_AGENT_CLIENTS`; skipped when absent) completes a headless turn (`cn -p`)
against exo's API with only a config naming exo as an OpenAI-compatible provider: the real
API app over a stand-in cluster with a scripted answer, on a loopback port.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from exo.api.tests.serving import scripted_app, serving
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import SCRIPTED_ANSWER, ScriptedCluster

CLIENTS = Path(os.environ.get("EXO_AGENT_CLIENTS", Path.home() / ".cache" / "exo-agent-clients"))
CONTINUE = CLIENTS / "node_modules" / ".bin" / "cn"
TURN_TIMEOUT_SECONDS = 120

pytestmark = pytest.mark.skipif(
    not CONTINUE.exists(), reason=f"Continue's CLI is not installed in {CLIENTS} (.ci/run does)"
)


def continue_config(base_url: str) -> str:
    """The config a user writes for exo (docs: Coding agents, Continue)."""
    return (
        "name: exo\nversion: 1.0.0\nschema: v1\nmodels:\n"
        f"  - name: exo\n    provider: openai\n    model: {SMOLLM2}\n"
        f"    apiBase: {base_url}/v1\n    apiKey: exo\n    roles: [chat]\n"
    )


def test_continue_cli_completes_a_headless_turn(tmp_path: Path) -> None:
    cluster = ScriptedCluster()
    with serving(scripted_app(cluster)) as (base_url, _port):
        config = tmp_path / "config.yaml"
        config.write_text(continue_config(base_url), encoding="utf-8")
        home = tmp_path / "home"
        home.mkdir()
        environment = {
            **os.environ,
            "HOME": str(home),  # its sessions and logs stay in the test's directory
            "CONTINUE_CLI_ENABLE_TELEMETRY": "0",
            "CONTINUE_METRICS_ENABLED": "0",
        }
        turn = subprocess.run(
            [str(CONTINUE), "-p", "Say hello", "--config", str(config)],
            cwd=tmp_path,
            env=environment,
            capture_output=True,
            text=True,
            timeout=TURN_TIMEOUT_SECONDS,
            stdin=subprocess.DEVNULL,
        )
    assert turn.returncode == 0, turn.stdout + turn.stderr
    assert SCRIPTED_ANSWER in turn.stdout
    (request,) = cluster.submitted
    assert request.params.model == SMOLLM2
    assert any("Say hello" in str(message.content) for message in request.params.messages or ())
