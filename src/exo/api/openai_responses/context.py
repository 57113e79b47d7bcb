"""The request fields one OpenAI Responses response echoes back: `ResponseContext`,
built once per request by `response_context` and carried by every response object and
lifecycle event of that request (see `response` and `assembler`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Literal

from exo.api.openai_responses.request import function_tools, tool_names
from exo.api.openai_responses.request_types import ResponsesRequest
from exo.api.openai_responses.response_types import (
    FunctionToolChoiceEcho,
    FunctionToolEcho,
    ReasoningEcho,
    TextConfigEcho,
    TextFormatEcho,
)
from exo.shared.types.text_generation import NamedToolChoice, TextGenerationTaskParams


@dataclass(frozen=True, slots=True)
class ResponseContext:
    """What every response object of one request carries besides its output: its id,
    creation time and the request fields OpenAI echoes back."""

    response_id: str
    created_at: int
    model: str
    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    reasoning: ReasoningEcho
    temperature: float | None
    text: TextConfigEcho
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoiceEcho
    tools: tuple[FunctionToolEcho, ...]
    top_logprobs: int | None
    top_p: float | None
    user: str | None
    metadata: dict[str, str] = field(default_factory=dict)
    tool_names: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    """The model's name of each function -> (namespace, name), as the client names it."""

    def client_tool_name(self, model_name: str) -> tuple[str | None, str]:
        """(namespace or None, name) of the function the model called `model_name`."""
        return self.tool_names.get(model_name, (None, model_name))

    @property
    def id_hex(self) -> str:
        return self.response_id.split("_", 1)[-1]

    def echoed_fields(self) -> dict[str, Any]:
        """The `ResponseObject` fields of the request fields echoed back."""
        echoed = {name: getattr(self, name) for name in _ECHOED_FIELDS}
        return {**echoed, "tools": list(self.tools), "metadata": dict(self.metadata)}


_ECHOED_FIELDS = tuple(
    entry.name
    for entry in fields(ResponseContext)
    if entry.name not in ("response_id", "created_at", "tool_names")
)


def _format_echo(request: ResponsesRequest, params: TextGenerationTaskParams) -> TextFormatEcho:
    text_format = request.text.format if request.text else None
    if params.response_format != "json_schema" or text_format is None:
        return TextFormatEcho(type=params.response_format)
    return TextFormatEcho(
        type="json_schema",
        name=text_format.name,
        schema_=params.json_schema,
        description=text_format.description,
        strict=text_format.strict,
    )


def response_context(
    request: ResponsesRequest, params: TextGenerationTaskParams, response_id: str, created_at: int
) -> ResponseContext:
    """The echo fields of `request` (converted to `params`).

    Args:
        response_id: `response_id("resp_", command_id)`.
        created_at: Unix time, seconds.
    """
    tool_choice: Literal["auto", "none", "required"] | FunctionToolChoiceEcho
    if isinstance(params.tool_choice, NamedToolChoice):
        tool_choice = FunctionToolChoiceEcho(name=params.tool_choice.name)
    else:
        tool_choice = params.tool_choice
    reasoning = request.reasoning
    return ResponseContext(
        response_id=response_id,
        created_at=created_at,
        model=request.model,
        instructions=request.instructions,
        max_output_tokens=request.max_output_tokens,
        parallel_tool_calls=params.parallel_tool_calls,
        reasoning=ReasoningEcho(
            effort=reasoning.effort if reasoning else None,
            summary=(reasoning.summary or reasoning.generate_summary) if reasoning else None,
        ),
        temperature=request.temperature,
        text=TextConfigEcho(
            format=_format_echo(request, params),
            verbosity=request.text.verbosity if request.text else None,
        ),
        tool_choice=tool_choice,
        tools=tuple(
            FunctionToolEcho(
                name=tool.name,
                description=tool.description,
                parameters=tool.parameters,
                strict=tool.strict,
            )
            for tool in function_tools(request)
        ),
        top_logprobs=request.top_logprobs,
        top_p=request.top_p,
        user=request.user,
        metadata=dict(request.metadata or {}),
        tool_names=tool_names(request),
    )
