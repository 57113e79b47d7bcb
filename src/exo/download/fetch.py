"""One file over HTTP into place: resumed from its partial file with a `Range` request,
verified against the digest its source publishes before it takes its final name, retried
with backoff on 429 / 5xx (honouring `Retry-After`) and on cut transfers, a bounded number
of times.

The file is written as `<name>.partial` next to its final path and renamed only once its
digest matches, so a reader never sees a half-written or corrupted file under the real name.
A partial file left by a killed process is where the next attempt resumes.
"""

from __future__ import annotations

import email.utils
import hashlib
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

import httpx

PARTIAL_SUFFIX = ".partial"
CHUNK_BYTES = 1 << 20
RETRIED_STATUSES = frozenset({408, 429, 500, 502, 503, 504})


class DownloadError(RuntimeError):
    """A file could not be fetched; `status_code` is the HTTP status that ended it
    (None: a network error, a digest mismatch or too many attempts)."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


class DownloadCancelledError(DownloadError):
    """The download was cancelled; the partial file stays for a later resume."""


@dataclass(frozen=True, slots=True)
class ExpectedFile:
    """What a fetched file must be: `size` bytes whose `algorithm` digest is `digest` (hex).
    "sha256" for LFS files (the Hub's `lfs.sha256`), "git-blob" (SHA-1 of
    `blob <size>\\0` + content, the Hub's ETag for small files) for the others."""

    size: int
    algorithm: Literal["sha256", "git-blob"]
    digest: str


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """At most `max_attempts` requests per file; between them `base_delay_seconds * 2**n`
    capped at `max_delay_seconds`, or the server's `Retry-After` (capped at
    `max_retry_after_seconds`)."""

    max_attempts: int = 6
    base_delay_seconds: float = 0.5
    max_delay_seconds: float = 30.0
    max_retry_after_seconds: float = 120.0

    def delay(self, attempt: int, retry_after: float | None) -> float:
        """Seconds to wait after the `attempt`-th failed attempt (1-based)."""
        if retry_after is not None:
            return min(max(retry_after, 0.0), self.max_retry_after_seconds)
        return float(min(self.max_delay_seconds, self.base_delay_seconds * 2 ** (attempt - 1)))


DEFAULT_RETRY_POLICY = RetryPolicy()


class Digest(Protocol):
    def update(self, data: bytes, /) -> None: ...
    def hexdigest(self) -> str: ...


def new_digest(expected: ExpectedFile) -> Digest:
    """A running digest of the file's content in `expected`'s algorithm."""
    if expected.algorithm == "sha256":
        return hashlib.sha256()
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % expected.size)
    return digest


def partial_path(destination: Path) -> Path:
    return destination.with_name(destination.name + PARTIAL_SUFFIX)


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds a `Retry-After` header asks to wait (delta-seconds or an HTTP date);
    None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


ByteCallback = Callable[[int], None]
"""Called with the file's bytes on disk so far (after each chunk; may go back to 0)."""


def fetch_file(
    client: httpx.Client,
    url: str,
    destination: Path,
    expected: ExpectedFile,
    headers: Mapping[str, str] | None = None,
    on_bytes: ByteCallback | None = None,
    cancelled: threading.Event | None = None,
    policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    sleep: Callable[[float], None] | None = None,
) -> None:
    """Fetch `url` into `destination`, verified.

    Args:
        client: follows redirects (the Hub sends LFS files to a CDN); proxies as it is set.
        expected: size and digest the file must have.
        headers: sent with every request (e.g. `Authorization`).
        on_bytes: progress, see `ByteCallback`.
        cancelled: checked between chunks and before each attempt; it also ends a wait
            between attempts.
        sleep: waits between attempts (default: on `cancelled`, or `time.sleep`).

    Raises:
        DownloadCancelledError: `cancelled` was set (the partial file stays).
        DownloadError: a status other than 2xx / 416 / a retried one (with that status),
            or every attempt failed (the last failure named). A file whose digest does not
            match is deleted and fetched again from its start, within the attempts.
    """
    partial = partial_path(destination)
    report = on_bytes or (lambda _bytes: None)
    wait: Callable[[float], object] = sleep or (time.sleep if cancelled is None else cancelled.wait)
    last_failure = "no attempt"
    for attempt in range(1, policy.max_attempts + 1):
        if cancelled is not None and cancelled.is_set():
            raise DownloadCancelledError(f"download of {destination.name} cancelled")
        retry_after: float | None = None
        try:
            outcome = _attempt(client, url, partial, expected, headers, report, cancelled)
        except httpx.TransportError as error:
            # Cut mid-transfer or no connection: what arrived stays in the partial file.
            last_failure = f"{type(error).__name__}: {error}"
        else:
            if isinstance(outcome, _Retry):
                last_failure, retry_after = outcome.reason, outcome.retry_after
            else:
                partial.replace(destination)
                report(expected.size)
                return
        if attempt < policy.max_attempts:
            wait(policy.delay(attempt, retry_after))
    raise DownloadError(
        f"{destination.name}: {policy.max_attempts} attempts failed; the last: {last_failure}"
    )


@dataclass(frozen=True, slots=True)
class _Retry:
    reason: str
    retry_after: float | None = None


def _attempt(
    client: httpx.Client,
    url: str,
    partial: Path,
    expected: ExpectedFile,
    headers: Mapping[str, str] | None,
    report: ByteCallback,
    cancelled: threading.Event | None,
) -> _Retry | None:
    """One request: None when the partial file is now whole and verified."""
    partial.parent.mkdir(parents=True, exist_ok=True)
    have = partial.stat().st_size if partial.exists() else 0
    if have > expected.size:
        partial.unlink()
        have = 0
    request_headers = dict(headers or {})
    if have == expected.size:
        return _verify(partial, expected)
    if have:
        request_headers["Range"] = f"bytes={have}-"
    with client.stream("GET", url, headers=request_headers) as response:
        status = response.status_code
        if status == 416:
            partial.unlink(missing_ok=True)
            return _Retry(f"{url}: the server refused the resume range (416)")
        if status in RETRIED_STATUSES:
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            return _Retry(f"{url} answered {status}", retry_after)
        if status not in (200, 206):
            response.read()
            raise DownloadError(f"{url} answered {status}: {_error_text(response)}", status)
        if status == 200 and have:
            have = 0  # the server ignored the range: start over
        report(have)
        with partial.open("r+b" if have else "wb") as writer:
            writer.seek(have)
            writer.truncate()
            for chunk in response.iter_bytes():  # as received: nothing held back if cut
                if cancelled is not None and cancelled.is_set():
                    raise DownloadCancelledError(f"download of {partial.name} cancelled")
                writer.write(chunk)
                have += len(chunk)
                report(have)
    if have < expected.size:
        return _Retry(f"{url}: the transfer ended after {have} of {expected.size} bytes")
    return _verify(partial, expected)


def _verify(partial: Path, expected: ExpectedFile) -> _Retry | None:
    digest = new_digest(expected)
    with partial.open("rb") as reader:
        while block := reader.read(CHUNK_BYTES):
            digest.update(block)
    actual = digest.hexdigest()
    if partial.stat().st_size == expected.size and actual == expected.digest:
        return None
    partial.unlink()
    return _Retry(
        f"{partial.name[: -len(PARTIAL_SUFFIX)]} failed verification ({expected.algorithm} "
        f"{actual}, expected {expected.digest}); deleted and fetched again"
    )


def _error_text(response: httpx.Response) -> str:
    message = response.headers.get("x-error-message")
    if message:
        return message
    return response.text[:500]
