"""Models outside the catalog: add one from the Hub, a local directory, a GGUF file or
Ollama's store, delete it, search the Hub, list what this node holds on disk unadded.

The card is built once, here, by the node that was asked (`exo.download.custom_cards`),
and sent to the master, whose `CustomModelAdded` puts it into every node's state; from then
on the model resolves like a catalog model (`with_custom_cards`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Annotated, ClassVar, Literal

import anyio
from fastapi import APIRouter, Query
from pydantic import BaseModel, ConfigDict, Field

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.model_lookup import Cluster, catalog_of
from exo.api.wire.errors import ApiError, InvalidRequestError, ModelNotFoundError, NoCapacityError
from exo.download.custom_cards import (
    REPO_ID,
    CustomModelError,
    card_for_cached_repository,
    card_for_hub_repository,
    card_for_local_directory,
    is_local_path,
    whole_local_copy,
)
from exo.download.gguf_models import (
    GgufModelError,
    card_for_gguf,
    find_ollama_model,
    ollama_store,
    ollama_store_models,
)
from exo.download.hub_search import search_hub
from exo.download.locations import ModelLocations
from exo.download.on_disk import ScanBudget, known_repositories, scan_on_disk
from exo.shared.constants import models_dir
from exo.shared.models.architectures import ENGINE_ARCHITECTURES, SERVED_ARCHITECTURES
from exo.shared.models.names import resolve_model_name
from exo.shared.types.commands import AddCustomModel, DeleteCustomModel
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.events import CustomModelAdded
from exo.shared.types.models import ModelCard

router = APIRouter()
# Reading a repository's small files takes a few requests; a Hub that hangs longer is down.
ADD_TIMEOUT_SECONDS = 120.0
MAX_SEARCH_RESULTS = 100
# `POST /models/add` takes a model of this node's Ollama store as `ollama:<name>[:<tag>]`.
OLLAMA_PREFIX = "ollama:"
# The first four bytes of every GGUF file.
GGUF_MAGIC = b"GGUF"


class HubAuthenticationError(ApiError):
    status_code: ClassVar[int] = 401
    error_type: ClassVar[str] = "authentication_error"


class HubPermissionError(ApiError):
    status_code: ClassVar[int] = 403
    error_type: ClassVar[str] = "permission_error"


class ModelConflictError(ApiError):
    status_code: ClassVar[int] = 409
    error_type: ClassVar[str] = "conflict_error"


def api_error(message: str, status_code: int) -> ApiError:
    """The API error for a refusal's status (400 for any status without its own class)."""
    match status_code:
        case 401:
            return HubAuthenticationError(message, param="model_id")
        case 403:
            return HubPermissionError(message, param="model_id")
        case 404:
            return ModelNotFoundError(message, param="model_id")
        case 409:
            return ModelConflictError(message, param="model_id")
        case 503:
            return NoCapacityError(message)
        case _:
            return InvalidRequestError(message, param="model_id")


class AddModelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(min_length=1)
    """A Hub repository (`org/name`), a local HF-format directory or `.gguf` file (`/…`,
    `~/…`, `./…`), or a model of this node's Ollama store (`ollama:<name>[:<tag>]`)."""
    revision: str = Field(default="main", min_length=1)
    """The Hub branch, tag or commit; the card pins the commit it resolves to. Only for a
    Hub repository: a 400 with a path or an Ollama model."""


class AddModelResponse(BaseModel):
    model_id: str
    card: ModelCard


class DeleteModelResponse(BaseModel):
    model_id: str
    status: str


class SearchResult(BaseModel):
    model_id: str
    architecture: str | None
    """The architecture the Hub says its config names (None when it did not say)."""
    supported: bool | None
    """Whether the engine serves it: a decoder family file or its encoder forward (None:
    architecture unknown)."""
    catalog_id: str | None
    """The catalog model it is (then it needs no adding)."""
    custom: bool
    """Already added as a custom model."""
    gated: bool
    downloads: int
    likes: int


