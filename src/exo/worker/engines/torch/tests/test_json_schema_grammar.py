"""Forced tool calls whose arguments follow the tool's parameter schema: the compiled
schema subset, the character-level recogniser, the token-level constraint on the real
tokenizer, and the engine with a tiny nudged model."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from exo.shared.models.cards import card_from_local_directory
from exo.shared.types.shards import ShardMetadata
from exo.shared.types.text_generation import NamedToolChoice, ToolDefinition
from exo.worker.engines.torch.decoding.constraints import (
    TokenConstraint,
    ToolCallRecognizer,
    parse_forced_tool_call,
    tool_call_constraint,
)
from exo.worker.engines.torch.decoding.json_schema_grammar import (
    SchemaJsonRecognizer,
    compile_arguments_schema,
    compile_document_schema,
)
from exo.worker.engines.torch.decoding.sampling import Sampler
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.vocabulary import TokenVocabulary
from exo.worker.engines.torch.engine import TorchEngine
from exo.worker.engines.torch.tests.conftest import save_tiny_llama
from exo.worker.engines.torch.tests.test_engine import request
from exo.worker.engines.torch.tests.test_engine_features import (
    nudged_engine,  # noqa: F401  (a fixture used below)
    text_of,
)

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "City name"},
        "days": {"type": "integer"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "temperature": {"type": "number"},
        "hourly": {"type": "boolean"},
        "note": {"type": ["string", "null"]},
        "tags": {"type": "array", "items": {"type": "string"}},
        "location": {
            "type": "object",
            "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
            "required": ["lat", "lon"],
        },
        "extra": {"description": "no type: any value"},
        "level": {"enum": [1, 12, "x", None, True]},
        "choice": {"anyOf": [{"type": "string"}, {"type": "integer"}]},
        "matrix": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
        "anything": {"type": "array"},
    },
    "required": ["city"],
}


def recognizer_after(schema: dict[str, Any], text: str) -> SchemaJsonRecognizer | None:
    """The arguments recogniser after `text`, or None if it rejects a character."""
    recognizer = SchemaJsonRecognizer(compile_arguments_schema(schema), 2)
    return recognizer if recognizer.feed_text(text) else None


COMPLETE = [
    '{"city": "Paris"}',
    '{"city": "Paris", "days": 3}',
    '{"days": -0, "city": ""}',
    '{"city": "P", "unit": "celsius"}',
    '{"city": "P", "unit": "fahrenheit"}',
    '{"city": "P", "temperature": -1.5e3}',
    '{"city": "P", "temperature": 2}',
    '{"city": "P", "hourly": false}',
    '{"city": "P", "note": null}',
    '{"city": "P", "note": "n"}',
    '{"city": "P", "tags": []}',
    '{"city": "P", "tags": ["a", "b"]}',
    '{"city": "P", "location": {"lon": 1, "lat": 2.5}}',
    '{"city": "P", "extra": {"type": [1, {"a": null}]}}',
    '{"city": "P", "level": 1}',
    '{"city": "P", "level": 12}',
    '{"city": "P", "level": "x"}',
    '{"city": "P", "level": null}',
    '{"city": "P", "level": true}',
    '{"level": 1, "city": "P"}',
    '{"city": "P", "choice": [true]}',
    '{"city": "P", "matrix": [[1, 2], [], [-3]]}',
    '{"city": "P", "anything": [1, "a", {"k": []}]}',
    '{ "city" : "P" }',
    '{"city": "P\\u00e9 漢"}',
]
INCOMPLETE = [
    "{",
    '{"ci',
    '{"city"',
    '{"city": "Paris"',
    '{"days": 3',  # "city" is still required
    '{"city": "P", "level": 1',  # could still become 12
    '{"city": "P", "location": {"lat": 1',
]
REJECTED = [
    "[]",
    "{}",  # required "city" missing
    '{"days": 3}',
    '{"type": "function"}',  # an undeclared key
    '{"city": "a", "city": "b"}',  # a key twice
    '{"City": "a"}',
    '{"city": 3}',
    '{"city": "a", "days": 3.5}',  # integer, not number
    '{"city": "a", "days": 1e3}',
    '{"city": "a", "days": "3"}',
    '{"city": "a", "days": 03}',
    '{"city": "a", "unit": "kelvin"}',
    '{"city": "a", "unit": "celsiusx"}',
    '{"city": "a", "unit": "celsius"x}',
    '{"city": "a", "hourly": 1}',
    '{"city": "a", "hourly": "true"}',
    '{"city": "a", "note": 1}',
    '{"city": "a", "note": false}',
    '{"city": "a", "tags": [1]}',
    '{"city": "a", "tags": {}}',
    '{"city": "a", "location": {"lat": 1}}',  # nested required
    '{"city": "a", "location": {"lat": 1, "alt": 2}}',  # nested undeclared key
    '{"city": "a", "level": 2}',
    '{"city": "a", "level": 123}',
    '{"city": "a", "level": false}',
    '{"city": "a", "level": "y"}',
    '{"city": "a", "matrix": [[1.5]]}',
    '{"city": "a",}',
    '{"city": "a"}}',
]


@pytest.mark.parametrize("text", COMPLETE)
def test_complete_arguments_are_accepted(text: str) -> None:
    assert validates(json.loads(text), WEATHER)  # the table agrees with the validator
    recognizer = recognizer_after(WEATHER, text)
    assert recognizer is not None and recognizer.is_complete


@pytest.mark.parametrize("text", INCOMPLETE)
def test_prefixes_are_accepted_but_not_complete(text: str) -> None:
    recognizer = recognizer_after(WEATHER, text)
    assert recognizer is not None and not recognizer.is_complete


def no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _value in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate key in {keys}")
    return dict(pairs)


@pytest.mark.parametrize("text", REJECTED)
def test_arguments_outside_the_schema_are_rejected(text: str) -> None:
    with contextlib.suppress(ValueError):  # not JSON, or a key twice
        assert not validates(json.loads(text, object_pairs_hook=no_duplicate_keys), WEATHER)
    assert recognizer_after(WEATHER, text) is None


def test_whitespace_runs_stay_bounded() -> None:
    assert recognizer_after(WEATHER, '{"city": "a"  }') is not None
    assert recognizer_after(WEATHER, '{"city": "a"   }') is None


@pytest.mark.parametrize(
    ("schema", "accepted", "rejected"),
    [
        # No parameters: only `{}`.
        ({}, ["{}", "{ }"], ['{"a": 1}']),
        ({"type": "object"}, ["{}"], ['{"a": 1}']),
        ({"type": "object", "properties": {}}, ["{}"], ['{"a": 1}', '{"']),
        # Declared keys even when other keys are allowed by the schema.
        (
            {"type": "object", "properties": {"a": {"type": "null"}}, "additionalProperties": True},
            ['{"a": null}', "{}"],
            ['{"b": 1}'],
        ),
        # Open objects without declared keys, and combinators: any object.
        ({"type": "object", "additionalProperties": {"type": "string"}}, ['{"k": [1]}'], ["[]"]),
        ({"anyOf": [{"type": "object"}]}, ['{"k": 1}'], ["1"]),
        # A one-key object: no comma once its key is written.
        ({"properties": {"x": {"type": "integer"}}}, ['{"x": 1}'], ['{"x": 1,', '{"x": 1.0}']),
        # An undeclared required key: written with any value.
        (
            {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
            ['{"b": [1]}', '{"a": "", "b": 2}'],
            ['{"a": ""}', '{"c": 1}'],
        ),
        # Enum strings JSON-escaped (ASCII); enum filtered by type; empty enum: any value.
        (
            {"properties": {"e": {"enum": ['a"b', "é"]}}},
            ['{"e": "a\\"b"}', '{"e": "\\u00e9"}'],
            ['{"e": "é"}', '{"e": "a"}'],
        ),
        (
            {"properties": {"e": {"type": "string", "enum": ["a", 1]}}},
            ['{"e": "a"}'],
            ['{"e": 1}'],
        ),
        ({"properties": {"e": {"enum": []}}}, ['{"e": [false]}'], []),
        ({"properties": {"c": {"const": 7}}}, ['{"c": 7}'], ['{"c": 8}', '{"c": 70}']),
        # integer and number listed together: any number.
        ({"properties": {"n": {"type": ["integer", "number"]}}}, ['{"n": 1.5}'], ['{"n": "1"}']),
        # Properties without a type: any value; $ref: any value.
        ({"properties": {"o": {"properties": {"a": {}}}}}, ['{"o": 3}'], ['{"p": 3}']),
        ({"properties": {"r": {"$ref": "#/$defs/x"}}}, ['{"r": {"z": 1}}'], []),
        # A property whose schema is false is never written (required or not).
        (
            {"type": "object", "properties": {"a": False, "b": {"type": "integer"}}},
            ['{"b": 1}', "{}"],
            ['{"a', '{"b": 1, "a'],
        ),
        ({"properties": {"a": False}, "required": ["a"]}, ["{}"], ['{"a']),
    ],
)
def test_schema_shapes(schema: dict[str, Any], accepted: list[str], rejected: list[str]) -> None:
    for text in accepted:
        recognizer = recognizer_after(schema, text)
        assert recognizer is not None and recognizer.is_complete, text
    for text in rejected:
        assert recognizer_after(schema, text) is None, text


def test_a_response_schema_property_false_is_never_written() -> None:
    schema = {
        "type": "array",
        "items": {"type": "object", "properties": {"a": False, "ab": {"type": "null"}}},
    }
    compiled = compile_document_schema(schema)
    assert SchemaJsonRecognizer(compiled, 2).feed_text('[{"ab": null}]')
    for text in ('[{"a"', '[{"a":', '[{"ab": null, "a'):
        assert not SchemaJsonRecognizer(compiled, 2).feed_text(text), text


def test_copy_is_independent() -> None:
    original = recognizer_after(WEATHER, '{"city": "a", "location": {"lat": 1')
    assert original is not None
    branch = original.copy()
    assert branch.feed_text(', "lon": 2}}') and branch.is_complete
    assert not original.is_complete
    assert original.feed_text(', "lon": 3}, "days": 2}') and original.is_complete


def test_the_written_name_selects_the_schema() -> None:
    tools = [
        ToolDefinition(name="get_weather", parameters=WEATHER),
        ToolDefinition(
            name="search",
            parameters={"properties": {"query": {"type": "string"}}, "required": ["query"]},
        ),
        ToolDefinition(name="ping"),
    ]

    def accepts(text: str) -> bool:
        recognizer = ToolCallRecognizer(tools)
        return all(recognizer.feed(character) for character in text) and recognizer.is_complete

    assert accepts('{"name": "get_weather", "arguments": {"city": "Oslo"}}')
    assert accepts('{"name": "search", "arguments": {"query": "Oslo"}}')
    assert accepts('{"name": "ping", "arguments": {}}')
    assert not accepts('{"name": "search", "arguments": {"city": "Oslo"}}')
    assert not accepts('{"name": "get_weather", "arguments": {"query": "Oslo"}}')
    assert not accepts('{"name": "ping", "arguments": {"a": 1}}')


# --- a validator for the supported subset (what a generated call must satisfy) -----------


def validates(value: Any, schema: Any) -> bool:
    """`value` satisfies `schema` as the recogniser reads it: declared keys only, integer
    syntax for integers, anything for unsupported schemas."""
    if not isinstance(schema, dict) or any(
        keyword in schema for keyword in ("anyOf", "oneOf", "allOf", "$ref", "not", "if")
    ):
        return True
    if "enum" in schema or "const" in schema:
        options = schema["enum"] if "enum" in schema else [schema["const"]]
        if options:
            return any(json.dumps(value) == json.dumps(option) for option in options)
        return True
    if "type" not in schema:
        return True
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    return any(matches_type(value, name, schema) for name in types)


def matches_type(value: Any, name: str, schema: dict[str, Any]) -> bool:
    match name:
        case "string":
            return isinstance(value, str)
        case "integer":
            return isinstance(value, int) and not isinstance(value, bool)
        case "number":
            return isinstance(value, int | float) and not isinstance(value, bool)
        case "boolean":
            return isinstance(value, bool)
        case "null":
            return value is None
        case "array":
            return isinstance(value, list) and all(
                validates(item, schema.get("items")) for item in value
            )
        case "object":
            if not isinstance(value, dict):
                return False
            if "properties" not in schema:
                return True
            properties: dict[str, Any] = schema["properties"]
            required = set(schema.get("required", ()))
            return (
                required <= set(value)
                and set(value) <= set(properties) | required
                and all(validates(item, properties.get(key)) for key, item in value.items())
            )
        case _:
            return False


def validates_arguments(arguments: Any, parameters: dict[str, Any]) -> bool:
    if not isinstance(arguments, dict):
        return False
    if not parameters or parameters == {"type": "object"}:
        return arguments == {}
    return validates(arguments, {**parameters, "type": "object"})


def test_the_validator_can_fail() -> None:
    assert not validates({"city": 1}, WEATHER)
    assert not validates({"city": "a", "x": 1}, WEATHER)
    assert not validates({"city": "a", "days": True}, WEATHER)
    assert not validates_arguments({"a": 1}, {})


# --- token level (the real SmolLM2 tokenizer) ---------------------------------------------


@pytest.fixture(scope="module")
def vocabulary(real_tokenizer: Any) -> TokenVocabulary:
    return TokenVocabulary(real_tokenizer, len(real_tokenizer))


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


WEATHER_TOOLS = (
    ToolDefinition(name="get_weather", parameters=WEATHER),
    ToolDefinition(
        name="search",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query", "limit"],
        },
    ),
)


def test_a_tokenized_call_is_followed_and_a_wrong_key_is_refused(
    vocabulary: TokenVocabulary, real_tokenizer: Any
) -> None:
    eos = frozenset({real_tokenizer.eos_token_id})
    good = (
        '{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3, "unit": '
        '"celsius", "location": {"lat": 47.4, "lon": 8.5}, "tags": ["a"]}}'
    )
    constraint = tool_call_constraint(WEATHER_TOOLS, vocabulary, eos)
    for token_id in encode(real_tokenizer, good):
        assert constraint.allowed(token_id), real_tokenizer.decode([token_id])
        constraint.advance(token_id)
    assert constraint.is_complete and constraint.allowed(real_tokenizer.eos_token_id)

    bad = '{"name": "get_weather", "arguments": {"type": "function"}}'
    constraint = tool_call_constraint(WEATHER_TOOLS, vocabulary, eos)
    refused = None
    for token_id in encode(real_tokenizer, bad):
        if not constraint.allowed(token_id):
            refused = real_tokenizer.decode([token_id])
            break
        constraint.advance(token_id)
    assert refused is not None and "type" in refused


def brute_force_allowed(constraint: TokenConstraint, size: int) -> list[int]:
    return [token_id for token_id in range(size) if constraint.allowed(token_id)]


@pytest.mark.parametrize(
    "prefix",
    [
        '{"name": "get_weather", "arguments": ',
        '{"name": "get_weather", "arguments": {"',
        '{"name": "get_weather", "arguments": {"city": "a", "unit": ',
        '{"name": "get_weather", "arguments": {"city": "a", "days": 1',
        '{"name": "search", "arguments": {"query": "q", "limit": 2',
    ],
)
def test_allowed_tokens_equals_checking_every_token(
    vocabulary: TokenVocabulary, real_tokenizer: Any, prefix: str
) -> None:
    constraint = tool_call_constraint(
        WEATHER_TOOLS, vocabulary, frozenset({real_tokenizer.eos_token_id})
    )
    for token_id in encode(real_tokenizer, prefix):
        constraint.advance(token_id)
    allowed = sorted(constraint.allowed_tokens())
    assert allowed and allowed == brute_force_allowed(constraint, vocabulary.size)


RANDOM_SCHEMAS: list[dict[str, Any]] = [
    WEATHER,
    {},
    {
        "type": "object",
        "properties": {
            "ids": {"type": "array", "items": {"type": "integer"}},
            "mode": {"enum": ["fast", "slow", 3]},
            "flag": {"type": ["boolean", "null"]},
            "inner": {
                "type": "object",
                "properties": {"x": {"type": "number"}, "y": {"type": "string"}},
                "required": ["x", "y"],
            },
        },
        "required": ["ids", "mode", "flag", "inner"],
    },
]


@pytest.mark.parametrize("schema_index", range(len(RANDOM_SCHEMAS)))
def test_random_logits_give_valid_arguments(
    vocabulary: TokenVocabulary, real_tokenizer: Any, schema_index: int
) -> None:
    """A constrained sampler on random logits (a random model) writes a call whose arguments
    parse and validate; logits favouring closing characters make it finish."""
    parameters = RANDOM_SCHEMAS[schema_index]
    tools = [ToolDefinition(name="f", parameters=parameters)]
    eos = frozenset({real_tokenizer.eos_token_id})
    generator = torch.Generator().manual_seed(schema_index)
    closers = [encode(real_tokenizer, text)[0] for text in ('"', "}", "]", ",", "1")]
    for run in range(4):
        constraint = tool_call_constraint(tools, vocabulary, eos)
        sampler = Sampler(SamplingParams(temperature=1.0, seed=run))
        tokens: list[int] = []
        for _step in range(600):
            logits = torch.randn(vocabulary.size, generator=generator) * 3
            logits[closers] += 8.0 if len(tokens) > 15 else 0.0
            token = sampler.sample(logits, constraint)
            constraint.advance(token)
            tokens.append(token)
            if constraint.is_complete:
                break
        text = real_tokenizer.decode(tokens)
        assert constraint.is_complete, text
        name, arguments = parse_forced_tool_call(text)
        assert name == "f"
        assert validates_arguments(json.loads(arguments), parameters), text


# --- the engine (tiny random-weight model, nudged towards closing characters) -------------


@pytest.fixture(scope="module")
def roomy_model_dir(tmp_path_factory: pytest.TempPathFactory, real_model_dir: Path) -> Path:
    """The tiny model with room for a prompt that lists tools with schemas (~250 tokens)."""
    directory = tmp_path_factory.mktemp("tiny-llama-1k")
    return save_tiny_llama(directory, real_model_dir, max_position_embeddings=1024)


@pytest.fixture()
def tiny_engine(roomy_model_dir: Path) -> TorchEngine:
    """Overrides conftest's for this module (`nudged_engine` builds on it)."""
    card = card_from_local_directory(roomy_model_dir)
    shard = ShardMetadata(
        sharding="pipeline",
        model_card=card,
        device_rank=0,
        world_size=1,
        start_layer=0,
        end_layer=card.n_layers,
    )
    return TorchEngine.load(roomy_model_dir, shard, weight_dtype="float32")


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_forced_call_arguments_follow_the_schema(
    nudged_engine: TorchEngine,  # noqa: F811
    seed: int,
) -> None:
    search = ToolDefinition(
        name="search",
        parameters={
            "type": "object",
            "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
            "required": ["query"],
        },
    )
    weather = ToolDefinition(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "hourly": {"type": "boolean"}},
            "required": ["city", "hourly"],
        },
    )
    tools = (weather, search)
    params = request("Weather?", tools=tools, tool_choice="required", temperature=1.0, seed=seed)
    pieces = list(nudged_engine.generate(params))
    text = text_of(pieces)
    assert pieces[-1].finish_reason == "stop", text
    name, arguments = parse_forced_tool_call(text)
    parameters = {tool.name: tool.parameters for tool in tools}[name]
    assert validates_arguments(json.loads(arguments), parameters), text


def test_named_tool_without_parameters_gets_empty_arguments(
    nudged_engine: TorchEngine,  # noqa: F811
) -> None:
    tools = (ToolDefinition(name="ping"), ToolDefinition(name="search", parameters=WEATHER))
    params = request("Ping", tools=tools, tool_choice=NamedToolChoice(name="ping"), temperature=0.0)
    pieces = list(nudged_engine.generate(params))
    assert pieces[-1].finish_reason == "stop"
    assert parse_forced_tool_call(text_of(pieces)) == ("ping", "{}")
