"""A generation request on its way into the engine (`TorchEngine.build_request`, `submit`):
the room its prompt leaves for the reply (`PromptTooLongError` when none), the scripted
reply a test-marked model gives it, and the handle `submit` returns (`RequestHandle`). Its
images are `engine_images.py`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from exo.shared.types.text_generation import TextGenerationTaskParams
from exo.worker.engines.torch.batching.request_state import GeneratedPiece, RequestState
from exo.worker.engines.torch.decoding.sampling import Sampler, TokenChooser
from exo.worker.engines.torch.decoding.sampling_params import SamplingParams
from exo.worker.engines.torch.decoding.scripted import ScriptedReply
from exo.worker.engines.torch.testing_seam import TestingSeam


class PromptTooLongError(ValueError):
    """The prompt leaves no room in the model's context for even one generated token."""


@dataclass(frozen=True, slots=True)
class RequestHandle:
    """A submitted request: its id (for `cancel` and in `step`'s output), its prompt's
    size in tokens, and its state while it runs (`cached_tokens`)."""

    request_id: str
    prompt_tokens: int
    state: RequestState | None = None
    forced_pieces: tuple[GeneratedPiece, ...] = ()
    """The pieces the request's forced tokens made (`RequestState.force`): already streamed
    by the run it continues; the runner feeds them to its output parser only."""

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens whose KV came from the prefix cache: known once the request is
        admitted (before its first token), None without a state."""
        return None if self.state is None else self.state.cached_tokens

    @property
    def prefill_progress(self) -> tuple[int, int] | None:
        """`(prefilled, prompt)` tokens of the prompt whose KV is computed or being
        computed (prefix-cached ones included) and of the whole prompt, once the request is
        admitted to the batch and until its first token; None before admission."""
        state = self.state
        if state is None or state.prefilled_tokens is None:
            return None
        return state.prefilled_tokens, len(state.prompt_ids)


def check_prompt_not_empty(prompt_ids: list[int]) -> None:
    """Refuse a prompt of no tokens: the first step feeds a request's last known token, so
    there must be one. A chat template may write only the messages' text, and a tokenizer
    may add no BOS (SmolLM2's), so an empty message can render to nothing; an empty raw
    prompt gets its BOS, or the same refusal, earlier (`prompt.raw_prompt`).

    Raises:
        ValueError: `prompt_ids` is empty (the client's fault: a 400).
    """
    if not prompt_ids:
        raise ValueError(
            "the prompt cannot be empty: the model's chat template turned this conversation "
            "into no tokens (and the model adds no beginning-of-sequence token); send a "
            "message with some text"
        )


def reply_budget(
    prompt_ids: list[int],
    params: TextGenerationTaskParams,
    token_limit: int,
    context_length: int,
) -> int:
    """How many tokens may be generated after the prompt: `max_tokens`, capped by the room
    left in the context and the KV budget.

    Args:
        prompt_ids: the prompt's token ids.
        token_limit: most tokens (prompt and output) one request may hold on this engine
            (`TorchEngine.token_limit`).
        context_length: the model's context in tokens.

    Raises:
        PromptTooLongError: the prompt leaves no room for a generated token.
    """
    limit = token_limit
    what = "model's context" if limit == context_length else "model's KV cache budget"
    if params.context_tokens is not None and params.context_tokens < limit:
        limit, what = params.context_tokens, "request's context"  # Ollama's num_ctx
    room = limit - len(prompt_ids)
    if room < 1:
        # The model's context beside a KV budget below it, so that the API can say which
        # bound this is (`exo.api.wire.errors.context_overflow`).
        context = f" (the model's context is {context_length} tokens)" if what != (
            "model's context"
        ) else ""  # fmt: skip
        raise PromptTooLongError(
            f"the prompt is {len(prompt_ids)} tokens; the {what} is "
            f"{limit} tokens{context}, leaving no room for a reply"
        )
    return room if params.max_tokens is None else min(params.max_tokens, room)


def scripted_chooser(
    seam: TestingSeam | None,
    tokenizer: Any,
    prompt_ids: list[int],
    sampling: SamplingParams,
    device: torch.device,
) -> TokenChooser | None:
    """On a model the tests marked (`testing_seam`), the scripted reply the seam has for
    the prompt, as a token chooser; None elsewhere (every production model)."""
    if seam is None:
        return None
    reply = seam.reply_for(tokenizer.decode(prompt_ids))
    if reply is None:
        return None
    scripted = tokenizer.encode(reply, add_special_tokens=False)
    return TokenChooser(Sampler(sampling, device), constraint=ScriptedReply(scripted))
