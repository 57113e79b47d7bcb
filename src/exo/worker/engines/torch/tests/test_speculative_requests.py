"""Per-request features with speculative decoding on (issue 43, "every per-request feature
still holds"): tool calls (forced by a grammar and offered with `auto`) give the same
tokens, tool calls, finish reason and usage with `speculative` true and false; a drafting
request cancelled mid-draft (n-gram and draft model) frees its slot and its draft state, the
next request's output staying exact; a request without `speculative` follows the node's
`--speculative` within `--draft-min` / `--draft-max`. Tiny float32 Llama, one process.

A random model writes no tool call of its own: `ScriptedForward` adds a large bias to the
logits of each row for the token a scripted reply has at the row's next position, so the
model "writes" the script wherever no grammar forbids it. The bias depends on the position
only, so a verify step's draft rows get the biases their decode steps would have.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.chat_protocol.output_parsing import OutputParser
from exo.node_options import parse_args
from exo.shared.types.text_generation import ToolDefinition
from exo.worker.engines.torch.batching.batch_attention import BatchPlan, forward_batch
from exo.worker.engines.torch.batching.request_state import GeneratedPiece
from exo.worker.engines.torch.decoding.speculative_drafts import (
    Draft,
    DraftRequest,
    NgramDraftSource,
)
from exo.worker.engines.torch.decoding.speculative_policy import SpeculationSettings
from exo.worker.engines.torch.draft_model import DraftModelSource
from exo.worker.engines.torch.tests.speculative_builders import (
    DRAFT_NOISE,
    PROMPTS,
    ScriptedDrafts,
    load,
    noisy_copy,
    plain_references,
    request,
    run,
    speculation,
)

TOOLS = (
    ToolDefinition(
        name="get_weather",
        parameters={"type": "object", "properties": {"city": {"type": "string"}}},
    ),
    ToolDefinition(
        name="search", parameters={"type": "object", "properties": {"query": {"type": "string"}}}
    ),
)
# The replies the bias writes: a forced call's bare object, and an auto call in Hermes
# markup (SmolLM2's tokenizer: the tiny model's) after a few words.
FORCED_REPLY = '{"name": "search", "arguments": {"query": "tide tables for Brest"}}'
AUTO_REPLY = (
    'Let me look that up. <tool_call>\n{"name": "get_weather", "arguments": '
    '{"city": "Brest"}}\n</tool_call>'
)
PROMPT = "What is the weather in Brest? Look it up."
# Far above a tiny random model's logits (about +-5): the script wins where it is allowed.
SCRIPT_BIAS = 60.0


class ScriptedForward:
    """`forward_batch` with `SCRIPT_BIAS` added to each logit row at the token `script`
    holds for the row's next position (`prompt_length` + index in `script`); rows past the
    script are left alone."""

    def __init__(self, prompt_length: int, script: Sequence[int]) -> None:
        self.prompt_length = prompt_length
        self.script = list(script)

    def __call__(
        self,
        model: Any,
        plan: BatchPlan,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        logit_rows: torch.Tensor,
    ) -> torch.Tensor:
        logits = forward_batch(model, plan, input_ids, position_ids, logit_rows)
        bias = torch.zeros_like(logits)  # (the logits are an inference tensor: not in place)
        for row, position in enumerate(position_ids[0, logit_rows].tolist()):
            index = position + 1 - self.prompt_length
            if 0 <= index < len(self.script):
                bias[row, self.script[index]] = SCRIPT_BIAS
        return logits + bias


def _parsed_calls(pieces: list[GeneratedPiece], forced: bool) -> list[tuple[str, str]]:
    """The tool calls (name, arguments) the API's output parser finds in the pieces."""
    parser = OutputParser(TOOLS, "hermes", thinking_open=False, forced_tool_call=forced)
    outputs = [parser.feed(piece.text) for piece in pieces]
    outputs.append(parser.finish(out_of_tokens=pieces[-1].finish_reason == "length"))
    return [(call.name, call.arguments) for out in outputs for call in out.tool_calls]


