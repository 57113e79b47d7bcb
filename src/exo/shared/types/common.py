"""Base model and identifier types shared by every component.

Everything that crosses a process or network boundary derives from `FrozenModel`:
frozen (hashable, never mutated in place), strict (no silent coercion) and closed
(unknown fields are an error, so a typo never disappears).
"""

from __future__ import annotations

import uuid
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, GetCoreSchemaHandler
from pydantic_core import core_schema

REPR_MAX_CHARS = 80


def truncate_for_repr(text: str, limit: int = REPR_MAX_CHARS) -> str:
    """Shorten `text` for logs: keeps the head and says how much was cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}…(+{len(text) - limit} chars)"


class FrozenModel(BaseModel):
    model_config = ConfigDict(frozen=True, strict=True, extra="forbid")

    def __repr_args__(self) -> Any:
        # Long strings (prompts, generated text, base64 images) keep logs readable.
        for name, value in super().__repr_args__():
            if isinstance(value, str):
                yield name, truncate_for_repr(value)
            else:
                yield name, value


class Id(str):
    """A distinct string type per kind of identifier; `new()` makes a random one."""

    @classmethod
    def new(cls) -> Self:
        return cls(str(uuid.uuid4()))

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        return core_schema.no_info_after_validator_function(
            cls,
            core_schema.str_schema(min_length=1),
            serialization=core_schema.to_string_ser_schema(),
        )

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str.__repr__(self)})"


class NodeId(Id):
    pass


class ModelId(Id):
    pass


class InstanceId(Id):
    pass


class CommandId(Id):
    pass


class TaskId(Id):
    pass


class RunnerId(Id):
    pass
