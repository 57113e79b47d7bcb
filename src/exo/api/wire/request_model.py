"""The base of every dialect's request models.

Requests face arbitrary HTTP clients, and the official SDKs, Claude Code, Codex CLI and
Open WebUI send fields a local model has no use for. A field a request model does not
declare is therefore ignored rather than refused, and logged at debug level (run `exo -v`
to see which), so that a field that silently changes nothing is at least visible. Declared
fields each have an effect, a 400, or a place on the README's list of compatibility no-ops.

Declared fields are strict (pydantic's strict mode), as OpenAI's, Anthropic's and Ollama's
servers are: no string is read as a number or boolean (`"max_tokens": "12"`, `"stream":
"yes"`), no boolean or decimal number as an integer (`true`, `2.0`), no number as a
boolean. An integer is still a valid number. Each dialect words the refusal as its
reference API does (`ErrorDialect.describe`); where a reference API converts (Ollama's
integer `options`), the field says so with its own type.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from loguru import logger
from pydantic import BaseModel, ConfigDict, Field, model_validator

# `top_k` on the OpenAI-shaped routes (Chat Completions, Completions, Responses). OpenAI has
# no `top_k`; vLLM's extension, which we follow, keeps the k most likely tokens for k >= 1,
# and takes 0 or -1 as "no top-k filter" (vLLM refuses anything below -1, and so do we).
VllmTopK = Annotated[int, Field(ge=-1)]

# exo's `speculative` extension, the same in every dialect (Ollama's under `options`):
# true / false / "auto" (`TextGenerationTaskParams.speculative`); absent: the node's default.
# Strict: a JSON boolean or the string "auto", nothing a lax bool would read as one.
Speculative = Annotated[bool, Field(strict=True)] | Literal["auto"]


@functools.cache
def _known_names(model: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for name, model_field in model.model_fields.items():
        names.add(name)
        if model_field.alias is not None:
            names.add(model_field.alias)
    return frozenset(names)


class WireRequestModel(BaseModel):
    """Frozen and strict; unknown fields are ignored and logged at debug level (see the
    module docstring). Models that keep unknown fields (`extra="allow"`) log nothing."""

    model_config = ConfigDict(frozen=True, extra="ignore", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and cls.model_config.get("extra") == "ignore":
            unknown = sorted(str(key) for key in data if key not in _known_names(cls))
            if unknown:
                logger.debug(
                    "ignoring unknown request field(s) of {}: {}",
                    cls.__name__,
                    ", ".join(name[:40] for name in unknown[:20]),
                )
        return data