class OnDiskModelEntry(BaseModel):
    model_id: str
    """What `POST /models/add` takes to add it (a repository id, or `ollama:<name>:<tag>`)."""
    place: Literal["models_dir", "hf_cache", "ollama"]
    path: str
    """Its directory (a models directory's copy, a cache snapshot) or GGUF blob."""
    architecture: str | None
    supported: bool
    """Whether the engine runs it; an unsupported one is listed so it is not a mystery."""
    reason: str | None = None
    """Why it cannot be added (unsupported ones only)."""


@router.get("/models/on_disk")
async def list_models_on_disk(cluster: Cluster) -> list[OnDiskModelEntry]:
    """Models on this node's disk that no card names yet: whole HF-format copies in its
    models directories and the Hugging Face cache, and models of its Ollama store. Catalog
    models found on disk are not here: `GET /models` marks them downloaded on this node.
    Each scan is bounded (`exo.download.on_disk`)."""
    cards = dict(cluster.cards)
    return await anyio.to_thread.run_sync(_models_on_disk, cards, catalog_of(cluster))


def _models_on_disk(
    cards: Mapping[ModelId, ModelCard], catalog: Mapping[ModelId, ModelCard]
) -> list[OnDiskModelEntry]:
    budget = ScanBudget.start()
    # A GGUF is converted for the decoder families only; an HF copy may be an encoder too.
    supported = set(ENGINE_ARCHITECTURES)
    locations = ModelLocations.from_environment(models_dir())
    entries = [
        OnDiskModelEntry(
            model_id=found.repo_id,
            place=found.place,
            path=str(found.path),
            architecture=found.architecture,
            supported=found.supported,
            reason=None
            if found.supported
            else f"{found.architecture} has no model family file in this engine",
        )
        for found in scan_on_disk(
            locations, known_repositories(cards), SERVED_ARCHITECTURES, budget
        )
    ]
    for model in ollama_store_models(ollama_store()):
        if model.name in cards or resolve_model_name(model.name, catalog) is not None:
            continue
        if not budget.spend():
            break
        try:
            card = card_for_gguf(model.gguf_path, model.name, model.sha256)
            architecture, reason = card.architecture, None
        except GgufModelError as error:
            architecture, reason = None, str(error)
        entries.append(
            OnDiskModelEntry(
                model_id=f"{OLLAMA_PREFIX}{model.name}",
                place="ollama",
                path=str(model.gguf_path),
                architecture=architecture,
                supported=reason is None and architecture in supported,
                reason=reason,
            )
        )
    return entries


@router.post("/models/add")
async def add_model(body: AddModelRequest, cluster: Cluster) -> AddModelResponse:
    """Build the model's card from its repository's small files and share it with every node.

    Answers 400 for custom code without `--trust-remote-code`, an architecture without a
    family file, or a repository the engine cannot load; 401 / 403 for a gated model the
    node has no access to; 404 for an unknown repository or directory; 409 for a catalog
    model; 503 when the Hub cannot be reached."""
    model_id = body.model_id.strip()
    catalog_id = resolve_model_name(model_id.removeprefix(OLLAMA_PREFIX), catalog_of(cluster))
    if catalog_id is not None:
        raise ModelConflictError(
            f"{model_id} is the catalog model {catalog_id}: it needs no adding",
            param="model_id",
        )
    if "revision" in body.model_fields_set and (
        is_local_path(model_id) or model_id.startswith(OLLAMA_PREFIX)
    ):
        raise InvalidRequestError(
            f"revision names a Hub branch, tag or commit; {model_id} is not a Hub repository "
            "(a path or an Ollama model is added as it is on disk): leave revision out",
            param="revision",
        )
    card = await add_custom_model(cluster, model_id, body.revision)
    return AddModelResponse(model_id=card.model_id, card=card)


async def add_custom_model(cluster: ClusterClient, model_id: str, revision: str) -> ModelCard:
    """Build `model_id`'s card on this node (`_build_card`: from the Hub, or on an
    `--offline` node from a whole copy on disk) and have the master add it to the cluster
    state; `POST /models/add` and Ollama's `/api/pull` of a repository no card names.

    Returns:
        The card as the master added it.

    Raises:
        ApiError: as `POST /models/add` answers (400, 401, 403, 404, 409, 503).
    """
    card = await _build_card(cluster, model_id, revision)
    try:
        event = await cluster.submit(AddCustomModel(command_id=CommandId.new(), card=card))
    except CommandRejectedError as error:
        raise api_error(error.reason, error.status_code) from None
    assert isinstance(event, CustomModelAdded)
    return event.card


