"""Ollama's API under `/ollama`: point an Ollama client at `http://<node>:52415/ollama`.

Native routes (`/ollama/api/...`: chat, generate, tags, show, ps, version) answer errors as
Ollama does, `{"error": "message"}` with 400 for bad requests and schema errors and 404 for
unknown models. `/ollama/v1/chat/completions`, `/ollama/v1/completions` and
`/ollama/v1/models` are the OpenAI routes mounted again under this prefix (Ollama serves
its OpenAI-compatible API there), with OpenAI-shaped errors.
"""

from __future__ import annotations

import json
import time
from functools import partial
from typing import Any, assert_never

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from exo.api.ollama.model_listings import (
    bytes_on_disk,
    model_capabilities,
    process_model,
    resident_bytes,
    show_response,
    tag_model,
)
from exo.api.ollama.request import (
    NDJSON_MEDIA_TYPE,
    NEVER_EXPIRES,
    OLLAMA_COMPATIBLE_VERSION,
    Dialect,
    chat_to_task_params,
    generate_to_task_params,
    parse_keep_alive,
    rfc3339_nano,
)
from exo.api.ollama.response import collect_ollama, load_response, stream_ollama
from exo.api.ollama.validation import describe_ollama_validation_errors
from exo.api.ollama.wire_types import (
    OllamaChatRequest,
    OllamaChatResponse,
    OllamaGenerateRequest,
    OllamaGenerateResponse,
    OllamaProcessResponse,
    OllamaShowRequest,
    OllamaShowResponse,
    OllamaTagsResponse,
    OllamaVersionResponse,
)
from exo.api.openai_chat import routes as chat
from exo.api.openai_completions import routes as completions
from exo.api.openai_responses import routes as responses
from exo.api.serving.catch_up import catch_up_for
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.generation import serve_generation
from exo.api.serving.image_input import convert_with_images
from exo.api.serving.load_on_request import default_keep_alive, ensure_instance
from exo.api.serving.load_wait import LoadWait, model_ready
from exo.api.serving.model_files import files_modified_ns, model_directories
from exo.api.serving.model_lookup import Cluster, card_of, resolve_model_id, servable_model_ids
from exo.api.serving.token_limit import model_token_limit
from exo.api.wire.errors import (
    ErrorDialect,
    InvalidRequestError,
    ModelNotFoundError,
    NoCapacityError,
    context_overflow,
)
from exo.shared.types.commands import KeepAlive, SetKeepAlive
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.models import ModelCard

PREFIX = "/ollama"
UNIX_EPOCH = "1970-01-01T00:00:00Z"
# Expiry times past this (the year 9999) are reported as NEVER_EXPIRES's date.
MAX_EXPIRY_SECONDS = 253402300799


def _render_ollama_error(
    status_code: int, error_type: str, message: str, param: str | None, code: str | None
) -> dict[str, Any]:
    overflow = context_overflow(message, code)
    if overflow is not None:
        # Ollama's sentence (with `truncate: false`); exo refuses rather than truncates.
        message = (
            "the input length exceeds the context length "
            f"({overflow.prompt_tokens} tokens > {overflow.limit}){overflow.note()}"
        )
    return {"error": message}


ERROR_DIALECT = ErrorDialect(
    "ollama", (f"{PREFIX}/api",), _render_ollama_error, describe_ollama_validation_errors
)

router = APIRouter()

# Ollama's OpenAI-compatible API, served by the same handlers as `/v1/...`.
router.add_api_route(
    f"{PREFIX}/v1/chat/completions", chat.chat_completions, methods=["POST"], response_model=None
)
router.add_api_route(f"{PREFIX}/v1/models", chat.list_models, methods=["GET"])
router.add_api_route(
    f"{PREFIX}/v1/completions", completions.completions, methods=["POST"], response_model=None
)
router.add_api_route(f"{PREFIX}/v1/models/{{model_id:path}}", chat.retrieve_model, methods=["GET"])
# Ollama serves the Responses API under its base path too (`codex --oss` calls it there).
router.add_api_route(
    f"{PREFIX}/v1/responses", responses.create_response, methods=["POST"], response_model=None
)


@router.head(PREFIX, response_class=PlainTextResponse, include_in_schema=False)
@router.get(PREFIX, response_class=PlainTextResponse)
async def root() -> str:
    """Ollama's liveness answer at its root URL."""
    return "Ollama is running"


@router.head(f"{PREFIX}/api/version", include_in_schema=False)
@router.get(f"{PREFIX}/api/version")
async def version() -> OllamaVersionResponse:
    return OllamaVersionResponse(version=OLLAMA_COMPATIBLE_VERSION)


