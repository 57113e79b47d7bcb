"""The internal request: a conversation or a raw prompt, exactly one of the two."""

import pytest
from pydantic import ValidationError

from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import (
    ChatMessage,
    NamedToolChoice,
    TextGenerationTaskParams,
    ToolDefinition,
)

MODEL = ModelId("org/model")
HELLO = (ChatMessage(role="user", content="hello"),)


def test_a_conversation_or_a_raw_prompt() -> None:
    chat = TextGenerationTaskParams(model=MODEL, messages=HELLO)
    raw = TextGenerationTaskParams(model=MODEL, prompt="Once upon a time")
    assert not chat.is_raw and chat.prompt is None
    assert raw.is_raw and raw.messages == ()
    # An empty raw prompt is still a raw prompt (the engine starts from BOS).
    assert TextGenerationTaskParams(model=MODEL, prompt="").is_raw


@pytest.mark.parametrize(
    "fields",
    [{}, {"messages": ()}, {"messages": HELLO, "prompt": "and a prompt"}],
    ids=["neither", "empty-conversation", "both"],
)
def test_exactly_one_input(fields: dict[str, object]) -> None:
    with pytest.raises(ValidationError, match="exactly one of the two"):
        TextGenerationTaskParams(model=MODEL, **fields)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"tools": (ToolDefinition(name="f"),)}, "tools"),
        (
            {"tools": (ToolDefinition(name="f"),), "tool_choice": NamedToolChoice(name="f")},
            "tools",
        ),
        ({"enable_thinking": True}, "enable_thinking"),
        ({"reasoning_effort": "low"}, "reasoning_effort"),
    ],
)
def test_conversation_features_are_refused_with_a_raw_prompt(
    fields: dict[str, object], named: str
) -> None:
    with pytest.raises(ValidationError, match=f"{named} needs a conversation"):
        TextGenerationTaskParams(model=MODEL, prompt="x", **fields)  # type: ignore[arg-type]


def test_a_raw_prompt_may_be_constrained_to_json() -> None:
    params = TextGenerationTaskParams(model=MODEL, prompt="{", response_format="json_object")
    assert params.response_format == "json_object"
