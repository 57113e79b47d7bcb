"""The loopback Hub test server answers as the Hub does, for huggingface_hub and plain HTTP."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from starlette.responses import Response

from exo.testing.hf_file_serving import FileRequest, parse_range
from exo.testing.hf_repository import git_blob_id
from exo.testing.hf_server import HubServer

WEIGHTS = bytes(range(256)) * 40
CONFIG = b'{"architectures": ["LlamaForCausalLM"], "model_type": "llama"}'


@pytest.fixture(scope="module")
def hub() -> Iterator[HubServer]:
    with HubServer() as server:
        server.add_repository(
            "org/model",
            {"config.json": CONFIG, "model.safetensors": WEIGHTS, "sub/notes.txt": b"hello"},
        )
        server.add_repository("org/private", {"config.json": CONFIG}, tokens={"secret"})
        yield server


def resolve(hub: HubServer, path: str, revision: str = "main") -> str:
    return f"{hub.url}/org/model/resolve/{revision}/{path}"


def test_headers_of_git_and_lfs_files(hub: HubServer) -> None:
    sha = hub.repositories["org/model"].sha
    config = httpx.head(resolve(hub, "config.json"))
    assert config.status_code == 200
    assert config.headers["etag"] == f'"{git_blob_id(CONFIG)}"'
    assert config.headers["x-repo-commit"] == sha
    assert config.headers["content-length"] == str(len(CONFIG))
    assert "x-linked-etag" not in config.headers
    weights = httpx.head(resolve(hub, "model.safetensors", revision=sha))
    digest = hashlib.sha256(WEIGHTS).hexdigest()
    assert weights.headers["x-linked-etag"] == weights.headers["etag"] == f'"{digest}"'
    assert weights.headers["x-linked-size"] == str(len(WEIGHTS))
    assert weights.content == b""


def test_range_requests(hub: HubServer) -> None:
    url = resolve(hub, "model.safetensors")
    size = len(WEIGHTS)
    cases = {
        "bytes=10-19": (10, 19),
        "bytes=10000-": (10000, size - 1),
        "bytes=-5": (size - 5, size - 1),
    }
    for header, (start, end) in cases.items():
        response = httpx.get(url, headers={"Range": header})
        assert response.status_code == 206
        assert response.content == WEIGHTS[start : end + 1]
        assert response.headers["content-range"] == f"bytes {start}-{end}/{size}"
    unsatisfiable = httpx.get(url, headers={"Range": f"bytes={size}-"})
    assert unsatisfiable.status_code == 416
    assert unsatisfiable.headers["content-range"] == f"bytes */{size}"
    assert parse_range("bytes=5-2", size) is None
    assert parse_range("items=0-1", size) is None


def test_errors_carry_the_hubs_error_codes(hub: HubServer) -> None:
    cases = [
        (f"{hub.url}/api/models/org/missing", 404, "RepoNotFound"),
        (resolve(hub, "absent.json"), 404, "EntryNotFound"),
        (resolve(hub, "config.json", revision="v2"), 404, "RevisionNotFound"),
        (f"{hub.url}/org/private/resolve/main/config.json", 401, "GatedRepo"),
    ]
    for url, status, code in cases:
        response = httpx.get(url)
        assert (response.status_code, response.headers.get("x-error-code")) == (status, code)
    wrong = httpx.get(
        f"{hub.url}/org/private/resolve/main/config.json",
        headers={"Authorization": "Bearer wrong"},
    )
    assert wrong.status_code == 403
    right = httpx.get(
        f"{hub.url}/org/private/resolve/main/config.json",
        headers={"Authorization": "Bearer secret"},
    )
    assert right.content == CONFIG


def test_model_info_and_tree(hub: HubServer) -> None:
    info = httpx.get(f"{hub.url}/api/models/org/model", params={"blobs": "true"}).json()
    assert info["sha"] == hub.repositories["org/model"].sha
    siblings = {sibling["rfilename"]: sibling for sibling in info["siblings"]}
    assert set(siblings) == {"config.json", "model.safetensors", "sub/notes.txt"}
    assert siblings["model.safetensors"]["lfs"]["sha256"] == hashlib.sha256(WEIGHTS).hexdigest()
    assert info["config"] == {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    top = httpx.get(f"{hub.url}/api/models/org/model/tree/main").json()
    assert [(e["type"], e["path"]) for e in top] == [
        ("file", "config.json"),
        ("file", "model.safetensors"),
        ("directory", "sub"),
    ]
    everything = httpx.get(
        f"{hub.url}/api/models/org/model/tree/main", params={"recursive": "true"}
    ).json()
    assert {e["path"] for e in everything if e["type"] == "file"} == set(siblings)


def test_huggingface_hub_downloads_a_snapshot_and_requests_are_counted(
    hub: HubServer, tmp_path: Path
) -> None:
    from huggingface_hub import snapshot_download

    before = hub.file_requests("org/model", "model.safetensors")
    # cache_dir: even with local_dir, huggingface_hub writes refs into its cache, which
    # would otherwise be this machine's ~/.cache/huggingface, shared by every run.
    folder = snapshot_download(
        "org/model",
        endpoint=hub.url,
        local_dir=tmp_path / "snapshot",
        cache_dir=tmp_path / "hf-cache",
        token=False,
    )
    assert (Path(folder) / "model.safetensors").read_bytes() == WEIGHTS
    assert (Path(folder) / "sub" / "notes.txt").read_bytes() == b"hello"
    assert hub.file_requests("org/model", "model.safetensors") == before + 1


def test_a_hook_answers_instead_of_the_file(hub: HubServer) -> None:
    def too_many(request: FileRequest) -> Response | None:
        if request.file.path == "config.json":
            return Response(status_code=429, headers={"Retry-After": "1"})
        return None

    hub.hooks.append(too_many)
    try:
        limited = httpx.get(resolve(hub, "config.json"))
        assert (limited.status_code, limited.headers["retry-after"]) == (429, "1")
        assert httpx.get(resolve(hub, "sub/notes.txt")).content == b"hello"
    finally:
        hub.hooks.remove(too_many)
    assert httpx.get(resolve(hub, "config.json")).content == CONFIG


def test_an_error_echoing_any_character_is_still_an_answer(hub: HubServer) -> None:
    # schemathesis sends revisions outside latin-1; the message header must still encode.
    response = httpx.get(f"{hub.url}/api/models/org/model/revision/v\U00078b74\u00e9")
    assert response.status_code == 404
    assert response.headers["X-Error-Code"] == "RevisionNotFound"
    assert "\\U00078b74" in response.headers["X-Error-Message"]