def _card_for_gguf_file(path: str) -> ModelCard:
    """The card of a GGUF file on this node (its id is the absolute path); converted once
    when first placed. 404 when absent, 400 when it is a directory or no model the engine
    runs."""
    gguf_path = Path(path).expanduser().resolve()
    if gguf_path.is_dir():
        inside = sorted(child.name for child in gguf_path.glob("*.gguf") if child.is_file())
        hint = (
            f"; it holds {', '.join(inside)}: add the first part's path"
            if inside
            else "; a model directory (config.json, safetensors weights, a tokenizer) is "
            "added by a path that does not end in .gguf"
        )
        raise CustomModelError(
            f"{gguf_path} is a directory, not a GGUF file: a path ending in .gguf must be "
            f"a GGUF file{hint}",
            400,
        )
    if not gguf_path.is_file():
        raise CustomModelError(f"no GGUF file {gguf_path} on this node", 404)
    try:
        return card_for_gguf(gguf_path, str(gguf_path))
    except GgufModelError as error:
        raise CustomModelError(str(error), 400) from None


def _card_for_ollama_model(name: str) -> ModelCard:
    """The card of a model of this node's Ollama store, named as Ollama names it; its
    GGUF blob is read in place (converted once when first placed, as any GGUF). 404 when
    the store has no such model, 400 when it is no model the engine runs."""
    store = ollama_store()
    model = find_ollama_model(store, name)
    if model is None:
        raise CustomModelError(f"no model {name!r} in the Ollama store {store} on this node", 404)
    try:
        card = card_for_gguf(model.gguf_path, model.name, model.sha256)
    except GgufModelError as error:
        raise CustomModelError(str(error), 400) from None
    if card.architecture not in ENGINE_ARCHITECTURES:
        raise CustomModelError(
            f"{name} is a {card.architecture} model, an architecture with no model family "
            "file in this engine",
            400,
        )
    return card


def _refuse_unnamed_gguf(path: str) -> None:
    """A local path that is a file, not a model directory: a 400 saying what it is (a GGUF
    file without the extension, or another file) and what a path must name."""
    local = Path(path).expanduser().resolve()
    if not local.is_file():
        return  # a directory, or nothing (`card_for_local_directory` says which)
    try:
        with local.open("rb") as handle:
            is_gguf = handle.read(4) == GGUF_MAGIC
    except OSError:
        is_gguf = False
    found = "a GGUF file without the .gguf extension" if is_gguf else "a file, not a directory"
    raise CustomModelError(
        f"{local} is {found}: a local path must name a model directory (config.json, "
        "safetensors weights, a tokenizer) or a GGUF file whose name ends in .gguf"
        + (" (rename it, or link it under such a name)" if is_gguf else ""),
        400,
    )


@contextlib.contextmanager
def _hub_errors(timeout_message: str) -> Iterator[None]:
    """Answer a `CustomModelError` with its status, and the Hub's timeout (TimeoutError,
    from `anyio.fail_after`) with a 503 saying `timeout_message`."""
    try:
        yield
    except CustomModelError as error:
        raise api_error(error.message, error.status_code) from None
    except TimeoutError:
        raise NoCapacityError(timeout_message) from None


