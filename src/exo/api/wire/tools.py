"""Function tools and tool choices in the forms OpenAI introduced and other dialects copied
(Chat Completions, Responses, Ollama's `tools` and exo's `tool_choice` extension), converted
once into the internal request's `ToolDefinition` and `ToolChoice`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, Protocol

from exo.api.wire.errors import InvalidRequestError
from exo.shared.json_schema import find_invalid
from exo.shared.types.text_generation import NamedToolChoice, ToolChoice, ToolDefinition


class FunctionSpec(Protocol):
    """A function tool's definition on the wire: Chat Completions' and Ollama's `function`
    of a tool (and the deprecated `functions`), a Responses function tool."""

    @property
    def name(self) -> str: ...

    @property
    def description(self) -> str | None: ...

    @property
    def parameters(self) -> dict[str, Any] | None: ...


class _NamedFunction(Protocol):
    @property
    def name(self) -> str: ...


class NamedFunctionChoice(Protocol):
    """`{"type": "function", "function": {"name": ...}}`: a tool choice forcing one
    function."""

    @property
    def function(self) -> _NamedFunction: ...


def tool_definitions(
    functions: Sequence[FunctionSpec], params: Sequence[str]
) -> tuple[ToolDefinition, ...]:
    """The internal definitions of function tools, in order; a function without a
    parameter schema takes any JSON object (`{}`).

    Args:
        functions: the tools' functions.
        params: for each function, the request field holding its parameter schema
            (`tools[0].function.parameters`), named by the error for an invalid one.

    Raises:
        InvalidRequestError: a parameter schema is not valid JSON Schema
            (`exo.shared.json_schema.find_invalid`), worded as OpenAI words it: "Invalid
            schema for function 'name': In context=('properties',), ...", code
            `invalid_function_parameters`.
    """
    for function, param in zip(functions, params, strict=True):
        problem = None if function.parameters is None else find_invalid(function.parameters)
        if problem is not None:
            raise InvalidRequestError(
                f"Invalid schema for function '{function.name}': "
                f"In context={problem.context!r}, {problem.reason}.",
                param,
                code="invalid_function_parameters",
            )
    return tuple(
        ToolDefinition(
            name=function.name,
            description=function.description,
            parameters=function.parameters or {},
        )
        for function in functions
    )


def openai_tool_choice(
    choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None,
) -> ToolChoice:
    """The internal tool choice of a Chat Completions `tool_choice` (and of Ollama's, which
    takes the same forms): absent is "auto"; "none" and "auto" without tools ask for
    nothing, as at OpenAI; whether a named function is among the tools is checked by
    `TextGenerationTaskParams`."""
    match choice:
        case None:
            return "auto"
        case "none" | "auto" | "required":
            return choice
        case _:
            return NamedToolChoice(name=choice.function.name)
