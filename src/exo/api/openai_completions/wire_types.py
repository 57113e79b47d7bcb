"""Wire models of OpenAI's legacy Completions API (`POST /v1/completions`): a raw prompt in,
its continuation out, no chat template. Base models (no chat template) are served only here
and through Ollama's raw generate; instruct models work too (their prompt is used raw).

As with Chat Completions (`openai_chat`), request models check types and ranges only and
ignore unknown fields; `exo.api.openai_completions.request.to_task_params` refuses, with a 400
naming the field, what a valid body asks for that exo does not do (`suffix`, `n` > 1,
`best_of` > 1, several prompts, token-id prompts, `echo` with `logprobs`). Response models
follow the `openai` SDK's `Completion` type (checked against openai 3.57:
`types/completion.py`, `completion_choice.py`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from exo.api.openai_chat.wire_types import CompletionObject, OpenAIGenerationRequest
from exo.shared.types.text_generation import MAX_TOP_LOGPROBS

# OpenAI's documented default for the legacy endpoint (vLLM keeps it too): a request
# without `max_tokens` gets at most 16 tokens. An explicit null means "until a stop".
DEFAULT_COMPLETION_MAX_TOKENS = 16


class _WireResponseModel(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


TokenIds = list[int]
CompletionPrompt = str | list[str] | list[TokenIds] | TokenIds
"""A text, a batch of texts, token ids, or a batch of token-id lists (OpenAI's four forms;
only one text is served)."""


class CompletionRequest(OpenAIGenerationRequest):
    """The body of `POST /v1/completions`.

    `logprobs` is the legacy integer form: how many most likely alternatives to report
    per position (0 reports only the sampled tokens); OpenAI caps it at 5, exo at 20 like
    Chat's `top_logprobs`. `top_k`, `min_p` and `repetition_penalty` are vLLM's
    extensions, as on Chat Completions. `user` is accepted and has no effect.
    """

    # The fields it shares with Chat Completions are `OpenAIGenerationRequest`'s.
    prompt: CompletionPrompt
    suffix: str | None = None
    max_tokens: int | None = Field(default=DEFAULT_COMPLETION_MAX_TOKENS, ge=1, strict=True)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)


CompletionFinishReason = Literal["stop", "length", "content_filter"]


class CompletionLogprobs(_WireResponseModel):
    """Legacy logprobs, one entry per generated token in each list: the token's text, its
    log probability, its most likely alternatives (text -> log probability, the sampled
    token always included, so up to `logprobs` + 1 entries) and the character offset of
    the token in the choice's `text`."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_WireResponseModel):
    text: str
    index: int = 0
    logprobs: CompletionLogprobs | None = None
    finish_reason: CompletionFinishReason | None = None


class Completion(CompletionObject[CompletionChoice]):
    """A whole response, or (streaming) one `text_completion` chunk: then `text` is the new
    piece and `finish_reason` is set on the last chunk only."""

    object: Literal["text_completion"] = "text_completion"
