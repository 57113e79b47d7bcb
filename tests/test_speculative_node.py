"""Speculative decoding through a live node: the `speculative` field of Chat Completions and
of Ollama's `options` reaches the engine, the text is the same with and without it, and the
runner's counts reach `/state` and `/metrics`.

Slow: a node with the default model (its converted files shared with the engine tests in
`~/.cache/exo-test-models`), ~40 s on 2 cores.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import ollama
import openai
import pytest

from exo.node_options import DEFAULT_MODEL_ID
from exo.testing.processes import ExoNode, wait_until

pytestmark = pytest.mark.slow

TEST_MODELS_DIR = Path.home() / ".cache" / "exo-test-models"
PASSAGE = (
    "The old lighthouse stood at the edge of the cliff, its white paint peeling after decades "
    "of salt and wind. Every night the keeper climbed the spiral stairs, one hundred and "
    "twelve steps, to light the great lamp. Ships passing in the dark relied on its steady "
    "beam to steer clear of the rocks below."
)
REPEAT = f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ExoNode]:
    """A node placing the default model from the shared models directory, drafting for no
    request that does not ask (`--speculative off`)."""
    started = ExoNode(
        tmp_path_factory.mktemp("exo-speculative"),
        models_dir=TEST_MODELS_DIR,
        extra_args=("--speculative", "off"),
    )
    started.start()
    try:
        started.wait_ready()
        yield started
    finally:
        started.stop()


def speculation_of(node: ExoNode) -> dict[str, Any] | None:
    """The default model's ready runner's speculation counts, once it verified drafts."""
    state = node.state()
    for runner_id in node.ready_runner_ids():
        status = state["runners"][runner_id]
        stats = status.get("speculation")
        if status["kind"] == "RunnerReady" and stats and stats["verify_rounds"] > 0:
            return dict(stats)
    return None


def test_the_field_reaches_the_engine_and_the_counts_reach_state_and_metrics(
    node: ExoNode,
) -> None:
    client = openai.OpenAI(base_url=f"{node.url}/v1", api_key="unused", timeout=300, max_retries=0)
    texts = []
    for speculative in (False, True):
        completion = client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": REPEAT}],
            max_tokens=80,
            temperature=0,
            extra_body={"speculative": speculative},
        )
        texts.append(completion.choices[0].message.content)
    assert texts[0] == texts[1] and texts[0] and PASSAGE[:40] in texts[0]
    stats = wait_until(lambda: speculation_of(node), timeout=30, what="speculation counts")
    assert stats["tokens_per_step"] > 1 and stats["acceptance_rate"] >= 0.6, stats
    # Ollama's `options.speculative`, the same reply.
    reply = ollama.Client(host=f"{node.url}/ollama", timeout=300).chat(
        model=DEFAULT_MODEL_ID,
        messages=[{"role": "user", "content": REPEAT}],
        options={"temperature": 0, "num_predict": 80, "speculative": True},
    )
    assert reply.message.content == texts[0]
    later = wait_until(
        lambda: (now := speculation_of(node)) and now["verify_rounds"] > stats["verify_rounds"],
        timeout=30,
        what="the Ollama request's drafts counted",
    )
    assert later
    metrics = httpx.get(f"{node.url}/metrics", timeout=10).text
    assert "exo_speculative_acceptance_rate{" in metrics
    assert "exo_speculative_tokens_per_step{" in metrics
    # A value the field does not take: a 400 naming it.
    with pytest.raises(openai.BadRequestError, match="speculative"):
        client.chat.completions.create(
            model=DEFAULT_MODEL_ID,
            messages=[{"role": "user", "content": "Hi"}],
            max_tokens=4,
            extra_body={"speculative": "sometimes"},
        )
