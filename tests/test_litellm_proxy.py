"""LiteLLM's proxy (`litellm[proxy]==1.106.12`, in its own virtual environment: `.ci/run`
installs it into `EXO_LITELLM`, default `~/.cache/exo-litellm`; skipped when absent) in front
of exo's API with the three providers people configure for an OpenAI-, Anthropic- or
Ollama-compatible server: `openai/`, `anthropic/` and `ollama_chat/`. Each answers chats
through the proxy, streamed and not; `openai/` and `anthropic/` map exo's context-overflow
error to LiteLLM's `ContextWindowExceededError` (what its context-window fallbacks act on),
`ollama_chat/` passes Ollama's sentence on (LiteLLM maps no Ollama error to it).

exo's side is the real API app over a stand-in cluster (`AgentCluster`: scripted answers or
the engine's overflow refusal), served on a loopback port; the proxy is the real `litellm`
command on another, with its cost map read locally (no network).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from exo.api.tests.serving import scripted_app, serving
from exo.api.tests.test_agent_clients import AgentCluster
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import SCRIPTED_ANSWER

LITELLM = Path(os.environ.get("EXO_LITELLM", Path.home() / ".cache" / "exo-litellm"))
PROXY = LITELLM / "bin" / "litellm"
MASTER_KEY = "sk-exo-litellm-test-0123456789"
START_TIMEOUT_SECONDS = 120.0
REQUEST_TIMEOUT_SECONDS = 60.0
PROVIDERS = ("openai", "anthropic", "ollama_chat")

pytestmark = pytest.mark.skipif(
    not PROXY.exists(), reason=f"LiteLLM's proxy is not installed in {LITELLM} (.ci/run does)"
)


def proxy_config(exo_url: str) -> str:
    """One model per provider, each pointing at exo's API where that provider expects it."""
    bases = {"openai": f"{exo_url}/v1", "anthropic": exo_url, "ollama_chat": exo_url}
    entries = [
        f"  - model_name: exo-{provider}\n"
        f"    litellm_params:\n"
        f"      model: {provider}/{SMOLLM2}\n"
        f"      api_base: {bases[provider]}\n"
        f"      api_key: exo\n"
        for provider in PROVIDERS
    ]
    return "model_list:\n" + "".join(entries) + "litellm_settings:\n  num_retries: 0\n"


def free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def proxied(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, AgentCluster]]:
    """exo's API over an `AgentCluster` and LiteLLM's proxy in front of it: (the proxy's
    base URL, the cluster)."""
    cluster = AgentCluster()
    directory = tmp_path_factory.mktemp("litellm")
    with serving(scripted_app(cluster)) as (exo_url, _port):
        config = directory / "config.yaml"
        config.write_text(proxy_config(exo_url), encoding="utf-8")
        port = free_port()
        log = (directory / "proxy.log").open("wb")
        environment = {
            **os.environ,
            "LITELLM_MASTER_KEY": MASTER_KEY,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no download of the cost map
            "LITELLM_TELEMETRY": "False",
            "NO_PROXY": "127.0.0.1,localhost",
        }
        process = subprocess.Popen(
            [str(PROXY), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=environment,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + START_TIMEOUT_SECONDS
            while True:
                assert process.poll() is None, (directory / "proxy.log").read_text()[-3000:]
                try:
                    if httpx.get(f"{url}/health/liveliness", timeout=2).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "LiteLLM's proxy did not start in time"
                time.sleep(0.25)
            yield url, cluster
        finally:
            process.terminate()
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=15)
            log.close()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=url, api_key=MASTER_KEY, max_retries=0, timeout=REQUEST_TIMEOUT_SECONDS
    )


@pytest.mark.parametrize("provider", PROVIDERS)
def test_each_provider_answers_through_the_proxy(
    proxied: tuple[str, AgentCluster], provider: str
) -> None:
    url, cluster = proxied
    cluster.reply = "text"
    proxy = client(url)
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi"}]
    answer = proxy.chat.completions.create(
        model=f"exo-{provider}", messages=messages, max_tokens=16
    )
    assert answer.choices[0].message.content == SCRIPTED_ANSWER
    stream = proxy.chat.completions.create(
        model=f"exo-{provider}", messages=messages, max_tokens=16, stream=True
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == SCRIPTED_ANSWER
    assert cluster.last_params.model == SMOLLM2


@pytest.mark.parametrize("provider", ("openai", "anthropic"))
def test_context_overflow_becomes_litellms_context_window_exceeded_error(
    proxied: tuple[str, AgentCluster], provider: str
) -> None:
    url, cluster = proxied
    cluster.reply = "overflow"
    with pytest.raises(openai.BadRequestError) as raised:
        client(url).chat.completions.create(
            model=f"exo-{provider}", messages=[{"role": "user", "content": "Hi"}], max_tokens=16
        )
    assert "ContextWindowExceededError" in str(raised.value)


def test_ollama_overflow_reaches_the_client_in_ollamas_words(
    proxied: tuple[str, AgentCluster],
) -> None:
    # LiteLLM 1.106.12 maps no Ollama error to ContextWindowExceededError (its Ollama mapper
    # checks connection and model errors only), so through `ollama_chat/` an overflow is a
    # BadRequestError carrying Ollama's own sentence (docs: Integrations, LiteLLM).
    url, cluster = proxied
    cluster.reply = "overflow"
    with pytest.raises(openai.BadRequestError) as raised:
        client(url).chat.completions.create(
            model="exo-ollama_chat", messages=[{"role": "user", "content": "Hi"}], max_tokens=16
        )
    assert "the input length exceeds the context length" in str(raised.value)
