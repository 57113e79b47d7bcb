"""One model split across real nodes: pipeline (2 and 3 ranks) and tensor (2 ranks) give
the same greedy output as one node."""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from exo.testing.processes import DEFAULT_MODEL_ID, ExoNode, wait_until
from exo.testing.tiny_models import save_tiny_model
from exo.worker.engines.torch.batching.kv_memory import KV_CACHE_DTYPE_ENV

PROMPT = [{"role": "user", "content": "Name three colours and say why the sky is blue."}]
FORM_TIMEOUT_SECONDS = 30.0
READY_TIMEOUT_SECONDS = 180.0
# Text pieces a cancelled stream may still deliver: those already generated or in flight.
CANCEL_SLACK_PIECES = 200


@pytest.fixture(scope="module", autouse=True)
def float32_kv() -> Iterator[None]:
    """The nodes' runners store float32 KV: split and single answers compare token for token
    on tiny random models, where a bfloat16 rounding of a key can flip a near-tie."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(KV_CACHE_DTYPE_ENV, "float32")
        yield


@pytest.fixture(scope="module")
def nodes(
    tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path
) -> Iterator[list[ExoNode]]:
    root = tmp_path_factory.mktemp("sharding")
    first = ExoNode(root / "a", shared_models_dir, extra_args=("--no-default-model",))
    others = [
        ExoNode(
            root / name,
            shared_models_dir,
            extra_args=("--no-default-model",),
            namespace=first.namespace,
            bootstrap=(first,),
        )
        for name in ("b", "c")
    ]
    cluster = [first, *others]
    try:
        for node in cluster:
            node.launch()
        for node in cluster:
            node.wait_api()
        ids = [node.node_id() for node in cluster]
        # Placement across nodes needs their measured links.
        wait_until(
            lambda: all(
                len(cluster[0].state()["topology"].get(node_id, {})) == 2 for node_id in ids
            ),
            FORM_TIMEOUT_SECONDS,
            what="links between all nodes",
        )
        yield cluster
    finally:
        for node in cluster:
            node.stop()


@pytest.fixture(scope="module")
def tiny_models(
    tmp_path_factory: pytest.TempPathFactory, shared_models_dir: Path
) -> dict[str, str]:
    tokenizer_source = shared_models_dir / "HuggingFaceTB--SmolLM2-135M-Instruct"
    root = tmp_path_factory.mktemp("tiny-models")
    models = {
        name: str(save_tiny_model(root / name, name, tokenizer_source))
        for name in ("qwen3", "gemma3", "qwen3_moe", "gpt_oss")
    }
    # The MoE models' copies: the same checkpoint under other ids, placed beside it.
    for name in ("qwen3_moe", "gpt_oss"):
        for sharding in ("expert", "tensor"):
            copy = shutil.copytree(root / name, root / f"{name}-{sharding}")
            models[f"{name}-{sharding}"] = str(copy)
    return models


def place(node: ExoNode, model_id: str, sharding: str, node_ids: list[str]) -> httpx.Response:
    return httpx.post(
        f"{node.url}/place_instance",
        json={
            "model_id": model_id,
            "sharding": sharding,
            "min_nodes": len(node_ids),
            "node_ids": node_ids,
        },
        timeout=60,
    )


def ready_statuses(node: ExoNode, instance_id: str) -> list[dict[str, Any]] | None:
    state = node.state()
    instance = state["instances"].get(instance_id)
    if instance is None:
        return None
    statuses = [
        state["runners"].get(r, {}) for r in instance["shard_assignments"]["runner_to_shard"]
    ]
    if all(status.get("kind") in ("RunnerReady", "RunnerRunning") for status in statuses):
        return statuses
    return None


def greedy_answer(node: ExoNode, model_id: str) -> tuple[str, int]:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=120, max_retries=0)
    completion = client.chat.completions.create(
        model=model_id, messages=PROMPT, temperature=0, max_tokens=16
    )
    assert completion.usage is not None
    return completion.choices[0].message.content or "", completion.usage.completion_tokens


def run_placement(
    nodes: list[ExoNode], model_id: str, sharding: str, ranks: int
) -> tuple[str, int, list[dict[str, Any]]]:
    """Place `model_id` on the first `ranks` nodes, ask through the last node, delete."""
    asker = nodes[-1]
    node_ids = [node.node_id() for node in nodes[:ranks]]
    response = place(nodes[0], model_id, sharding, node_ids)
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    assert len(response.json()["instance"]["shard_assignments"]["runner_to_shard"]) == ranks
    try:
        statuses = wait_until(
            lambda: ready_statuses(nodes[0], instance_id),
            READY_TIMEOUT_SECONDS,
            interval=0.5,
            what=f"{sharding} x{ranks} of {model_id} ready",
        )
        text, tokens = greedy_answer(asker, model_id)
    finally:
        httpx.delete(f"{nodes[0].url}/instance/{instance_id}", timeout=60)
        wait_until(
            lambda: not any(node.runner_processes() for node in nodes),
            60,
            what="every runner stopped",
        )
    return text, tokens, statuses


def test_default_model_pipeline_equals_single_node(nodes: list[ExoNode]) -> None:
    single, single_tokens, [single_status] = run_placement(nodes, DEFAULT_MODEL_ID, "pipeline", 1)
    assert single and single_tokens > 0
    two, two_tokens, two_statuses = run_placement(nodes, DEFAULT_MODEL_ID, "pipeline", 2)
    three, three_tokens, _ = run_placement(nodes, DEFAULT_MODEL_ID, "pipeline", 3)
    assert (two, two_tokens) == (single, single_tokens)
    assert (three, three_tokens) == (single, single_tokens)
    # Each rank holds its share, not the model: its layers (split by the nodes' measured
    # speeds, the LM head's rank taking fewer), plus the input embedding (float32, the
    # largest single tensor) on rank 0 and the LM head on rank 1.
    total = single_status["weight_bytes"]
    shares = [status["weight_bytes"] for status in two_statuses]
    assert all(0.1 * total < share < 0.9 * total for share in shares), (shares, total)
    assert 0.95 * total < sum(shares) < 1.2 * total, (shares, total)


@pytest.mark.parametrize("architecture", ["qwen3", "gemma3"])
def test_tiny_models_split_every_way_equal_single_node(
    nodes: list[ExoNode], tiny_models: dict[str, str], architecture: str
) -> None:
    model_id = tiny_models[architecture]
    reference = run_placement(nodes, model_id, "pipeline", 1)[:2]
    assert reference[1] > 0
    assert run_placement(nodes, model_id, "pipeline", 2)[:2] == reference
    assert run_placement(nodes, model_id, "pipeline", 3)[:2] == reference
    assert run_placement(nodes, model_id, "tensor", 2)[:2] == reference


def run_placements_at_once(
    nodes: list[ExoNode], placements: list[tuple[str, str, list[ExoNode]]]
) -> list[tuple[str, int]]:
    """Place every `(model_id, sharding, on)` together (the runners start and load side by
    side: what a placement mostly waits on), ask each model once all are ready through a
    node holding none of its ranks, delete them all. The model ids must differ: a request
    names a model, not an instance."""
    assert len({model_id for model_id, _, _ in placements}) == len(placements)
    instance_ids: list[str] = []
    answers: list[tuple[str, int]] = []
    try:
        for model_id, sharding, on in placements:
            response = place(nodes[0], model_id, sharding, [node.node_id() for node in on])
            assert response.status_code == 200, response.text
            instance_ids.append(response.json()["instance_id"])
        for instance_id, (model_id, sharding, on) in zip(instance_ids, placements, strict=True):
            wait_until(
                lambda instance_id=instance_id: ready_statuses(nodes[0], instance_id),
                READY_TIMEOUT_SECONDS,
                interval=0.5,
                what=f"{sharding} x{len(on)} of {model_id} ready",
            )
        for model_id, _, on in placements:
            asker = next(node for node in nodes if node not in on)
            answers.append(greedy_answer(asker, model_id))
    finally:
        for instance_id in instance_ids:
            httpx.delete(f"{nodes[0].url}/instance/{instance_id}", timeout=60)
        wait_until(
            lambda: not any(node.runner_processes() for node in nodes),
            60,
            what="every runner stopped",
        )
    return answers


# gpt-oss's live splits run with `-m slow` (its process-group splits run by default): each
# family adds ~90-120 s here on a loaded 2-core machine.
@pytest.mark.parametrize(
    "architecture", ["qwen3_moe", pytest.param("gpt_oss", marks=pytest.mark.slow)]
)
def test_tiny_moe_models_split_by_experts_and_tensors_equal_single_node(
    nodes: list[ExoNode], tiny_models: dict[str, str], architecture: str
) -> None:
    """Mixture-of-experts families over live loopback nodes: expert x2 (each node half of
    every MoE layer's experts, one all-reduce per MoE layer) and tensor x2 give the single
    node's greedy answer and token count, each asked through a node holding none of its
    ranks. Three copies of one checkpoint (three model ids), placed at once."""
    a, b, c = nodes
    single, by_experts, by_tensors = run_placements_at_once(
        nodes,
        [
            (tiny_models[architecture], "pipeline", [c]),
            (tiny_models[f"{architecture}-expert"], "expert", [a, b]),
            (tiny_models[f"{architecture}-tensor"], "tensor", [b, c]),
        ],
    )
    assert single[1] > 0
    assert by_experts == single
    assert by_tensors == single


def test_bad_placements_are_400_with_the_reason(nodes: list[ExoNode]) -> None:
    node_ids = [node.node_id() for node in nodes[:2]]
    unknown = place(nodes[0], "no/such-model", "pipeline", node_ids)
    assert unknown.status_code == 400
    assert "no/such-model" in unknown.json()["error"]["message"]
    # SmolLM2 has 9 attention heads: no even tensor split.
    heads = place(nodes[0], DEFAULT_MODEL_ID, "tensor", node_ids)
    assert heads.status_code == 400
    assert "tensor" in heads.json()["error"]["message"]
    too_big = httpx.post(
        f"{nodes[0].url}/place_instance",
        json={"model_id": DEFAULT_MODEL_ID, "min_nodes": 4},
        timeout=60,
    )
    assert too_big.status_code == 400
    assert "min_nodes=4" in too_big.json()["error"]["message"]


def test_cancel_and_disconnect_stop_every_rank_and_free_the_slot(nodes: list[ExoNode]) -> None:
    a, b, _c = nodes
    response = place(a, DEFAULT_MODEL_ID, "pipeline", [a.node_id(), b.node_id()])
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    wait_until(lambda: ready_statuses(a, instance_id), READY_TIMEOUT_SECONDS, interval=0.5)
    client = openai.OpenAI(base_url=f"{b.url}/v1", api_key="unused", timeout=60, max_retries=0)
    story = [{"role": "user", "content": "Write a very long story about a dragon."}]
    try:
        # 1. POST /v1/cancel/{id} with the id the client saw, asked through another node.
        # Greedy: the long story is the same on every run (sampled, a short answer could
        # end before the cancel).
        stream = client.chat.completions.create(
            model=DEFAULT_MODEL_ID, messages=story, temperature=0, max_tokens=2000, stream=True
        )
        pieces = 0
        cancelled_after = 0
        with pytest.raises(openai.APIError, match="cancelled"):
            for chunk in stream:
                if chunk.choices and chunk.choices[0].delta.content:
                    pieces += 1
                if pieces == 3 and not cancelled_after:
                    cancel = httpx.post(f"{a.url}/v1/cancel/{chunk.id}", timeout=10)
                    assert cancel.status_code == 200, cancel.text
                    cancelled_after = pieces
        # Every rank stops within a few tokens of the cancel, far short of the 2000 (counted
        # in tokens, not seconds, so a loaded machine does not change the outcome).
        assert cancelled_after and pieces - cancelled_after < CANCEL_SLACK_PIECES, pieces
        assert httpx.post(f"{a.url}/v1/cancel/{chunk.id}", timeout=10).status_code == 404
        # 2. A client that goes away mid-stream.
        with (
            httpx.Client(timeout=60) as http,
            http.stream(
                "POST",
                f"{b.url}/v1/chat/completions",
                json={
                    "model": DEFAULT_MODEL_ID,
                    "messages": story,
                    "temperature": 0,
                    "max_tokens": 2000,
                    "stream": True,
                },
            ) as streamed,
        ):
            assert streamed.status_code == 200
            for index, _line in enumerate(streamed.iter_lines()):
                if index == 6:
                    break
        wait_until(lambda: not a.state()["tasks"], 60, what="no task left after disconnect")
        # Every rank is free again: the next request is served at once, in full.
        started = time.monotonic()
        text, tokens = greedy_answer(a, DEFAULT_MODEL_ID)
        assert tokens > 0 and text
        assert time.monotonic() - started < 30
    finally:
        httpx.delete(f"{a.url}/instance/{instance_id}", timeout=60)
        wait_until(lambda: not any(n.runner_processes() for n in nodes), 60, what="no runner")


def test_killing_rank_zeros_node_mid_stream_continues_on_the_instance_placed_again(
    nodes: list[ExoNode],
) -> None:
    """The node of rank 0 (which streams the tokens) is killed mid-stream: the instance is
    placed again under its id on the nodes still there, and the stream goes on there
    (mid-stream failover, docs/cluster.md "Streams that survive a node loss"; it ended with
    an error before the failover knew the re-placed instance from the lost one)."""
    a, b, c = nodes
    response = place(a, DEFAULT_MODEL_ID, "pipeline", [b.node_id(), c.node_id()])
    assert response.status_code == 200, response.text
    instance_id = response.json()["instance_id"]
    wait_until(lambda: ready_statuses(a, instance_id), READY_TIMEOUT_SECONDS, interval=0.5)
    client = openai.OpenAI(base_url=f"{a.url}/v1", api_key="unused", timeout=60, max_retries=0)
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": "Write a very long story about a dragon."}],
        temperature=0,  # greedy: a sampled short answer could end before the kill
        max_tokens=2000,
        stream=True,
    )
    # The hard case: the node of rank 0, which streams the tokens, goes away.
    rank_zero_node = next(
        node_id
        for node_id, runner in response.json()["instance"]["shard_assignments"][
            "node_to_runner"
        ].items()
        if runner.endswith("-rank0")
    )
    victim = b if b.node_id() == rank_zero_node else c
    killed_at = 0.0
    after_kill = 0
    finish_reason = None
    for chunk in stream:  # an APIError here: the stream did not survive
        if chunk.choices and chunk.choices[0].delta.content:
            if killed_at:
                after_kill += 1
            else:
                victim.kill()
                killed_at = time.monotonic()
        if chunk.choices and chunk.choices[0].finish_reason:
            finish_reason = chunk.choices[0].finish_reason
    assert killed_at and after_kill > 0 and finish_reason in ("stop", "length")
    survivors = [node for node in nodes if node is not victim]
    victim_id = rank_zero_node

    # The instance is the user's wish: it is placed again, under the same id, on the nodes
    # still there, and serves again.
    def replaced_and_ready() -> bool:
        instance = a.state()["instances"].get(instance_id)
        if instance is None:
            return False
        nodes_used = instance["shard_assignments"]["node_to_runner"]
        return victim_id not in nodes_used and bool(ready_statuses(a, instance_id))

    wait_until(replaced_and_ready, READY_TIMEOUT_SECONDS, interval=0.5, what="re-placed")
    # No runner of the old assignment is left behind: each survivor runs exactly the ranks
    # the new assignment gives it.
    assignment = a.state()["instances"][instance_id]["shard_assignments"]["node_to_runner"]
    for survivor in survivors:
        expected = 1 if survivor.node_id() in assignment else 0
        wait_until(
            lambda survivor=survivor, expected=expected: (
                len(survivor.runner_processes()) == expected
            ),
            30,
            what="only the new assignment's runners",
        )
    assert greedy_answer(a, DEFAULT_MODEL_ID)[1] > 0
