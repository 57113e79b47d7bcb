"""A Kimi-K2 checkout (model type `kimi_k2`, custom code named in `auto_map`, a TikToken
`tiktoken.model` and no `tokenizer.json`) served by the engine without running any of the
repository's code: the tokenizer is built from its files (`tokenizer_loading`), the chat
template renders the prompt to Kimi's special ids, a generation runs to its end, and a reply
in Kimi K2's tool-call markup, written with the real marker ids, comes out of exo's output
parser as a tool call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from exo.chat_protocol.output_parsing import OutputParser
from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    TextGenerationTaskParams,
    ToolDefinition,
)
from exo.testing.seam import mark_model_dir
from exo.testing.tiny_kimi import kimi_token_id, save_tiny_kimi_checkout
from exo.worker.engines.parsed_generation import parse_generation
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.engine_factory import load_engine
from exo.worker.engines.torch.tests.test_distributed import make_shard

MODEL = ModelId("moonshotai/Kimi-K2-Instruct")
TOOL_REPLY = (
    "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
    "<|tool_calls_section_end|><|im_end|>"
)


@dataclass(frozen=True)
class Kimi:
    directory: Path
    engine: TorchEngine
    ranks: dict[bytes, int]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Kimi:
    directory = tmp_path_factory.mktemp("kimi-k2")
    ranks = save_tiny_kimi_checkout(directory)
    assert not (directory / "tokenizer.json").exists()
    assert json.loads((directory / "config.json").read_text())["model_type"] == "kimi_k2"
    # Prompts asking for the weather are answered with a call (random weights would not).
    mark_model_dir(directory, replies=[("Weather in Paris", TOOL_REPLY)])
    return Kimi(directory, load_engine(directory, make_shard(directory, "pipeline", 0, 1)), ranks)


def test_a_kimi_k2_checkout_serves_a_chat_completion(
    kimi: Kimi,
) -> None:
    engine, ranks = kimi.engine, kimi.ranks
    tokenizer = engine.tokenizer
    assert engine.eos_token_ids == {
        kimi_token_id(ranks, "<|im_end|>"),  # the config's
        kimi_token_id(ranks, "[EOS]"),  # the tokenizer's
    }
    params = TextGenerationTaskParams(
        model=MODEL,
        messages=(ChatMessage(role="user", content="Hello world!"),),
        temperature=0.0,
        max_tokens=6,
    )
    prompt = engine.render_prompt(params)
    assert prompt.text == (
        "<|im_user|>user<|im_middle|>Hello world!<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    assert prompt.token_ids[0] == kimi_token_id(ranks, "<|im_user|>")
    assert prompt.token_ids[-1] == kimi_token_id(ranks, "<|im_middle|>")
    assert prompt.token_ids == tokenizer.encode(prompt.text)
    pieces = list(engine.generate(params, prompt))
    final = pieces[-1]
    assert final.finish_reason in ("stop", "length")
    assert final.usage is not None and final.usage.prompt_tokens == len(prompt.token_ids)
    generated = [token for piece in pieces for token in piece.token_ids]
    assert 0 < len(generated) <= 6
    assert all(0 <= token < engine.vocab_size for token in generated)


def test_a_tool_call_in_kimi_markup_is_parsed_from_its_real_ids(
    kimi: Kimi,
) -> None:
    engine, ranks = kimi.engine, kimi.ranks
    params = TextGenerationTaskParams(
        model=MODEL,
        messages=(ChatMessage(role="user", content="Weather in Paris?"),),
        tools=(ToolDefinition(name="get_weather", parameters={"type": "object"}),),
        temperature=0.0,
        max_tokens=64,
    )
    prompt = engine.render_prompt(params)
    assert prompt.tool_call_format == "kimi_k2"
    assert kimi_token_id(ranks, "<|im_system|>") in prompt.token_ids  # the tools' turn
    pieces = list(engine.generate(params, prompt))
    generated = [token for piece in pieces for token in piece.token_ids]
    markers = [
        "<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>",
        "<|tool_call_end|>", "<|tool_calls_section_end|>",
    ]  # fmt: skip
    # The markers are their single special ids (the closing `<|im_end|>` is the EOS that
    # ends the generation and is not part of its text).
    assert [token for token in generated if token >= len(ranks)] == [
        kimi_token_id(ranks, name) for name in markers
    ]
    parser = OutputParser(
        tools=params.offered_tools,
        tool_call_format=prompt.tool_call_format,
        thinking_open=prompt.thinking_open,
        forced_tool_call=False,
    )
    outputs = list(parse_generation(pieces, parser, params))
    calls = [call for output in outputs for call in output.tool_calls]
    assert [(call.name, json.loads(call.arguments)) for call in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert "".join(output.text for output in outputs) == ""
    assert outputs[-1].finish_reason == "tool_calls"


def test_its_card_is_built_from_the_checkout(kimi: Kimi) -> None:
    """`POST /models/add` of a local directory reads the same files: a TikToken
    tokenizer counts as the checkout's tokenizer, and the card can be served."""
    card = card_from_local_directory(kimi.directory)
    assert card.cannot_serve is None and card.latent_attention is not None
