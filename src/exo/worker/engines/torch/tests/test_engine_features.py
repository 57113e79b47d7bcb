"""Penalties, logprobs and constrained decoding through the whole engine (tiny random-weight
Llama with the real tokenizer)."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from exo.shared.types.text_generation import NamedToolChoice, ToolDefinition
from exo.worker.engines.torch.batching import scheduler as scheduler_module
from exo.worker.engines.torch.decoding.constraints import JsonRecognizer, parse_forced_tool_call
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.tests.test_engine import check_stream_shape, request

# Logprobs and penalised tokens compare with transformers' float32 forward: float32 KV.
pytestmark = pytest.mark.usefixtures("float32_kv")

TOOLS = (ToolDefinition(name="get_weather"), ToolDefinition(name="search"))
PROMPT = "Hello there"


def tokens_of(pieces: list[GeneratedPiece]) -> list[int]:
    return [token for piece in pieces for token in piece.token_ids]


def text_of(pieces: list[GeneratedPiece]) -> str:
    return "".join(piece.text for piece in pieces)


@pytest.fixture(scope="module")
def reference_model(tiny_model_dir: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def reference_logits(model: PreTrainedModel, token_ids: list[int]) -> torch.Tensor:
    """`[len(token_ids), vocab]` logits of every position, recomputed from scratch."""
    with torch.inference_mode():
        logits: torch.Tensor = model(torch.tensor([token_ids])).logits[0]
        return logits


def reference_greedy(
    model: PreTrainedModel,
    prompt_ids: list[int],
    steps: int,
    penalise: Callable[[torch.Tensor, list[int], list[int]], torch.Tensor],
) -> list[int]:
    """Greedy decoding without a KV cache, logits transformed by `penalise(logits, prompt,
    generated)`."""
    generated: list[int] = []
    for _step in range(steps):
        logits = reference_logits(model, prompt_ids + generated)[-1]
        generated.append(int(penalise(logits, prompt_ids, generated).argmax()))
    return generated


# --- penalties ----------------------------------------------------------------------------


def openai_penalties(presence: float, frequency: float) -> Callable[..., torch.Tensor]:
    def penalise(logits: torch.Tensor, _prompt: list[int], generated: list[int]) -> torch.Tensor:
        scores = logits.clone()
        for token, count in Counter(generated).items():
            scores[token] -= presence + frequency * count
        return scores

    return penalise


def ctrl_penalty(penalty: float) -> Callable[..., torch.Tensor]:
    def penalise(logits: torch.Tensor, prompt: list[int], generated: list[int]) -> torch.Tensor:
        scores = logits.clone()
        for token in set(prompt) | set(generated):
            value = scores[token]
            scores[token] = value / penalty if value > 0 else value * penalty
        return scores

    return penalise


@pytest.mark.parametrize(
    ("fields", "penalise"),
    [
        ({"presence_penalty": 2.0}, openai_penalties(2.0, 0.0)),
        ({"frequency_penalty": 1.5, "presence_penalty": 0.5}, openai_penalties(0.5, 1.5)),
        ({"repetition_penalty": 10.0}, ctrl_penalty(10.0)),
    ],
)
def test_penalised_greedy_matches_a_reference_and_differs_from_plain(
    tiny_engine: TorchEngine,
    reference_model: PreTrainedModel,
    fields: dict[str, Any],
    penalise: Callable[..., torch.Tensor],
) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})  # random weights: never stop early
    params = request(PROMPT, temperature=0.0, max_tokens=12, **fields)
    ours = tokens_of(list(tiny_engine.generate(params)))
    prompt_ids = tiny_engine.encode_prompt(params.messages)
    assert ours == reference_greedy(reference_model, prompt_ids, 12, penalise)
    plain = tokens_of(list(tiny_engine.generate(request(PROMPT, temperature=0.0, max_tokens=12))))
    assert ours != plain  # the random model repeats itself unpenalised


# --- logit bias ----------------------------------------------------------------------------


def added_bias(bias: dict[int, float]) -> Callable[..., torch.Tensor]:
    def penalise(logits: torch.Tensor, _prompt: list[int], _generated: list[int]) -> torch.Tensor:
        scores = logits.clone()
        for token, value in bias.items():
            scores[token] += value
        return scores

    return penalise


def test_logit_bias_matches_a_reference_and_bans_the_greedy_token(
    tiny_engine: TorchEngine, reference_model: PreTrainedModel
) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})
    plain = tokens_of(list(tiny_engine.generate(request(PROMPT, temperature=0.0, max_tokens=8))))
    bias = {plain[0]: -100.0, 7042: 5.0}
    params = request(PROMPT, temperature=0.0, max_tokens=8, logit_bias=bias)
    ours = tokens_of(list(tiny_engine.generate(params)))
    prompt_ids = tiny_engine.encode_prompt(params.messages)
    assert ours == reference_greedy(reference_model, prompt_ids, 8, added_bias(bias))
    assert plain[0] not in ours  # banned at every step


def test_logit_bias_outside_the_vocabulary_is_a_value_error(tiny_engine: TorchEngine) -> None:
    params = request(PROMPT, max_tokens=2, logit_bias={tiny_engine.vocab_size: 1.0})
    with pytest.raises(ValueError, match="logit_bias"):
        list(tiny_engine.generate(params))


# --- logprobs -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields", [{"temperature": 0.0}, {"temperature": 1.0, "seed": 3, "repetition_penalty": 1.5}]
)
def test_logprobs_are_the_models_log_softmax(
    tiny_engine: TorchEngine, reference_model: PreTrainedModel, fields: dict[str, Any]
) -> None:
    tiny_engine.eos_token_ids = frozenset({-1})
    params = request(PROMPT, max_tokens=10, logprobs=True, top_logprobs=5, **fields)
    pieces = list(tiny_engine.generate(params))
    check_stream_shape(pieces)
    for piece in pieces:
        assert [entry.token_id for entry in piece.logprobs] == list(piece.token_ids)
    generated = tokens_of(pieces)
    entries = [entry for piece in pieces for entry in piece.logprobs]
    assert len(entries) == len(generated) == 10
    prompt_ids = tiny_engine.encode_prompt(params.messages)
    # Raw model distribution (before penalties): positions predicting each generated token.
    logits = reference_logits(reference_model, prompt_ids + generated)[len(prompt_ids) - 1 : -1]
    expected = torch.log_softmax(logits.double(), dim=-1)  # [10, vocab]
    tokenizer = tiny_engine.tokenizer
    for position, entry in enumerate(entries):
        assert math.isclose(entry.logprob, expected[position, entry.token_id], abs_tol=1e-4)
        assert entry.token == tokenizer.decode([entry.token_id])
        assert len(entry.top_logprobs) == 5
        assert [top.token_id for top in entry.top_logprobs] == expected[position].topk(
            5
        ).indices.tolist()
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert sum(math.exp(value) for value in values) <= 1.0 + 1e-6
        for top in entry.top_logprobs:
            assert math.isclose(top.logprob, expected[position, top.token_id], abs_tol=1e-4)
        if fields["temperature"] == 0.0:
            assert entry.token_id == entry.top_logprobs[0].token_id


def test_logprobs_absent_unless_asked(tiny_engine: TorchEngine) -> None:
    pieces = list(tiny_engine.generate(request(PROMPT, temperature=0.0, max_tokens=4)))
    assert all(piece.logprobs == () for piece in pieces)
    pieces = list(
        tiny_engine.generate(request(PROMPT, temperature=0.0, max_tokens=4, logprobs=True))
    )
    entries = [entry for piece in pieces for entry in piece.logprobs]
    assert len(entries) == len(tokens_of(pieces)) and all(not e.top_logprobs for e in entries)


def test_logprob_bytes_rebuild_a_split_character(tiny_engine: TorchEngine) -> None:
    ids = tiny_engine.tokenizer.encode("漢", add_special_tokens=False)
    assert len(ids) > 1  # byte-level BPE splits it
    logits = torch.zeros(tiny_engine.vocab_size)
    entries = [tiny_engine.token_logprob(logits, token_id, 0) for token_id in ids]
    assert bytes(b for entry in entries for b in entry.bytes) == "漢".encode()


# --- constrained decoding -------------------------------------------------------------------


@pytest.fixture()
def nudged_engine(tiny_engine: TorchEngine, monkeypatch: pytest.MonkeyPatch) -> TorchEngine:
    """Logits that favour a few characters. A random model almost never closes a string;
    nudging `"`, `}`, `]`, `:`, `1` makes a complete document likely within the context,
    while the constraint still decides every token."""
    bias = torch.zeros(tiny_engine.vocab_size)
    for text in ('"', "}", "]", ":", "1"):
        bias[tiny_engine.tokenizer.encode(text, add_special_tokens=False)[0]] = 12.0
    forward = scheduler_module.forward_batch
    monkeypatch.setattr(
        scheduler_module, "forward_batch", lambda *args, **kwargs: forward(*args, **kwargs) + bias
    )
    return tiny_engine


# Greedy alone would repeat one nudged token forever; the penalty breaks the loop.
@pytest.mark.parametrize(
    "fields", [{"temperature": 0.0, "frequency_penalty": 2.0}, {"temperature": 1.0, "seed": 1}]
)
def test_json_object_output_parses(nudged_engine: TorchEngine, fields: dict[str, Any]) -> None:
    for seed_offset in range(3):
        options = dict(fields)
        if "seed" in options:
            options["seed"] += seed_offset
        pieces = list(
            nudged_engine.generate(request(PROMPT, response_format="json_object", **options))
        )
        check_stream_shape(pieces)
        assert pieces[-1].finish_reason == "stop", text_of(pieces)
        assert isinstance(json.loads(text_of(pieces)), dict)


SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "unit": {"enum": ["cm", "m"]}},
    "required": ["count", "unit"],
}


@pytest.mark.parametrize(
    "fields", [{"temperature": 0.0, "frequency_penalty": 2.0}, {"temperature": 1.0, "seed": 1}]
)
def test_json_schema_output_follows_the_schema(
    nudged_engine: TorchEngine, fields: dict[str, Any]
) -> None:
    params = request(PROMPT, response_format="json_schema", json_schema=SCHEMA, **fields)
    pieces = list(nudged_engine.generate(params))
    check_stream_shape(pieces)
    assert pieces[-1].finish_reason == "stop", text_of(pieces)
    value = json.loads(text_of(pieces))
    assert set(value) == {"count", "unit"}
    assert isinstance(value["count"], int) and value["unit"] in ("cm", "m")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_tool_call_parses_with_an_offered_name(
    nudged_engine: TorchEngine, seed: int
) -> None:
    params = request(PROMPT, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    pieces = list(nudged_engine.generate(params))
    assert pieces[-1].finish_reason == "stop"
    name, arguments = parse_forced_tool_call(text_of(pieces))
    assert name in {"get_weather", "search"}
    assert isinstance(json.loads(arguments), dict)


def test_named_tool_choice_forces_that_name(nudged_engine: TorchEngine) -> None:
    params = request(
        PROMPT, tools=TOOLS, tool_choice=NamedToolChoice(name="search"), temperature=0.0
    )
    pieces = list(nudged_engine.generate(params))
    text = text_of(pieces)
    # The constraint writes the name first, whatever the random model prefers; whether the
    # arguments close before the token limit is up to the model.
    assert re.match(r'\{"name": "search", "arguments":\s*\{', text), text
    if pieces[-1].finish_reason == "stop":
        assert parse_forced_tool_call(text)[0] == "search"


def test_unnudged_random_model_output_is_a_valid_prefix(tiny_engine: TorchEngine) -> None:
    """Without help the random model rarely finishes: the output is then cut by the
    context ("length") but is still a prefix of a valid object."""
    pieces = list(
        tiny_engine.generate(
            request(PROMPT, response_format="json_object", temperature=1.0, seed=0, max_tokens=40)
        )
    )
    assert pieces[-1].finish_reason in ("stop", "length")
    recognizer = JsonRecognizer(top_level_object=True)
    assert recognizer.feed_text(text_of(pieces))


def test_json_cut_by_max_tokens_reports_length(nudged_engine: TorchEngine) -> None:
    # Greedy, so the one token is always the same: sampled, it was sometimes "{}", a whole
    # object, which rightly ends with "stop" (CI failed on that once).
    params = request(PROMPT, response_format="json_object", max_tokens=1, temperature=0.0)
    pieces = list(nudged_engine.generate(params))
    recognizer = JsonRecognizer(top_level_object=True)
    assert recognizer.feed_text(text_of(pieces)) and not recognizer.is_complete
    assert pieces[-1].finish_reason == "length"
