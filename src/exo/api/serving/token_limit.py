"""One rule for every dialect's token limit (`max_tokens`, `max_completion_tokens`,
`max_output_tokens`, Ollama's `num_predict`): a limit above the room the prompt leaves in
the model's context (or the instance's KV-cache budget) is not an error — agents ask 32,000
tokens of any model — but the answer stops there; the response says so in the
`MAX_TOKENS_CAPPED_HEADER` header (the room, in tokens), and the log in a line. A limit
that is not a positive integer is refused by each dialect's schema (400 naming the field).

Headers decided after a route returned (this one, known only once the first chunk gives the
prompt's size) travel in `response_headers(request)`, which `ResponseHeadersMiddleware` adds
to the response's head, streamed or not.
"""

from __future__ import annotations

from typing import Any

from loguru import logger
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.serving.cluster_client import ClusterClient
from exo.api.serving.model_lookup import card_of
from exo.shared.models.kv_cache_memory import longest_length_in_kv_budget
from exo.shared.types.chunks import Chunk, PrefillProgressChunk, TokenChunk, ToolCallChunk
from exo.shared.types.common import ModelId
from exo.shared.types.instances import Instance
from exo.shared.types.models import ModelCard
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.state import State
from exo.shared.types.text_generation import TextGenerationTaskParams

MAX_TOKENS_CAPPED_HEADER = "X-Exo-Max-Tokens-Capped"
_STATE_KEY = "exo_response_headers"


def response_headers(request: Request) -> dict[str, str]:
    """Headers to add to the answer of `request` (`ResponseHeadersMiddleware`)."""
    state: dict[str, Any] = request.scope.setdefault("state", {})
    headers: dict[str, str] = state.setdefault(_STATE_KEY, {})
    return headers


def token_limit(cluster: ClusterClient, params: TextGenerationTaskParams) -> int | None:
    """Most tokens, prompt and answer together, one request for `params.model` may hold
    (`model_token_limit`)."""
    return model_token_limit(cluster, params.model)


def model_token_limit(cluster: ClusterClient, model_id: ModelId) -> int | None:
    """Most tokens, prompt and answer together, one request for `model_id` may hold: the
    model's context, and no more than fit the largest KV-cache budget of its instances
    (`longest_length_in_kv_budget`: more than the budget where the card's sliding-window
    layers keep only their window; None when neither is known). Ollama's `/api/ps` reports
    it as the loaded model's `context_length`."""
    card = card_of(cluster, model_id)
    budgets = [
        budget
        for instance in cluster.state.instances_of_model(model_id)
        if (budget := held_kv_cache_tokens(cluster.state, instance)) is not None
    ]
    limits = [
        *([card.context_length] if card is not None else []),
        *([_fits(card, max(budgets))] if budgets else []),
    ]
    return min(limits) if limits else None


def held_kv_cache_tokens(state: State, instance: Instance) -> int | None:
    """The KV-cache budget (tokens) `instance`'s requests really have: the smallest its
    loaded runners report (`RunnerReady` / `RunnerRunning.kv_cache_tokens`) once every
    runner has, else what placement gave it (`Instance.kv_cache_tokens`). They differ where
    a node holds less than placed: a float32 KV node keeps the placed bytes, so half the
    tokens (`kv_cache_tokens_for_dtype`), and a node's own smaller `--kv-cache-tokens`
    bounds it (`runner_options_for`)."""
    held: list[int] = []
    for runner_id in instance.shard_assignments.runner_to_shard:
        status = state.runners.get(runner_id)
        if not isinstance(status, RunnerReady | RunnerRunning):
            return instance.kv_cache_tokens
        held.append(status.kv_cache_tokens)
    return min(held) if held else instance.kv_cache_tokens


def _fits(card: ModelCard | None, budget_tokens: int) -> int:
    return budget_tokens if card is None else longest_length_in_kv_budget(card, budget_tokens)


def note_capped_max_tokens(
    cluster: ClusterClient, request: Request, params: TextGenerationTaskParams, first: Chunk | None
) -> None:
    """Add `MAX_TOKENS_CAPPED_HEADER` (and log it) when `params.max_tokens` is more than the
    room the prompt, whose size `first` (the generation's first chunk) gives, leaves."""
    if params.max_tokens is None or not isinstance(
        first, TokenChunk | ToolCallChunk | PrefillProgressChunk
    ):
        return
    prompt_tokens = (
        first.prompt_tokens if isinstance(first, TokenChunk | PrefillProgressChunk) else None
    )
    if prompt_tokens is None and first.usage is not None:
        prompt_tokens = first.usage.prompt_tokens
    limit = token_limit(cluster, params)
    if prompt_tokens is None or limit is None:
        return
    room = limit - prompt_tokens
    if 0 < room < params.max_tokens:
        response_headers(request)[MAX_TOKENS_CAPPED_HEADER] = str(room)
        logger.info(
            f"api: {params.model}: max_tokens {params.max_tokens} capped to {room}, the room "
            f"a {prompt_tokens}-token prompt leaves of {limit}"
        )


class ResponseHeadersMiddleware:
    """Adds `response_headers(request)` to the head of every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                extra: dict[str, str] = scope.get("state", {}).get(_STATE_KEY, {})
                if extra:
                    message = {
                        **message,
                        "headers": [
                            *message.get("headers", []),
                            *(
                                (name.lower().encode(), value.encode())
                                for name, value in extra.items()
                            ),
                        ],
                    }
            await send(message)

        await self.app(scope, receive, with_headers)
