"""One real `exo` node, driven through the official OpenAI client."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import httpx
import openai
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until

QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
LONG_ANSWER = [{"role": "user", "content": "Write a very long story about a dragon and a knight."}]


def client_for(node: ExoNode, timeout: float = 120.0) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{node.url}/v1", api_key="unused", timeout=timeout, max_retries=0
    )


def loading_events(node: ExoNode) -> list[dict]:
    return [
        event
        for event in node.events()
        if event["kind"] == "RunnerStatusUpdated" and event["status"]["kind"] == "RunnerLoaded"
    ]


def test_default_model_answers_streaming_and_not(default_node: ExoNode) -> None:
    client = client_for(default_node)
    loads_before = len(loading_events(default_node))

    completion = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=40
    )
    answer = completion.choices[0].message.content
    assert answer is not None and "Paris" in answer
    assert completion.choices[0].finish_reason == "stop"
    assert completion.usage is not None
    assert completion.usage.prompt_tokens > 5
    assert completion.usage.completion_tokens > 0
    assert completion.usage.total_tokens == (
        completion.usage.prompt_tokens + completion.usage.completion_tokens
    )

    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=QUESTION,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces: list[str] = []
    finish_reasons: list[str] = []
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
            if choice.finish_reason:
                finish_reasons.append(choice.finish_reason)
    assert "".join(pieces) == answer
    # More than one piece: the first token leaves alone (TTFT), later ones may be grouped
    # (`--stream-interval-ms`), so how many pieces depends on the decode speed.
    assert len(pieces) >= 2, "streaming sends the answer piece by piece"
    assert finish_reasons == ["stop"]
    assert usage is not None and usage.completion_tokens == completion.usage.completion_tokens

    # Both requests ran on the runner that was already loaded.
    assert len(loading_events(default_node)) == loads_before


def test_max_tokens_and_stop_sequences(default_node: ExoNode) -> None:
    client = client_for(default_node)
    limited = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=LONG_ANSWER, temperature=0, max_tokens=5
    )
    assert limited.choices[0].finish_reason == "length"
    assert limited.usage is not None and limited.usage.completion_tokens == 5

    stopped = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=40, stop=[" Paris"]
    )
    text = stopped.choices[0].message.content or ""
    assert stopped.choices[0].finish_reason == "stop"
    assert "Paris" not in text
    assert text.startswith("The capital of France is")


def test_errors_in_openai_shape(default_node: ExoNode) -> None:
    url = f"{default_node.url}/v1/chat/completions"
    unknown = httpx.post(url, json={"model": "no/such-model", "messages": QUESTION})
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "model_not_found"

    malformed = httpx.post(url, content=b"{not json", headers={"content-type": "application/json"})
    assert malformed.status_code == 400
    assert "not valid JSON" in malformed.json()["error"]["message"]

    missing = httpx.post(url, json={"model": DEFAULT_MODEL_ID})
    assert missing.status_code == 400  # OpenAI's status, not FastAPI's 422
    assert missing.json()["error"]["param"] == "messages"
    assert missing.json()["error"]["type"] == "invalid_request_error"

    wrong_type = httpx.post(url, json={"model": DEFAULT_MODEL_ID, "messages": "hi"})
    assert wrong_type.status_code == 400

    empty = httpx.post(url, json={"model": DEFAULT_MODEL_ID, "messages": []})
    assert empty.status_code == 400, empty.text
    assert empty.json()["error"]["param"] == "messages"

    with pytest.raises(openai.NotFoundError):
        client_for(default_node).chat.completions.create(model="no/such-model", messages=QUESTION)

    too_long = httpx.post(
        url,
        json={"model": DEFAULT_MODEL_ID, "messages": [{"role": "user", "content": "word " * 9000}]},
        timeout=120,
    )
    assert too_long.status_code == 400, too_long.text
    assert too_long.json()["error"]["code"] == "context_length_exceeded"
    too_long_stream = httpx.post(
        url,
        json={
            "model": DEFAULT_MODEL_ID,
            "messages": [{"role": "user", "content": "word " * 9000}],
            "stream": True,
        },
        timeout=120,
    )
    assert too_long_stream.status_code == 400

    # The node still answers after all of that.
    assert httpx.get(f"{default_node.url}/v1/models").status_code == 200


def test_client_disconnect_cancels_generation(default_node: ExoNode) -> None:
    body = {
        "model": DEFAULT_MODEL_ID,
        "messages": LONG_ANSWER,
        "max_tokens": 2000,
        "temperature": 0,
        "stream": True,
    }
    with (
        httpx.Client(timeout=60) as http,
        http.stream("POST", f"{default_node.url}/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        content_lines = 0
        for line in lines:
            if '"content":"' in line and '"content":""' not in line:
                content_lines += 1
                if content_lines == 3:
                    break
    # The task ends as cancelled, long before 2000 tokens.
    wait_until(
        lambda: any(
            event["kind"] == "TaskStatusUpdated" and event["status"]["kind"] == "TaskCancelled"
            for event in default_node.events()
        ),
        timeout=60,
        what="the cancelled task in the event log",
    )
    wait_until(lambda: not default_node.state()["tasks"], timeout=60, what="no tasks left")


def test_runner_killed_mid_request_fails_request_then_recovers(default_node: ExoNode) -> None:
    client = client_for(default_node, timeout=60)
    [runner] = default_node.runner_processes()
    # Greedy: the long story is the same on every run (sampled, a short answer could end
    # before the runner is killed).
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=LONG_ANSWER, temperature=0, max_tokens=2000, stream=True
    )
    started = time.monotonic()
    with pytest.raises(openai.APIError) as raised:
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                runner.send_signal(signal.SIGKILL)
    assert time.monotonic() - started < 30
    assert "runner" in str(raised.value).lower()

    # The worker recreates the runner; the next request is served by the new one.
    completion = client_for(default_node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=40
    )
    assert "Paris" in (completion.choices[0].message.content or "")
    [new_runner] = default_node.runner_processes()
    assert new_runner.pid != runner.pid
    assert any(
        event["kind"] == "RunnerStatusUpdated" and event["status"]["kind"] == "RunnerFailed"
        for event in default_node.events()
    )


def test_placement_routes_and_restart_replay(tmp_path: Path, shared_models_dir: Path) -> None:
    node = ExoNode(
        tmp_path / "home",
        models_dir=shared_models_dir,
        extra_args=("--no-default-model", "--no-auto-place"),
    )
    node.start()
    try:
        # Known model, nothing placed, no placing on request: 404 that says how to place it.
        response = httpx.post(
            f"{node.url}/v1/chat/completions",
            json={"model": DEFAULT_MODEL_ID, "messages": QUESTION},
        )
        assert response.status_code == 404
        assert "/place_instance" in response.json()["error"]["message"]

        wait_until(lambda: node.state()["node_info"], timeout=30, what="node info")
        previews = httpx.get(
            f"{node.url}/instance/previews", params={"model_id": DEFAULT_MODEL_ID}
        ).json()
        assert {(p["sharding"], p["node_count"]) for p in previews} == {
            ("pipeline", 1),
            ("tensor", 1),
            ("expert", 1),
        }
        # On one node every kind is the whole model, but a dense model has no experts to
        # split, on one node or more (docs/cluster.md).
        errors = {p["sharding"]: p["error"] for p in previews}
        assert errors["pipeline"] is None and errors["tensor"] is None
        assert "not a mixture-of-experts model" in errors["expert"]
        by_experts = httpx.post(
            f"{node.url}/place_instance",
            json={"model_id": DEFAULT_MODEL_ID, "sharding": "expert", "min_nodes": 1},
        )
        assert by_experts.status_code == 400
        assert "not a mixture-of-experts model" in by_experts.json()["error"]["message"]
        unknown = httpx.get(f"{node.url}/instance/previews", params={"model_id": "no/such"})
        assert unknown.status_code == 404

        assert httpx.delete(f"{node.url}/instance/nope").status_code == 404
        bad = httpx.post(f"{node.url}/place_instance", json={"model_id": "no/such"})
        assert bad.status_code == 400
        too_many = httpx.post(
            f"{node.url}/place_instance", json={"model_id": DEFAULT_MODEL_ID, "min_nodes": 2}
        )
        assert too_many.status_code == 400

        placed = httpx.post(f"{node.url}/place_instance", json={"model_id": DEFAULT_MODEL_ID})
        assert placed.status_code == 200, placed.text
        instance_id = placed.json()["instance_id"]
        node.wait_ready(timeout=120)
        runners = node.runner_processes()
        assert len(runners) == 1
        # The runner is forked from the node's runner server (exo.worker.runner.start_method).
        [server] = node.runner_server_processes()
        assert runners[0].ppid() == server.pid

        # Ctrl-C stops the node, every runner and the runner server, none of them killed.
        assert node.stop(signal.SIGINT) == 0
        assert not any(runner.is_running() for runner in runners)
        assert not server.is_running()
        assert node.leftovers == []
    finally:
        node.stop()

    # On restart the node replays its log: the instance is back and answers. "is ready"
    # is logged once the new runner is (the replayed state still says the old one was).
    log_before = node.log_path.read_text()
    # Restarted with a smaller KV budget: its node info and its new runner's engine hold it.
    restarted = ExoNode(
        node.home,
        models_dir=shared_models_dir,
        extra_args=("--no-default-model", "--kv-cache-tokens", "4096"),
    )
    restarted.start()
    try:
        assert instance_id in restarted.state()["instances"]
        restarted.wait_ready(timeout=120)

        def new_lines() -> str:
            return restarted.log_path.read_text()[len(log_before) :]

        # A bound, not a speed check: the runner's load took ~39 s at load average 10-14.
        wait_until(lambda: " is ready" in new_lines(), timeout=180, what='"is ready" logged')
        assert "warmed up" in new_lines().split(" is ready")[0], new_lines()
        # Its node info and its new runner hold the smaller KV budget (the replayed state
        # showed the first run's until they reported).
        wait_until(
            lambda: (
                [i["kv_cache_tokens"] for i in restarted.state()["node_info"].values()] == [4096]
            ),
            timeout=30,
            what="the node's KV budget in /state",
        )
        wait_until(
            lambda: (
                [s.get("kv_cache_tokens") for s in restarted.state()["runners"].values()] == [4096]
            ),
            timeout=30,
            what="the new runner's KV budget in /state",
        )
        completion = client_for(restarted).chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=40
        )
        assert "Paris" in (completion.choices[0].message.content or "")

        deleted = httpx.delete(f"{restarted.url}/instance/{instance_id}")
        assert deleted.status_code == 200
        wait_until(lambda: not restarted.runner_processes(), timeout=30, what="runner shut down")
    finally:
        restarted.stop()


def kv_cache_samples(node: ExoNode) -> dict[tuple[str, str], float]:
    """`exo_kv_cache_*` samples of the node's `/metrics`: (name, holder) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{node.url}/metrics", timeout=30)
    assert response.status_code == 200
    return {
        (sample.name, sample.labels.get("holder", "")): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name.startswith("exo_kv_cache")
    }


def test_metrics_show_the_runners_kv_cache(default_node: ExoNode) -> None:
    """After a chat the runner's KV cache reaches the node's /metrics: its budget, nothing
    held by running requests once the answer is done, the finished turn in the prefix cache."""
    answer = client_for(default_node).chat.completions.create(
        model=DEFAULT_MODEL_ID, messages=QUESTION, temperature=0, max_tokens=8
    )
    assert answer.usage is not None
    samples: dict[tuple[str, str], float] = {}

    def settled() -> bool:
        samples.update(kv_cache_samples(default_node))
        return samples.get(("exo_kv_cache_tokens", "running")) == 0 and bool(
            samples.get(("exo_kv_cache_tokens", "prefix_cache"))
        )

    wait_until(settled, 30, what="the runner's KV cache in /metrics")
    assert samples[("exo_kv_cache_budget_tokens", "")] >= answer.usage.prompt_tokens
    assert samples[("exo_kv_cache_tokens", "prefix_cache")] >= answer.usage.prompt_tokens
