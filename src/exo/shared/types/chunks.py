"""Chunks: the streamed output of one generation, sent point-to-point to the API node
that owns the command (never through the event log)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import CommandId, FrozenModel, ModelId

FinishReason = Literal["stop", "length", "error", "cancelled"]


class Usage(FrozenModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class TokenChunk(FrozenModel):
    """One decoded piece of text (possibly several tokens when a UTF-8 character or a
    possible stop string spanned them). The last chunk of a stream has `finish_reason`
    and `usage` set; its `text` may be empty."""

    kind: Literal["TokenChunk"] = "TokenChunk"
    command_id: CommandId
    model: ModelId
    text: str
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class ToolCall(FrozenModel):
    id: str
    name: str
    arguments: str


class ToolCallChunk(FrozenModel):
    kind: Literal["ToolCallChunk"] = "ToolCallChunk"
    command_id: CommandId
    model: ModelId
    tool_calls: tuple[ToolCall, ...]
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


class ErrorChunk(FrozenModel):
    """The generation failed; always the last chunk of its stream."""

    kind: Literal["ErrorChunk"] = "ErrorChunk"
    command_id: CommandId
    model: ModelId
    error_message: str
    finish_reason: FinishReason = "error"
    status_code: int = 500
    """400 when the request itself was at fault (e.g. a prompt longer than the context)."""
    error_code: str | None = None


Chunk = Annotated[TokenChunk | ToolCallChunk | ErrorChunk, Field(discriminator="kind")]