@router.post(f"{PREFIX}/api/chat", response_model=None)
async def ollama_chat(
    body: OllamaChatRequest, request: Request, cluster: Cluster
) -> Response | OllamaChatResponse | OllamaGenerateResponse:
    return await _answer(cluster, request, body)


@router.post(f"{PREFIX}/api/generate", response_model=None)
async def ollama_generate(
    body: OllamaGenerateRequest, request: Request, cluster: Cluster
) -> Response | OllamaChatResponse | OllamaGenerateResponse:
    return await _answer(cluster, request, body)


@router.get(f"{PREFIX}/api/tags")
async def tags(cluster: Cluster) -> OllamaTagsResponse:
    """The models this cluster can serve now (placed or downloaded), as Ollama lists the
    models it has pulled."""
    on_gpus = _has_gpus(cluster, [cluster.node_id])
    cards = [card_of(cluster, model_id) for model_id in servable_model_ids(cluster)]
    return OllamaTagsResponse(
        models=[
            tag_model(card, _modified_at(cluster, card), on_gpus, _size_on_disk(cluster, card))
            for card in cards
            if card is not None
        ]
    )


@router.post(f"{PREFIX}/api/show")
async def show(body: OllamaShowRequest, cluster: Cluster) -> OllamaShowResponse:
    name = body.model or body.name
    if not name:
        raise InvalidRequestError("model is required", "model")
    card = _card_for_request(cluster, name)
    placed = cluster.state.instances_of_model(card.model_id)
    nodes = list(placed[0].shard_assignments.node_to_runner) if placed else [cluster.node_id]
    return show_response(
        card,
        _chat_template(cluster, card),
        _modified_at(cluster, card),
        _has_gpus(cluster, nodes),
    )


@router.get(f"{PREFIX}/api/ps")
async def ps(cluster: Cluster) -> OllamaProcessResponse:
    models = []
    seen: set[ModelId] = set()
    for instance in cluster.state.instances.values():
        card = card_of(cluster, instance.model_id)
        if card is None or card.model_id in seen:
            continue
        seen.add(card.model_id)
        on_gpus = _has_gpus(cluster, list(instance.shard_assignments.node_to_runner))
        runners = instance.shard_assignments.runner_to_shard
        statuses = [cluster.state.runners.get(runner_id) for runner_id in runners]
        models.append(
            process_model(
                card,
                resident_bytes(card, statuses, on_gpus),
                on_gpus,
                _expires_at(cluster, instance.instance_id),
                model_token_limit(cluster, card.model_id),
            )
        )
    return OllamaProcessResponse(models=models)


# ---------------------------------------------------------------- helpers


async def _answer(
    cluster: ClusterClient, request: Request, body: OllamaChatRequest | OllamaGenerateRequest
) -> Response | OllamaChatResponse | OllamaGenerateResponse:
    """A chat or generate request: a load (or unload) request without input (no messages,
    an empty prompt), else the generation, streamed as JSON lines or collected."""
    started_ns = time.monotonic_ns()
    # Before anything waits: a request that finds no instance of its model ready waits
    # for a load (`load_duration`).
    ready_on_arrival = model_ready(cluster.state, resolve_model_id(cluster, body.model))
    await catch_up_for(cluster, body.model)  # a model this node has not heard of yet
    card = _card_for_request(cluster, body.model)
    load_wait = LoadWait(
        card.model_id, started_ns, None if ready_on_arrival else cluster.ready_times
    )
    _check_thinking(cluster, card, body)
    keep_alive = parse_keep_alive(body.keep_alive)
    match body:
        case OllamaChatRequest():
            dialect: Dialect = "chat"
            has_input = bool(body.messages)
            to_params = partial(chat_to_task_params, body)
        case OllamaGenerateRequest():
            dialect = "generate"
            has_input = bool(body.prompt)
            to_params = partial(generate_to_task_params, body)
        case _:
            assert_never(body)
    if not has_input:
        return await _load_or_unload(cluster, request, card, keep_alive, dialect, body)
    params = await convert_with_images(
        cluster,
        body,
        card.model_id,
        lambda _body, images: to_params(card.model_id, card.capabilities, images),
    )
    model = body.model
    return await serve_generation(
        cluster, request, params, keep_alive=keep_alive, media_type=NDJSON_MEDIA_TYPE,
        render=lambda chunks: stream_ollama(
            chunks, dialect=dialect, model=model, started_ns=started_ns,
            load_duration=load_wait.duration_ns,
        ),
        collector=lambda chunks: collect_ollama(
            chunks, dialect=dialect, model=model, started_ns=started_ns,
            load_duration=load_wait.duration_ns,
        ),
    )  # fmt: skip


