"""exo's own routes: cluster state, models, placement."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, field_validator

from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.load_on_request import default_keep_alive
from exo.api.serving.model_lookup import Cluster, catalog_of, is_downloaded
from exo.api.wire.errors import ApiError, InvalidRequestError, ModelNotFoundError, NoCapacityError
from exo.master.placement import PlacementPreview, placement_previews
from exo.master.speed_prediction import DEFAULT_PROMPT_TOKENS
from exo.shared.constants import models_dir
from exo.shared.models.cards import UnknownModelError, resolve_card
from exo.shared.types.commands import DeleteInstance, PlaceInstance
from exo.shared.types.common import CommandId, InstanceId, ModelId, NodeId
from exo.shared.types.events import InstanceCreated
from exo.shared.types.instances import Sharding
from exo.shared.types.models import ModelCard
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.runners import RunnerReady, RunnerRunning
from exo.shared.types.state import State

router = APIRouter()


class InstanceNotFoundError(ApiError):
    status_code = 404
    error_type = "invalid_request_error"


class PlaceInstanceRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model_id: str = Field(min_length=1)
    sharding: Sharding = "pipeline"
    """exo's API and dashboard spell it "Pipeline" / "Tensor"; any letter case is taken."""
    min_nodes: int = Field(default=1, ge=1, strict=True)
    """A JSON integer: `"2"` is refused, as the dialect routes refuse numeric strings."""
    node_ids: list[str] | None = None

    @field_validator("sharding", mode="before")
    @classmethod
    def _lower_case_sharding(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value


class PlaceInstanceResponse(BaseModel):
    instance_id: str
    model_id: str
    instance: dict[str, Any]


class CatalogCard(ModelCard):
    """A card as `GET /models` lists it: with `card_mismatches`, every fact of the card that
    a runner of its model found stated otherwise in the model's files at load (empty when
    they agree or no runner has loaded it; `exo.shared.models.profile`)."""

    card_mismatches: tuple[str, ...] = ()
    downloaded_on: tuple[str, ...] = ()
    """The nodes that reported the model's files complete: downloaded by exo, or found
    whole on their disk at start (models directories, the Hugging Face cache, Ollama's
    store; `exo.download.on_disk`)."""


def downloaded_on_by_model(state: State) -> dict[ModelId, tuple[str, ...]]:
    found: dict[ModelId, list[str]] = {}
    for node_id, downloads in sorted(state.downloads.items()):
        for model_id, status in downloads.items():
            if isinstance(status, DownloadCompleted):
                found.setdefault(model_id, []).append(str(node_id))
    return {model_id: tuple(nodes) for model_id, nodes in found.items()}


def card_mismatches_by_model(state: State) -> dict[ModelId, tuple[str, ...]]:
    """What the ready and running runners of each placed model reported against its card."""
    found: dict[ModelId, tuple[str, ...]] = {}
    for instance in state.instances.values():
        for runner_id in instance.shard_assignments.runner_to_shard:
            status = state.runners.get(runner_id)
            if isinstance(status, RunnerReady | RunnerRunning) and status.card_mismatches:
                found[instance.model_id] = status.card_mismatches
    return found


@router.get("/models")
async def list_model_cards(
    cluster: Cluster, status: Annotated[Literal["downloaded"] | None, Query()] = None
) -> list[CatalogCard]:
    """The catalog: every built-in card (shapes, sources, short name, capabilities), with
    what its model's files contradict once a runner loaded it (`card_mismatches`) and the
    nodes holding its files (`downloaded_on`).
    `?status=downloaded` keeps the models whose files are on some node (a node reported
    the download complete, or this node's models directory holds them)."""
    cards = list(cluster.cards.values())
    if status == "downloaded":
        directory = models_dir()
        cards = [card for card in cards if is_downloaded(cluster, card, directory)]
    mismatches = card_mismatches_by_model(cluster.state)
    downloaded_on = downloaded_on_by_model(cluster.state)
    return [
        # The card was validated when it was loaded; only the reported lines are added.
        CatalogCard.model_construct(
            **dict(card),
            card_mismatches=mismatches.get(card.model_id, ()),
            downloaded_on=downloaded_on.get(card.model_id, ()),
        )
        for card in cards
    ]


@router.get("/state")
async def get_state(cluster: Cluster) -> dict[str, Any]:
    return cluster.state.model_dump(mode="json")


class ClusterView(BaseModel):
    node_id: str
    master: str | None
    peers: list[str]


@router.get("/cluster")
async def get_cluster(cluster: Cluster) -> ClusterView:
    """This node's view of the cluster: itself, the elected master (None during an
    election) and the peers it is connected to."""
    return ClusterView(
        node_id=cluster.node_id,
        master=cluster.master,
        peers=sorted(cluster.current_peers()),
    )


@router.get("/node_id")
async def get_node_id(cluster: Cluster) -> str:
    return cluster.node_id


MAX_BANDWIDTH_PROBE_BYTES = 16 << 20


@router.get("/bandwidth_probe")
async def bandwidth_probe(
    size_bytes: Annotated[int, Query(ge=1, le=MAX_BANDWIDTH_PROBE_BYTES)] = 1 << 20,
) -> Response:
    """`size_bytes` of zeros, for peers estimating the bandwidth of their link to us."""
    return Response(bytes(size_bytes), media_type="application/octet-stream")


def _card(cluster: ClusterClient, model_id: str) -> ModelCard:
    try:
        return resolve_card(model_id, catalog_of(cluster), cluster.state.custom_cards)
    except UnknownModelError as error:
        raise ModelNotFoundError(str(error), param="model_id") from None
    except ValueError as error:
        raise InvalidRequestError(str(error), param="model_id") from None


# The longest prompt a prediction is asked for (larger numbers are a typo, not a prompt).
MAX_PREDICTION_PROMPT_TOKENS = 1 << 20


@router.get("/instance/previews")
async def instance_previews(
    cluster: Cluster,
    model_id: Annotated[str, Query(min_length=1)],
    prompt_tokens: Annotated[
        int, Query(ge=1, le=MAX_PREDICTION_PROMPT_TOKENS)
    ] = DEFAULT_PROMPT_TOKENS,
) -> list[PlacementPreview]:
    """Every placement of `model_id` (valid or with the reason it is not), each valid one
    with its predicted single-stream decode tok/s and TTFT for a prompt of
    `prompt_tokens` tokens (null while a node has not measured its speed), and the draft
    model its rank 0 would load for speculative decoding and on which node (`draft`; or
    why a draft named for it would not be used: `draft_left_out`). A `prompt_tokens`
    beyond the model's context length is a 400 naming it: no placement can take such a
    prompt."""
    card = _card(cluster, model_id)
    if prompt_tokens > card.context_length:
        raise InvalidRequestError(
            f"prompt_tokens {prompt_tokens} is beyond {card.model_id}'s context length of "
            f"{card.context_length} tokens",
            param="prompt_tokens",
        )
    return placement_previews(card, cluster.state, prompt_tokens, catalog_of(cluster))


@router.post("/place_instance")
async def place_instance(body: PlaceInstanceRequest, cluster: Cluster) -> PlaceInstanceResponse:
    """Place a model; every reason it cannot be placed (unknown model included) is a 400
    with that reason, since the request as a whole is what cannot be carried out.

    Right after start-up the nodes have not reported their memory yet: the placement
    waits (at most `cluster.NODE_REPORTS_TIMEOUT_SECONDS`) for this node and its connected peers
    (those of them named in `node_ids`, when given) to report before it is decided."""
    try:
        # A short name (`qwen3:0.6b`) is placed under the catalog id it resolves to.
        card = resolve_card(body.model_id, catalog_of(cluster), cluster.state.custom_cards)
    except ValueError as error:  # UnknownModelError included
        raise InvalidRequestError(str(error), param="model_id") from None
    await cluster.wait_for_node_reports(
        frozenset(NodeId(n) for n in body.node_ids) if body.node_ids is not None else None
    )
    command = PlaceInstance(
        command_id=CommandId.new(),
        model_id=card.model_id,
        sharding=body.sharding,
        min_nodes=body.min_nodes,
        node_ids=tuple(NodeId(n) for n in body.node_ids) if body.node_ids is not None else None,
        keep_alive=default_keep_alive(cluster, None),
    )
    if command.node_ids == ():
        raise InvalidRequestError(
            "node_ids is empty: name at least one node, or leave it out to place on any",
            param="node_ids",
        )
    try:
        event = await cluster.submit(command)
    except CommandRejectedError as error:
        raise InvalidRequestError(error.reason, param=_param_of(error.reason)) from None
    assert isinstance(event, InstanceCreated)
    instance = event.instance
    return PlaceInstanceResponse(
        instance_id=instance.instance_id,
        model_id=instance.model_id,
        instance=instance.model_dump(mode="json"),
    )


def _param_of(reason: str) -> str | None:
    """The request field a placement refusal is about, for the error's `param`."""
    if "min_nodes" in reason:
        return "min_nodes"
    if "node id" in reason:
        return "node_ids"
    if "tensor" in reason or "divisible" in reason or "expert-split" in reason:
        return "sharding"
    return None


@router.delete("/instance/{instance_id}")
async def delete_instance(instance_id: str, cluster: Cluster) -> dict[str, str]:
    command = DeleteInstance(command_id=CommandId.new(), instance_id=InstanceId(instance_id))
    try:
        await cluster.submit(command)
    except CommandRejectedError as error:
        if error.status_code == 404:
            raise InstanceNotFoundError(error.reason, param="instance_id") from None
        raise NoCapacityError(error.reason) from None
    return {"instance_id": instance_id, "status": "deleted"}
