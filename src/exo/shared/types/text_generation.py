"""The one internal request type every API dialect converts into."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel, ModelId

Role = Literal["system", "user", "assistant", "tool"]


class ChatMessage(FrozenModel):
    role: Role
    content: str = ""
    name: str | None = None
    tool_call_id: str | None = None


class TextGenerationTaskParams(FrozenModel):
    """A chat generation request, dialect-independent.

    `max_tokens=None` means "until the context is full or a stop condition"; sampling
    fields left as None take the model card's defaults. `temperature == 0` is greedy.
    `top_k == 0` and `top_p == 1` and `min_p == 0` disable those filters.
    """

    model: ModelId
    messages: tuple[ChatMessage, ...] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    stop: tuple[str, ...] = ()
    stream: bool = False
