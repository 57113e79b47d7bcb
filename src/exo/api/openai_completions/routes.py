"""OpenAI legacy Completions: `POST /v1/completions`, a raw prompt completed without the
chat template: how base models are served, and instruct models too when a client wants
its prompt used as it is."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import Response

from exo.api.openai_completions.request import COMPLETION_ID_PREFIX, to_task_params
from exo.api.openai_completions.response import collect_completion, stream_completion
from exo.api.openai_completions.wire_types import Completion, CompletionRequest
from exo.api.serving.early_stream import WaitingFrames
from exo.api.serving.generation import convert_request
from exo.api.serving.model_lookup import Cluster
from exo.api.wire.errors import (
    ErrorDialect,
    completions_context_overflow_message,
    describe_openai_validation_errors,
    openai_renderer,
)
from exo.api.wire.openai_sse import openai_error_events

router = APIRouter()

# OpenAI's error shape, a prompt over the context worded as legacy Completions words it
# (also under Ollama's OpenAI-compatible prefix, where `ollama.routes` mounts this route).
ERROR_DIALECT = ErrorDialect(
    "openai-completions",
    ("/v1/completions", "/ollama/v1/completions"),
    openai_renderer(completions_context_overflow_message),
    describe_openai_validation_errors,
)


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, cluster: Cluster
) -> Completion | Response:
    converted = await convert_request(
        cluster, body, lambda body, _images: to_task_params(body), COMPLETION_ID_PREFIX
    )
    params, completion_id, created = converted.params, converted.response_id, int(time.time())
    echo = params.prompt if body.echo and params.prompt is not None else ""
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    return await converted.serve(
        request,
        render=lambda chunks: stream_completion(
            chunks, completion_id=completion_id, model=params.model, created=created,
            include_usage=include_usage, params=params, echo=echo,
        ),
        collector=lambda chunks: collect_completion(
            chunks, completion_id=completion_id, model=params.model, created=created,
            params=params, echo=echo,
        ),
        waiting=WaitingFrames(failure=openai_error_events),
    )  # fmt: skip
