"""How the Hub stand-in (`exo.testing.hf_server`) answers a request for one file:
`file_response` (the file or the part its `Range` asks for, with the Hub's headers), and
the `FileHook`s a test puts in front of it to answer instead — a 429, a cut or corrupted
transfer (`FaultHook`, built by `cut_transfer`, `corrupt_byte`, `too_many_requests`; append
them to `HubServer.hooks`).
"""

from __future__ import annotations

import re
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from exo.testing.hf_repository import HubFile, HubRepository

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


@dataclass(frozen=True, slots=True)
class FileRequest:
    """A request for one file, as hooks see it (`range` is the raw `Range` header)."""

    method: str
    repository: HubRepository
    file: HubFile
    range: str | None
    request: Request


FileHook = Callable[[FileRequest], Response | None]
"""Answers a file request instead of the server (return a response), or lets it through
(return None)."""


def file_response(file_request: FileRequest) -> Response:
    """The file (or the part its `Range` asks for) with the Hub's headers."""
    hub_file = file_request.file
    size = len(hub_file.data)
    headers = {
        "ETag": f'"{hub_file.etag}"',
        "X-Repo-Commit": file_request.repository.sha,
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    if hub_file.is_lfs:
        headers["X-Linked-Etag"] = f'"{hub_file.etag}"'
        headers["X-Linked-Size"] = str(size)
    status = 200
    body = hub_file.data
    if file_request.range is not None:
        span = parse_range(file_request.range, size)
        if span is None:
            return Response(
                status_code=416, headers={**headers, "Content-Range": f"bytes */{size}"}
            )
        start, end = span
        body = hub_file.data[start : end + 1]
        headers["Content-Range"] = f"bytes {start}-{end}/{size}"
        status = 206
    headers["Content-Length"] = str(len(body))
    if file_request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    return Response(body, status_code=status, headers=headers)


def parse_range(header: str, size: int) -> tuple[int, int] | None:
    """The inclusive byte span of a single-range `Range` header (`bytes=a-b`, `bytes=a-`,
    `bytes=-n`), clipped to the file; None when it cannot be satisfied."""
    match = _RANGE.match(header.strip())
    if match is None or match.group(1) == match.group(2) == "":
        return None
    first, last = match.group(1), match.group(2)
    if first == "":
        length = int(last)
        if length == 0:
            return None
        return max(0, size - length), size - 1
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    if start >= size or end < start:
        return None
    return start, end


# ----- fault hooks (append to `HubServer.hooks`) ------------------------------------------


@dataclass(slots=True)
class FaultHook:
    """Answers the first `times` GET requests for `repo_id`/`path` with a fault instead of
    the file; `used` counts the faults served. Build with `cut_transfer`,
    `corrupt_byte` or `too_many_requests`."""

    repo_id: str
    path: str
    times: int
    answer: Callable[[FileRequest], Response]
    used: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __call__(self, file_request: FileRequest) -> Response | None:
        if (
            file_request.method != "GET"
            or file_request.repository.repo_id != self.repo_id
            or file_request.file.path != self.path
        ):
            return None
        with self.lock:
            if self.used >= self.times:
                return None
            self.used += 1
        return self.answer(file_request)


def cut_transfer(repo_id: str, path: str, after_bytes: int, times: int = 1) -> FaultHook:
    """Send the file's headers (full `Content-Length`) and only its first `after_bytes`
    bytes of what was asked, then drop the connection, as a dying link does."""

    def answer(file_request: FileRequest) -> Response:
        whole = file_response(file_request)
        body = bytes(whole.body)[:after_bytes]

        async def stream() -> AsyncIterator[bytes]:
            yield body
            raise ConnectionAbortedError("the Hub test server cut the transfer")

        headers = {key: value for key, value in whole.headers.items() if key != "content-length"}
        headers["Content-Length"] = whole.headers["content-length"]
        return StreamingResponse(stream(), status_code=whole.status_code, headers=headers)

    return FaultHook(repo_id, path, times, answer)


def corrupt_byte(repo_id: str, path: str, offset: int = 0, times: int = 1) -> FaultHook:
    """Serve the file with the byte at `offset` (of what was asked) flipped."""

    def answer(file_request: FileRequest) -> Response:
        whole = file_response(file_request)
        body = bytearray(whole.body)
        if body:
            body[min(offset, len(body) - 1)] ^= 0xFF
        return Response(bytes(body), status_code=whole.status_code, headers=dict(whole.headers))

    return FaultHook(repo_id, path, times, answer)


def too_many_requests(
    repo_id: str, path: str, retry_after: str = "0", times: int = 1, status_code: int = 429
) -> FaultHook:
    """Answer 429 (or another `status_code`, e.g. 503) with `Retry-After: retry_after`."""

    def answer(_file_request: FileRequest) -> Response:
        return JSONResponse(
            {"error": "rate limited"},
            status_code=status_code,
            headers={"Retry-After": retry_after},
        )

    return FaultHook(repo_id, path, times, answer)