@pytest.mark.parametrize(
    ("tool_choice", "reply", "wanted"),
    [("required", FORCED_REPLY, "search"), ("auto", AUTO_REPLY, "get_weather")],
    ids=["forced", "auto"],
)
def test_tool_calls_finish_reason_and_usage_are_the_same_with_speculation(
    tiny_model_dir: Path, float32_kv: None, tool_choice: str, reply: str, wanted: str
) -> None:
    engine = load(tiny_model_dir)
    eos = engine.tokenizer.eos_token_id
    assert eos is not None
    engine.eos_token_ids = frozenset({eos})
    params = request(PROMPT, tools=TOOLS, tool_choice=tool_choice, temperature=0.0,
                     max_tokens=80)  # fmt: skip
    prompt_length = len(engine.build_request(params, None, "probe").prompt_ids)
    script = [*engine.tokenizer.encode(reply, add_special_tokens=False), eos]
    engine.scheduler._forward = ScriptedForward(prompt_length, script)
    reference = plain_references(engine, [params])
    outcomes = []
    for speculative in (False, True):
        engine.clear_prefix_cache()
        if speculative:
            speculation(engine).source = ScriptedDrafts(reference, engine.vocab_size)
        state = engine.build_request(params.model_copy(update={"speculative": speculative}),
                                     None, "r0")  # fmt: skip
        pieces = run(engine, [state], [0])["r0"]
        outcomes.append(
            (
                state.generated_ids,
                _parsed_calls(pieces, forced=tool_choice == "required"),
                pieces[-1].finish_reason,
                pieces[-1].usage,
            )
        )
    plain, speculated = outcomes
    assert speculated == plain
    tokens, calls, finish_reason, usage = plain
    assert [name for name, _ in calls] == [wanted] and finish_reason == "stop"
    assert usage is not None and usage.completion_tokens == len(tokens)
    counters = speculation(engine).counters
    assert counters.verify_rounds > 0 and 0 < counters.accepted_tokens < counters.drafted_tokens


# --- cancellation mid-draft -----------------------------------------------------------------

# A phrase repeated: n-gram drafts from the first decode step on (the prompt holds matches).
REPEATING = "one two three four five six. one two three four five six. one two three four five"


@pytest.fixture(scope="module")
def draft_dir(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return noisy_copy(tiny_model_dir, tmp_path_factory.mktemp("cancel") / "draft", DRAFT_NOISE)


@pytest.mark.parametrize("source", ["ngram", "draft_model"])
def test_a_request_cancelled_mid_draft_frees_its_slot_and_draft_state(
    tiny_model_dir: Path, draft_dir: Path, float32_kv: None, source: str
) -> None:
    options = {"draft_model": draft_dir} if source == "draft_model" else {}
    engine = load(tiny_model_dir, **options)
    drafts = speculation(engine).source
    assert (source == "draft_model") == isinstance(drafts, DraftModelSource)
    params = request(REPEATING, temperature=0.0, max_tokens=40, speculative=True)
    reference = plain_references(engine, [params])
    scheduler = engine.scheduler
    state = engine.build_request(params, None, "cancelled")
    scheduler.add(state)
    # Step until a draft has been verified and the request is still running.
    for _ in range(60):
        engine.step()
        if speculation(engine).counters.verify_rounds >= 2:
            break
    assert speculation(engine).counters.verify_rounds >= 2 and not state.finished
    assert 0 < len(state.generated_ids) < 40
    assert engine.cancel("cancelled")
    assert scheduler._running == [] and not engine.has_work
    assert scheduler._cache.occupied == 0  # its slot is free
    if isinstance(drafts, DraftModelSource):
        assert drafts.held_tokens("cancelled") == [] and drafts.cache.occupied == 0
    else:
        assert isinstance(drafts, NgramDraftSource) and "cancelled" not in drafts._indexes
    # The next request (same prompt: a prefix-cache hit on the cancelled one's KV) writes
    # plain decoding's tokens.
    following = engine.build_request(params, None, "r0")
    run(engine, [following], [0])
    assert following.prompt_ids + following.generated_ids == reference["r0"]


# --- the node's default ------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["on", "off"])
def test_a_request_without_the_field_follows_the_nodes_speculative_option(
    tiny_model_dir: Path, float32_kv: None, flag: str
) -> None:
    """`--speculative on|off` with `--draft-min 2 --draft-max 3`, built into the engine's
    settings as the runner does (`engine_lifecycle`): a request that does not name
    `speculative` drafts exactly when the flag is on, drafts of 2 to 3 tokens, and its
    output is plain decoding's."""
    options = parse_args(["--speculative", flag, "--draft-min", "2", "--draft-max", "3"])
    settings = SpeculationSettings(options.speculative, options.draft_min, options.draft_max)
    engine = load(tiny_model_dir, speculation=settings)
    params = request(PROMPTS[0], temperature=0.0, max_tokens=20)
    assert params.speculative is None
    reference = plain_references(engine, [params])
    asked: list[int] = []

    class Bounded(ScriptedDrafts):
        def propose(self, requests: Sequence[DraftRequest]) -> list[Draft]:
            asked.extend(wanted.max_tokens for wanted in requests)
            return super().propose(requests)

    speculation(engine).source = Bounded(reference, engine.vocab_size)
    state = engine.build_request(params, None, "r0")
    run(engine, [state], [0])
    assert state.prompt_ids + state.generated_ids == reference["r0"]
    if flag == "on":
        assert asked and max(asked) <= 3 and speculation(engine).counters.verify_rounds > 0
    else:
        assert asked == [] and speculation(engine).counters.verify_rounds == 0