async def _build_card(cluster: ClusterClient, model_id: str, revision: str) -> ModelCard:
    supported = SERVED_ARCHITECTURES
    trust_remote_code = cluster.trust_remote_code
    timeout = f"the Hub did not answer within {ADD_TIMEOUT_SECONDS:.0f}s while reading {model_id}"
    with _hub_errors(timeout):
        if model_id.startswith(OLLAMA_PREFIX):
            return await anyio.to_thread.run_sync(
                _card_for_ollama_model, model_id.removeprefix(OLLAMA_PREFIX)
            )
        if is_local_path(model_id) and model_id.endswith(".gguf"):
            return _card_for_gguf_file(model_id)
        if is_local_path(model_id):
            _refuse_unnamed_gguf(model_id)
            return card_for_local_directory(model_id, supported, trust_remote_code)
        if REPO_ID.match(model_id) is None:
            raise CustomModelError(
                f"{model_id!r} is neither a Hub repository id (org/name) nor a local "
                "directory path (starting with /, ~ or .)",
                400,
            )
        if cluster.load_on_request.offline:
            locations = ModelLocations.from_environment(models_dir())
            cached = await anyio.to_thread.run_sync(
                card_for_cached_repository,
                model_id,
                revision,
                locations,
                supported,
                trust_remote_code,
            )
            if cached is not None:
                return cached
            searched = [*locations.writable, *locations.read_only, locations.hub_cache]
            raise CustomModelError(
                f"this node runs --offline: it cannot read {model_id} from the Hub, and no "
                f"whole copy of it (config.json, safetensors weights, a tokenizer) is in "
                f"{', '.join(str(place) for place in searched)} (add a local directory "
                "instead)",
                400,
            )
        try:
            with anyio.fail_after(ADD_TIMEOUT_SECONDS):
                return await anyio.to_thread.run_sync(
                    card_for_hub_repository,
                    model_id,
                    revision,
                    supported,
                    trust_remote_code,
                    abandon_on_cancel=True,
                )
        except (CustomModelError, TimeoutError) as error:
            unreachable = error.message if isinstance(error, CustomModelError) else timeout
            if isinstance(error, CustomModelError) and error.status_code != 503:
                raise
            locations = ModelLocations.from_environment(models_dir())
            copy = await anyio.to_thread.run_sync(whole_local_copy, model_id, revision, locations)
            if copy is None:
                raise
            raise CustomModelError(
                f"{unreachable}. A whole copy of {model_id} is on this node at {copy}: "
                "restart the node with --offline to add it from there without the Hub",
                503,
            ) from None


@router.delete("/models/custom/{model_id:path}")
async def delete_custom_model(model_id: str, cluster: Cluster) -> DeleteModelResponse:
    """Forget a custom model on every node (its files stay where they are). 400 for a
    catalog model, 404 for an unknown one, 409 while an instance of it is placed."""
    custom_cards = cluster.state.custom_cards
    if ModelId(model_id) not in custom_cards and ModelId(f"/{model_id}") in custom_cards:
        # `/models/custom//tmp/x` and `/models/custom/tmp/x` both name the directory /tmp/x.
        model_id = f"/{model_id}"
    resolved = resolve_model_name(
        model_id, catalog_of(cluster), custom_cards=custom_cards
    ) or ModelId(model_id)
    command = DeleteCustomModel(command_id=CommandId.new(), model_id=resolved)
    try:
        await cluster.submit(command)
    except CommandRejectedError as error:
        raise api_error(error.reason, error.status_code) from None
    return DeleteModelResponse(model_id=resolved, status="deleted")


@router.get("/models/search")
async def search_models(
    cluster: Cluster,
    query: Annotated[str, Query(max_length=200)] = "",
    limit: Annotated[int, Query(ge=1, le=MAX_SEARCH_RESULTS)] = 20,
) -> list[SearchResult]:
    """The Hub's models matching `query`, each marked with whether the engine supports its
    architecture and whether it is in the catalog or already added. 503 when the Hub
    cannot be reached."""
    with (
        _hub_errors(f"the Hub did not answer a search within {ADD_TIMEOUT_SECONDS:.0f}s"),
        anyio.fail_after(ADD_TIMEOUT_SECONDS),
    ):
        found = await anyio.to_thread.run_sync(search_hub, query, limit, abandon_on_cancel=True)
    supported = set(SERVED_ARCHITECTURES)
    custom = cluster.state.custom_cards
    catalog = catalog_of(cluster)
    return [
        SearchResult(
            model_id=result.model_id,
            architecture=result.architecture,
            supported=result.architecture in supported if result.architecture else None,
            catalog_id=resolve_model_name(result.model_id, catalog),
            custom=result.model_id in custom,
            gated=result.gated,
            downloads=result.downloads,
            likes=result.likes,
        )
        for result in found
    ]