async def _load_or_unload(
    cluster: ClusterClient,
    request: Request,
    card: ModelCard,
    keep_alive: KeepAlive | None,
    dialect: Dialect,
    body: OllamaChatRequest | OllamaGenerateRequest,
) -> Response:
    """Ollama's load request (no messages / empty prompt): load the model (placing it on
    request) and answer `done_reason: "load"`; with `keep_alive: 0`, unload it instead
    (idle instances at once, busy ones when their generations end) and answer
    `"unload"`. The keep-alive given applies to the model's instances from now on."""
    unload = keep_alive is not None and keep_alive.seconds == 0
    had_instance = bool(cluster.state.instances_of_model(card.model_id))
    if not unload:
        keep_alive = default_keep_alive(cluster, keep_alive)
        await ensure_instance(cluster, request, card.model_id, keep_alive)
    if keep_alive is not None and had_instance:
        command = SetKeepAlive(
            command_id=CommandId.new(), model_id=card.model_id, keep_alive=keep_alive
        )
        try:
            await cluster.submit(command)
        except CommandRejectedError as error:
            if error.status_code != 404:  # 404: no instance, nothing to unload
                raise NoCapacityError(error.reason) from None
    answer = load_response(dialect, body.model, done_reason="unload" if unload else "load")
    text = answer.model_dump_json()
    if body.stream:
        return Response(text + "\n", media_type=NDJSON_MEDIA_TYPE)
    return Response(text, media_type="application/json")


def _check_thinking(
    cluster: ClusterClient, card: ModelCard, body: OllamaChatRequest | OllamaGenerateRequest
) -> None:
    """Ollama refuses `think` (true or a level) for a model without the "thinking"
    capability, the one `/api/show` lists, with a 400 naming the model as sent; `false` is
    accepted. A raw generate request is left to its own check (`think` needs the template).

    Raises:
        InvalidRequestError: thinking asked of a model that cannot think.
    """
    if body.think is None or body.think is False:
        return
    if isinstance(body, OllamaGenerateRequest) and body.raw:
        return
    if "thinking" not in model_capabilities(card, _chat_template(cluster, card)):
        raise InvalidRequestError(f'"{body.model}" does not support thinking', "think")


def _expires_at(cluster: ClusterClient, instance_id: InstanceId) -> str:
    """When the instance is unloaded if nobody uses it (its last use plus its
    keep-alive), in Ollama's RFC 3339 form; far in the future when it has no keep-alive."""
    usage = cluster.state.instance_usage.get(instance_id)
    if usage is None or usage.keep_alive_seconds is None:
        return NEVER_EXPIRES
    expires = usage.last_used_at + usage.keep_alive_seconds
    return rfc3339_nano(int(min(expires, MAX_EXPIRY_SECONDS) * 1_000_000_000))


def _has_gpus(cluster: ClusterClient, nodes: list[NodeId]) -> bool:
    """Whether every node in `nodes` reported a GPU (the engine then holds float32)."""
    return all(
        node in cluster.state.node_info and bool(cluster.state.node_info[node].gpus)
        for node in nodes
    )


def _card_for_request(cluster: ClusterClient, name: str) -> ModelCard:
    """The card `name` means: a catalog id or short name (`qwen3:0.6b`), either with
    `:latest`, or a placed model's id."""
    model_id = resolve_model_id(cluster, name)
    card = card_of(cluster, model_id) if model_id is not None else None
    if card is None:
        raise ModelNotFoundError(f"model '{name}' not found")
    return card


def _modified_at(cluster: ClusterClient, card: ModelCard) -> str:
    """When the model's files on this node last changed; the Unix epoch when this node has
    no copy."""
    modified_ns = files_modified_ns(cluster, card)
    return UNIX_EPOCH if modified_ns is None else rfc3339_nano(modified_ns)


def _size_on_disk(cluster: ClusterClient, card: ModelCard) -> int | None:
    """Bytes of the model's files on this node (its most specific directory), or None when
    this node holds no copy."""
    for directory in model_directories(cluster, card):
        return bytes_on_disk(directory)
    return None


def _chat_template(cluster: ClusterClient, card: ModelCard) -> str:
    """The model's chat template (Jinja) from its files on this node, or "" when this node
    has no readable copy. transformers stores it in `chat_template.jinja` or in
    `tokenizer_config.json` (a string, or a list of named templates)."""
    for directory in model_directories(cluster, card):
        jinja = directory / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text(encoding="utf-8", errors="replace")
        try:
            config = json.loads((directory / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        template = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(template, str):
            return template
        if isinstance(template, list):
            named = {
                entry.get("name"): entry.get("template")
                for entry in template
                if isinstance(entry, dict)
            }
            chosen = named.get("default") or next(iter(named.values()), None)
            if isinstance(chosen, str):
                return chosen
    return ""
