"""A prompt over an instance's KV cache budget (not the model's context) is refused in each
dialect's own words and code, with the bound that applies where clients read a number, and
saying that it is the KV cache's and what the model's context is.

Trial of session 41 (2026-12-07): SmolLM2 (context 8,192) placed under `--kv-cache-tokens
1024` answered a 10,031-token prompt with "This model's maximum context length is 1024
tokens" (OpenAI), "prompt is too long: 10031 tokens > 1024 maximum" (Claude) and "(10031
tokens > 1024)" (Ollama): the model's context misstated, the flag that set it unsaid.
"""

from __future__ import annotations

import re

import pytest

from exo.api.claude_messages.routes import ERROR_DIALECT as CLAUDE_ERRORS
from exo.api.ollama.routes import ERROR_DIALECT as OLLAMA_ERRORS
from exo.api.openai_completions.routes import ERROR_DIALECT as COMPLETIONS_ERRORS
from exo.api.openai_responses.routes import ERROR_DIALECT as RESPONSES_ERRORS
from exo.api.wire.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    OPENAI_ERRORS,
    ContextOverflow,
    context_overflow,
)
from exo.shared.types.common import ModelId
from exo.shared.types.text_generation import ChatMessage, TextGenerationTaskParams
from exo.worker.engines.torch.engine_requests import PromptTooLongError, reply_budget

PROMPT_TOKENS = 10_031
CONTEXT = 8_192
KV_BUDGET = 1_024
# How clients read the numbers: Claude Code's compaction and the OpenAI sentence's readers
# (LiteLLM matches the phrase; others take the number after it), Ollama's the prefix.
CLAUDE_NUMBERS = re.compile(r"prompt is too long: (\d+) tokens > (\d+) maximum")
OPENAI_NUMBERS = re.compile(
    r"maximum context length is (\d+) tokens.*However, your messages resulted in (\d+) tokens"
)
OLLAMA_NUMBERS = re.compile(
    r"^the input length exceeds the context length \((\d+) tokens > (\d+)\)"
)


def engine_message(token_limit: int, context_tokens: int | None = None) -> str:
    """The engine's refusal of a `PROMPT_TOKENS` prompt (`reply_budget`)."""
    params = TextGenerationTaskParams(
        model=ModelId("m"),
        messages=(ChatMessage(role="user", content="hi"),),
        context_tokens=context_tokens,
    )
    with pytest.raises(PromptTooLongError) as refused:
        reply_budget([1] * PROMPT_TOKENS, params, token_limit, CONTEXT)
    return str(refused.value)


def rendered(message: str) -> tuple[str, str, str]:
    """The OpenAI, Claude and Ollama error messages for the engine's `message`."""
    args = (400, "invalid_request_error", message, "messages", CONTEXT_LENGTH_EXCEEDED)
    openai = OPENAI_ERRORS.render(*args)["error"]
    assert openai["code"] == CONTEXT_LENGTH_EXCEEDED
    return (
        openai["message"],
        CLAUDE_ERRORS.render(*args)["error"]["message"],
        OLLAMA_ERRORS.render(*args)["error"],
    )


def test_the_kv_budget_is_named_as_the_bound_and_the_numbers_stay_readable() -> None:
    message = engine_message(KV_BUDGET)
    assert context_overflow(message, CONTEXT_LENGTH_EXCEEDED) == ContextOverflow(
        PROMPT_TOKENS, KV_BUDGET, "kv_cache", CONTEXT
    )
    openai, claude, ollama = rendered(message)
    for text in (openai, claude, ollama):
        assert "KV cache" in text and "--kv-cache-tokens" in text, text
        assert f"the model's context is {CONTEXT} tokens" in text, text
    # The bound that applies is where clients read it: a client that shortens its prompt
    # to that number fits.
    openai_numbers = OPENAI_NUMBERS.search(openai)
    assert openai_numbers is not None, openai
    assert openai_numbers.groups() == (str(KV_BUDGET), str(PROMPT_TOKENS))
    claude_numbers = CLAUDE_NUMBERS.search(claude)
    assert claude_numbers is not None, claude
    assert claude_numbers.groups() == (str(PROMPT_TOKENS), str(KV_BUDGET))
    ollama_numbers = OLLAMA_NUMBERS.search(ollama)
    assert ollama_numbers is not None, ollama
    assert ollama_numbers.groups() == (str(PROMPT_TOKENS), str(KV_BUDGET))
    # Legacy Completions and Responses word it their own way, the note alike.
    args = (400, "invalid_request_error", message, "prompt", CONTEXT_LENGTH_EXCEEDED)
    completions = COMPLETIONS_ERRORS.render(*args)["error"]["message"]
    assert completions.startswith(
        f"This model's maximum context length is {KV_BUDGET} tokens (the most this "
    ), completions
    assert f"however you requested {PROMPT_TOKENS} tokens" in completions
    responses = RESPONSES_ERRORS.render(*args)["error"]["message"]
    assert responses.startswith("Your input exceeds the context window of this model.")
    assert f"tokens; the limit is {KV_BUDGET} (the most this instance" in responses
    assert "--kv-cache-tokens" in completions and "--kv-cache-tokens" in responses


def test_the_models_own_context_is_worded_as_before() -> None:
    openai, claude, ollama = rendered(engine_message(CONTEXT))
    assert openai == (
        f"This model's maximum context length is {CONTEXT} tokens. However, your messages "
        f"resulted in {PROMPT_TOKENS} tokens. Please reduce the length of the messages."
    )
    assert claude == f"prompt is too long: {PROMPT_TOKENS} tokens > {CONTEXT} maximum"
    assert ollama == (
        f"the input length exceeds the context length ({PROMPT_TOKENS} tokens > {CONTEXT})"
    )


def test_a_requests_own_context_is_named_as_the_bound() -> None:
    # Ollama's num_ctx below both the model's context and the KV budget.
    message = engine_message(KV_BUDGET, context_tokens=512)
    overflow = context_overflow(message, CONTEXT_LENGTH_EXCEEDED)
    assert overflow is not None and (overflow.limit, overflow.bound) == (512, "request")
    for text in rendered(message):
        assert "num_ctx" in text and "512" in text, text
