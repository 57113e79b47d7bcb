"""A Hugging Face Hub stand-in on loopback, for tests that download or inspect models.

It serves repositories the test creates (usually tiny random-weight models from
`exo.testing.tiny_models`) under the Hub's own URL layout, the part of it that
`huggingface_hub` uses (checked against huggingface_hub 2.4 by running it against this
server):

- `GET /api/models/{repo_id}` and `/api/models/{repo_id}/revision/{revision}`: the model
  info (`id`, `sha`, `gated`, `private`, `siblings`; with `?blobs=true` each sibling's
  size, blob id and LFS hash), 404 with `X-Error-Code: RepoNotFound` for an unknown one.
- `GET /api/models?search=&limit=`: search by substring of the id.
- `GET /api/models/{repo_id}/tree/{revision}[/{path}]`: the file list (`type`, `path`,
  `size`, `oid`, `lfs`).
- `HEAD` / `GET /{repo_id}/resolve/{revision}/{filename}`: the file, with `ETag` (the git
  blob id, or the SHA-256 for LFS files), `X-Repo-Commit`, `X-Linked-Etag` and
  `X-Linked-Size` for LFS files, `Content-Length`, and `Range` requests (206 /
  `Content-Range`; 416 when unsatisfiable).

A repository may demand a token (`tokens=`): without an `Authorization: Bearer` header its
files answer 401, with a token not in the set 403, both with `X-Error-Code: GatedRepo` as the
Hub answers a gated model (its model info stays public, as on the Hub).

Every request is recorded (`requests`); `file_requests(repo_id, filename)` counts the ones
for one file. `hooks` are consulted before a file is served: a hook may answer instead of
the file (a 429, a cut or corrupted transfer), which is how tests inject faults (the file
answer and the fault hooks are in `exo.testing.hf_file_serving`, the repository model in
`exo.testing.hf_repository`).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from exo.testing.hf_file_serving import FileHook, FileRequest, file_response
from exo.testing.hf_repository import HubFile, HubRepository, git_blob_id

START_TIMEOUT_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    method: str
    path: str
    repo_id: str | None
    filename: str | None
    range: str | None
    authorization: str | None


@dataclass(slots=True)
class _Log:
    lock: threading.Lock = field(default_factory=threading.Lock)
    requests: list[RecordedRequest] = field(default_factory=list)


class HubServer:
    """The server: `add_repository` / `add_directory`, then `start()` (or use it as a
    context manager); `url` is what `HF_ENDPOINT` should be."""

    def __init__(self) -> None:
        self.repositories: dict[str, HubRepository] = {}
        self.hooks: list[FileHook] = []
        self._log = _Log()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self._socket: socket.socket | None = None
        self.port = 0

    # ----- content -----------------------------------------------------------------

    def add_repository(
        self,
        repo_id: str,
        files: dict[str, bytes],
        gated: Literal[False, "auto", "manual"] = False,
        tokens: Iterable[str] | None = None,
    ) -> HubRepository:
        """Serve `files` (path in the repository -> content) as `repo_id` ("org/name")."""
        repository = HubRepository(
            repo_id=repo_id,
            files={path: HubFile(path, data) for path, data in files.items()},
            gated=gated,
            tokens=frozenset(tokens) if tokens is not None else None,
        )
        self.repositories[repo_id] = repository
        return repository

    def add_directory(
        self,
        repo_id: str,
        directory: Path,
        gated: Literal[False, "auto", "manual"] = False,
        tokens: Iterable[str] | None = None,
    ) -> HubRepository:
        """Serve every file under `directory` (a saved model) as `repo_id`."""
        files = {
            path.relative_to(directory).as_posix(): path.read_bytes()
            for path in sorted(directory.rglob("*"))
            if path.is_file()
        }
        return self.add_repository(repo_id, files, gated=gated, tokens=tokens)

    # ----- what was asked ----------------------------------------------------------

    @property
    def requests(self) -> list[RecordedRequest]:
        with self._log.lock:
            return list(self._log.requests)

    def file_requests(self, repo_id: str, filename: str, method: str | None = "GET") -> int:
        """How many requests (of `method`; None: any) asked for one file."""
        return sum(
            1
            for recorded in self.requests
            if recorded.repo_id == repo_id
            and recorded.filename == filename
            and (method is None or recorded.method == method)
        )

    def files_downloaded(self, repo_id: str) -> set[str]:
        """Files of `repo_id` fetched with a GET at least once (whole or in part)."""
        return {
            recorded.filename
            for recorded in self.requests
            if recorded.repo_id == repo_id and recorded.method == "GET" and recorded.filename
        }

    def _record(
        self, request: Request, repo_id: str | None = None, filename: str | None = None
    ) -> None:
        recorded = RecordedRequest(
            method=request.method,
            path=request.url.path,
            repo_id=repo_id,
            filename=filename,
            range=request.headers.get("range"),
            authorization=request.headers.get("authorization"),
        )
        with self._log.lock:
            self._log.requests.append(recorded)

    # ----- running -----------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        """Listen on a free loopback port, serving from a background thread.

        Raises:
            RuntimeError: the server did not start within `START_TIMEOUT_SECONDS`.
        """
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        self._socket = listener
        self.port = listener.getsockname()[1]
        config = uvicorn.Config(self.app(), log_level="warning", lifespan="off")
        server = uvicorn.Server(config)
        self._server = server
        self._thread = threading.Thread(
            target=server.run, kwargs={"sockets": [listener]}, daemon=True, name="hub-server"
        )
        self._thread.start()
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                self.stop()
                raise RuntimeError("the Hub test server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=START_TIMEOUT_SECONDS)
        if self._socket is not None:
            self._socket.close()
        self._server = self._thread = self._socket = None

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/api/models", self._search, methods=["GET"]),
                Route("/api/models/{rest:path}", self._model_api, methods=["GET"]),
                Route("/{rest:path}", self._resolve, methods=["GET", "HEAD"]),
            ]
        )

    # ----- routes ------------------------------------------------------------------

    async def _search(self, request: Request) -> Response:
        self._record(request)
        query = request.query_params.get("search", "").lower()
        limit = int(request.query_params.get("limit") or 1000)
        found = [
            self._summary(repository)
            for repo_id, repository in sorted(self.repositories.items())
            if query in repo_id.lower()
        ]
        return JSONResponse(found[:limit])

    async def _model_api(self, request: Request) -> Response:
        rest = request.path_params["rest"]
        repo_id, _, tail = rest.partition("/")
        name, _, tail = tail.partition("/")
        repo_id = f"{repo_id}/{name}"
        self._record(request, repo_id)
        repository = self.repositories.get(repo_id)
        if repository is None:
            return _error(404, "RepoNotFound", "Repository not found")
        kind, _, tail = tail.partition("/")
        revision, _, path = tail.partition("/")
        if kind and not repository.has_revision(revision):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        if kind in ("", "revision"):
            blobs = request.query_params.get("blobs") == "true"
            return JSONResponse(self._info(repository, blobs))
        if kind == "tree":
            recursive = request.query_params.get("recursive") in ("true", "True", "1")
            return JSONResponse(_tree(repository, path, recursive))
        return _error(404, None, f"no route {request.url.path}")

    async def _resolve(self, request: Request) -> Response:
        parts = request.path_params["rest"].split("/")
        if len(parts) < 5 or parts[2] != "resolve":
            self._record(request)
            return _error(404, None, "Not Found")
        repo_id = "/".join(parts[:2])
        revision = parts[3]
        filename = "/".join(parts[4:])
        self._record(request, repo_id, filename)
        repository = self.repositories.get(repo_id)
        if repository is None:
            return _error(404, "RepoNotFound", "Repository not found")
        if not repository.has_revision(revision):
            return _error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        refusal = _access_refusal(repository, request.headers.get("authorization"))
        if refusal is not None:
            return refusal
        hub_file = repository.files.get(filename)
        if hub_file is None:
            return _error(404, "EntryNotFound", f"{filename} does not exist")
        file_request = FileRequest(
            request.method, repository, hub_file, request.headers.get("range"), request
        )
        for hook in self.hooks:
            answer = hook(file_request)
            if answer is not None:
                return answer
        return file_response(file_request)

    # ----- bodies ------------------------------------------------------------------

    def _summary(self, repository: HubRepository) -> dict[str, Any]:
        config = _config_of(repository)
        return {
            "_id": repository.sha[:24],
            "id": repository.repo_id,
            "modelId": repository.repo_id,
            "private": False,
            "gated": repository.gated,
            "downloads": 0,
            "likes": 0,
            "tags": ["transformers", "safetensors"],
            "library_name": "transformers",
            "pipeline_tag": "text-generation",
            "createdAt": "2026-01-01T00:00:00.000Z",
            "config": config,
        }

    def _info(self, repository: HubRepository, blobs: bool) -> dict[str, Any]:
        siblings: list[dict[str, Any]] = []
        for path, hub_file in sorted(repository.files.items()):
            sibling: dict[str, Any] = {"rfilename": path}
            if blobs:
                sibling["size"] = len(hub_file.data)
                sibling["blobId"] = hub_file.blob_id
                if hub_file.is_lfs:
                    sibling["lfs"] = {
                        "sha256": hub_file.sha256,
                        "size": len(hub_file.data),
                        "pointerSize": 134,
                    }
            siblings.append(sibling)
        return {
            **self._summary(repository),
            "sha": repository.sha,
            "disabled": False,
            "lastModified": "2026-01-01T00:00:00.000Z",
            "siblings": siblings,
        }


def _access_refusal(repository: HubRepository, authorization: str | None) -> Response | None:
    if repository.tokens is None:
        return None
    token = authorization.removeprefix("Bearer ").strip() if authorization else ""
    if not token:
        return _error(
            401,
            "GatedRepo",
            f"Access to model {repository.repo_id} is restricted. You must have access to it "
            "and be authenticated to access it. Please log in.",
        )
    if token not in repository.tokens:
        return _error(
            403,
            "GatedRepo",
            f"Access to model {repository.repo_id} is restricted and you are not in the "
            "authorized list.",
        )
    return None


def _tree(repository: HubRepository, under: str, recursive: bool) -> list[dict[str, Any]]:
    prefix = f"{under.strip('/')}/" if under.strip("/") else ""
    entries: list[dict[str, Any]] = []
    directories: set[str] = set()
    for path, hub_file in sorted(repository.files.items()):
        if not path.startswith(prefix):
            continue
        relative = path[len(prefix) :]
        if "/" in relative:
            parts = relative.split("/")[:-1]
            depth = len(parts) if recursive else 1
            directories.update(prefix + "/".join(parts[: i + 1]) for i in range(depth))
            if not recursive:
                continue
        entry: dict[str, Any] = {
            "type": "file",
            "oid": hub_file.blob_id,
            "size": len(hub_file.data),
            "path": path,
        }
        if hub_file.is_lfs:
            entry["lfs"] = {
                "oid": hub_file.sha256,
                "size": len(hub_file.data),
                "pointerSize": 134,
            }
        entries.append(entry)
    entries += [
        {"type": "directory", "oid": git_blob_id(name.encode()), "size": 0, "path": name}
        for name in sorted(directories)
    ]
    return entries


def _config_of(repository: HubRepository) -> dict[str, Any]:
    """The parts of config.json the Hub's model info repeats (`architectures`,
    `model_type`), as its `config` field."""
    import json

    hub_file = repository.files.get("config.json")
    if hub_file is None:
        return {}
    try:
        config = json.loads(hub_file.data)
    except ValueError:
        return {}
    return {key: config[key] for key in ("architectures", "model_type") if key in config}


def _error(status_code: int, error_code: str | None, message: str) -> Response:
    # Header values are latin-1 on the wire: a revision or path echoed in the message may
    # hold any character (schemathesis sends them), so the header carries it escaped.
    headers = {"X-Error-Message": message.encode("ascii", "backslashreplace").decode()}
    if error_code is not None:
        headers["X-Error-Code"] = error_code
    return JSONResponse({"error": message}, status_code=status_code, headers=headers)
