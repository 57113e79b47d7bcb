"""A request continued after tokens it generated elsewhere (`forced_token_ids`, mid-stream
failover) goes on exactly as the unbroken run: tiny float32 model, float32 KV, greedy and
seeded sampling, with penalties, a stop string and a JSON constraint advanced over the
forced tokens. On the default model (int4 weights, bfloat16 KV) the promise is weaker
(docs/cluster.md, "Streams that survive a node loss"): a greedy continuation equals a fresh
greedy run given the same prompt and forced prefix, checked against a raw prompt holding
exactly those tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.common import ModelId
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine import GeneratedPiece, TorchEngine
from exo.worker.engines.torch.tests.conftest import save_tiny_llama

NEW_TOKENS = 14
# The default model's run: long enough that the longest forced prefix leaves tokens to go.
DEFAULT_MODEL_TOKENS = 24


@pytest.fixture(scope="module")
def varied_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """The tiny Llama with weights drawn wider (std 0.3, not 0.02): its greedy text varies
    token to token, where the usual tiny model repeats one newline."""
    directory = tmp_path_factory.mktemp("varied-tiny-llama")
    return save_tiny_llama(directory, real_model_dir, initializer_range=0.3)


@pytest.fixture()
def engine(float32_kv: None, varied_model_dir: Path) -> TorchEngine:
    card = card_from_local_directory(varied_model_dir)
    shard = ShardMetadata(
        sharding="pipeline", model_card=card, device_rank=0, world_size=1, start_layer=0,
        end_layer=card.n_layers,
    )  # fmt: skip
    loaded = TorchEngine.load(varied_model_dir, shard, weight_dtype="float32")
    loaded.eos_token_ids = frozenset({-1})  # random weights: never stop early
    return loaded


def request(**fields: Any) -> TextGenerationTaskParams:
    settings: dict[str, Any] = {"temperature": 0.0, "max_tokens": NEW_TOKENS, **fields}
    return TextGenerationTaskParams(
        model=ModelId("m"),
        messages=(ChatMessage(role="user", content="Tell me about lighthouses"),),
        **settings,
    )


def tokens_of(pieces: list[GeneratedPiece]) -> list[int]:
    return [token for piece in pieces for token in piece.token_ids]


def text_of(pieces: list[GeneratedPiece]) -> str:
    return "".join(piece.text for piece in pieces)


def continued(
    engine: TorchEngine, params: TextGenerationTaskParams, forced: list[int]
) -> tuple[list[GeneratedPiece], list[GeneratedPiece]]:
    """The forced pieces (already streamed) and the new ones of `params` continued after
    `forced`."""
    handle = engine.submit(params.model_copy(update={"forced_token_ids": tuple(forced)}))
    engine.cancel(handle.request_id)
    new = list(engine.generate(params.model_copy(update={"forced_token_ids": tuple(forced)})))
    return list(handle.forced_pieces), new


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"temperature": 1.0, "seed": 7},
        {"temperature": 0.8, "top_p": 0.9, "seed": 11},
        {"frequency_penalty": 1.5, "presence_penalty": 0.5, "repetition_penalty": 1.3},
    ],
    ids=["greedy", "seeded", "seeded-top-p", "penalties"],
)
@pytest.mark.parametrize("forced_count", [1, 5, 11], ids=lambda count: f"{count}-pieces")
def test_a_continued_request_equals_the_unbroken_run(
    engine: TorchEngine, fields: dict[str, Any], forced_count: int
) -> None:
    params = request(**fields)
    unbroken = list(engine.generate(params))
    unbroken_tokens = tokens_of(unbroken)
    assert len(unbroken_tokens) == NEW_TOKENS
    # The API forces the tokens of whole streamed pieces (a piece may hold several tokens:
    # a character or a possible stop string spanning them).
    streamed = unbroken[: min(forced_count, len(unbroken) - 1)]
    forced_pieces, new = continued(engine, params, tokens_of(streamed))
    assert tokens_of(forced_pieces) + tokens_of(new) == unbroken_tokens
    assert text_of(forced_pieces) + text_of(new) == text_of(unbroken)
    # Usage counts the original prompt once and every generated token, forced ones too.
    assert new[-1].usage is not None and unbroken[-1].usage is not None
    assert new[-1].usage.prompt_tokens == unbroken[-1].usage.prompt_tokens
    assert new[-1].usage.completion_tokens == NEW_TOKENS
    assert new[-1].finish_reason == "length"


def test_a_stop_string_spanning_the_forced_end_is_still_found(engine: TorchEngine) -> None:
    unbroken_text = text_of(list(engine.generate(request())))
    unbroken = list(engine.generate(request()))
    forced = tokens_of(unbroken[:6])
    forced_text = text_of(unbroken[:6])
    # A stop string that starts in the forced tokens' text and ends after it.
    start = len(forced_text) - 2
    stop = unbroken_text[start : start + 5]
    assert len(stop) == 5 and unbroken_text.find(stop) == start
    params = request(stop=(stop,))
    expected = list(engine.generate(params))
    forced_pieces, new = continued(engine, params, forced)
    assert text_of(forced_pieces) + text_of(new) == text_of(expected) == unbroken_text[:start]
    assert new[-1].stop_sequence == stop and new[-1].finish_reason == "stop"


def test_a_json_constraint_continues_where_the_forced_tokens_left_it(
    engine: TorchEngine,
) -> None:
    params = request(response_format="json_object", max_tokens=24)
    unbroken = list(engine.generate(params))
    unbroken_tokens = tokens_of(unbroken)
    assert len(unbroken_tokens) >= 2 and unbroken[-1].finish_reason == "stop"
    forced_pieces, new = continued(engine, params, unbroken_tokens[:1])
    assert tokens_of(forced_pieces) + tokens_of(new) == unbroken_tokens
    assert text_of(forced_pieces) + text_of(new) == text_of(unbroken)


def test_forced_tokens_that_end_the_request_or_leave_the_vocabulary_are_refused(
    engine: TorchEngine,
) -> None:
    unbroken_tokens = tokens_of(list(engine.generate(request())))
    with pytest.raises(ValueError, match="end the request"):
        engine.submit(request(forced_token_ids=tuple(unbroken_tokens)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit(request(forced_token_ids=(engine.vocab_size,)))
    letter = engine.tokenizer.encode("hello", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match="output constraint"):
        engine.submit(request(response_format="json_object", forced_token_ids=(letter,)))
    assert not engine.has_work


def test_on_the_default_model_a_continuation_equals_a_fresh_greedy_run_given_the_prefix(
    real_engine: TorchEngine,
) -> None:
    """Greedy on SmolLM2 as shipped: the continuation after k forced tokens (the prompt
    and forced tokens prefilled together) equals a fresh greedy request whose raw prompt
    is those same token ids (the chat prompt and the forced tokens, decoded to text that
    encodes back to them), for several k. Not compared with the unbroken run: that one
    wrote the forced tokens' KV in decode steps, and a bfloat16 near-tie may go the other
    way."""
    params = request(max_tokens=DEFAULT_MODEL_TOKENS)
    unbroken = list(real_engine.generate(params))
    assert len(tokens_of(unbroken)) == DEFAULT_MODEL_TOKENS, text_of(unbroken)
    prompt_ids = real_engine.render_prompt(params).token_ids
    for pieces in (1, 6, 15):
        forced = tokens_of(unbroken[:pieces])
        _forced_pieces, new = continued(real_engine, params, forced)
        fresh_params = TextGenerationTaskParams(
            model=params.model,
            prompt=real_engine.tokenizer.decode(prompt_ids + forced),
            temperature=0.0,
            max_tokens=DEFAULT_MODEL_TOKENS - len(forced),
        )
        assert real_engine.render_prompt(fresh_params).token_ids == prompt_ids + forced
        fresh = list(real_engine.generate(fresh_params))
        assert tokens_of(new) == tokens_of(fresh), (pieces, text_of(new), text_of(fresh))
        assert new[-1].finish_reason == fresh[-1].finish_reason
        assert new[-1].usage is not None and new[-1].usage.completion_tokens == len(forced) + len(
            tokens_of(new)
        )
