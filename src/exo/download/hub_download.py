"""A shard's files from the Hugging Face Hub into a model directory.

The Hub's model info (`hub_listing`) pins the revision to a commit and gives each file's
size, the SHA-256 of LFS files and the git blob id of the others. The node then fetches only what
its shard needs (`shard_files`), several files at a time, each resumable and verified
(`fetch.fetch_file`) from `<endpoint>/<repo>/resolve/<commit>/<path>` — huggingface_hub's
own downloader keeps its partial files in its cache layout, not ours, so the transfer is
ours. Proxies come from the environment (`HTTPS_PROXY`, ...), as httpx reads them.

The directory's completion marker (`completion`) is written last, atomically, so a
download cut anywhere never leaves a directory that looks complete.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
from loguru import logger

from exo.download.completion import (
    COMPLETION_MARKER,
    needed_files,
    read_marker,
    write_marker,
)
from exo.download.fetch import (
    DEFAULT_RETRY_POLICY,
    DownloadCancelledError,
    DownloadError,
    ExpectedFile,
    RetryPolicy,
    fetch_file,
    partial_path,
)
from exo.download.hub_listing import (
    HUB_TIMEOUT_SECONDS,
    HubDownloadError,
    RemoteFile,
    RepositoryListing,
    gated_message,
    hub_endpoint,
    hub_token,
    list_repository,
)
from exo.download.peers import PeerSource
from exo.download.progress import ProgressCallback, ProgressTracker
from exo.download.shard_files import (
    INDEX_FILE,
)
from exo.shared.types.shards import ShardMetadata

MAX_PARALLEL_FILES = 4
# Room kept free on the disk beyond the files themselves.
DISK_RESERVE_BYTES = 64 * 2**20

# ----- the download ---------------------------------------------------------------------


FreeBytes = Callable[[Path], int]


def disk_free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (or its nearest existing parent)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


@dataclass(frozen=True, slots=True)
class HubDownload:
    """What to fetch: `repo_id` at `revision` for `shard` (None: every weight file) into
    `directory`, labelled `model_id` in its marker."""

    model_id: str
    repo_id: str
    revision: str
    shard: ShardMetadata | None
    directory: Path


def download_from_hub(
    download: HubDownload,
    on_progress: ProgressCallback | None = None,
    cancelled: threading.Event | None = None,
    max_parallel: int = MAX_PARALLEL_FILES,
    policy: RetryPolicy = DEFAULT_RETRY_POLICY,
    free_bytes: FreeBytes = disk_free_bytes,
    client: httpx.Client | None = None,
    peers: Sequence[PeerSource] = (),
) -> Path:
    """Fetch the shard's files into `download.directory` and mark them complete.

    Files already verified there (its marker) are kept; partial files resume. The
    safetensors index is fetched first (it says which weight files the shard needs), then
    the free disk is checked, then the rest is fetched `max_parallel` files at a time.

    With `peers` (nodes holding the model, fastest first), the listing comes from their
    completion markers when they hold every file the shard needs (no request to the Hub
    then), and each file comes from a peer that holds it (files spread over the peers),
    verified like a Hub file; a file whose peer fails or goes away resumes from the Hub.

    Returns:
        The directory.

    Raises:
        HubDownloadError: see the class; a failure leaves verified files and partial ones
            (to resume), and a marker listing only what was verified before.
        DownloadCancelledError: `cancelled` was set.
    """
    directory = download.directory
    endpoint = hub_endpoint()
    token = hub_token()
    hub_headers = {"Authorization": f"Bearer {token}"} if token else {}
    owns_client = client is None
    http = client or httpx.Client(
        follow_redirects=True, timeout=httpx.Timeout(HUB_TIMEOUT_SECONDS, read=60.0)
    )
    repo_id = download.repo_id
    try:
        from_peers = _peer_listing(http, peers, download) if peers else None
        listing: RepositoryListing
        universe: dict[str, int] | None
        holders: dict[str, list[PeerSource]]
        if from_peers is None:
            listing, universe, holders = list_repository(repo_id, download.revision), None, {}
        else:
            listing, universe, holders = from_peers
        marker = read_marker(directory) or {}
        known = marker.get("files") if marker.get("commit") == listing.commit else None
        verified: dict[str, str] = dict(known) if isinstance(known, dict) else {}

        def sources(path: str, spread: int = 0) -> list[_Source]:
            quoted = quote(path)
            hub = _Source(
                "hub",
                f"{endpoint}/{repo_id}/resolve/{listing.commit}/{quoted}",
                hub_headers,
                policy,
            )
            holding = holders.get(path, [])
            if holding:
                first = spread % len(holding)
                holding = [*holding[first:], *holding[:first]]
            return [
                *(
                    _Source(
                        f"peer:{peer.node_id}",
                        peer.url(directory_name_of(download.model_id), path),
                        peer.headers,
                        PEER_RETRY_POLICY,
                    )
                    for peer in holding
                ),
                hub,
            ]

        directory.mkdir(parents=True, exist_ok=True)
        names = set(universe if universe is not None else listing.files)
        index: dict[str, Any] | None = None
        origins: dict[str, str] = {}  # where files fetched before the others came from
        if INDEX_FILE in names and INDEX_FILE not in listing.files:
            universe = None  # no peer holds the index verified: the Hub lists the files
        if universe is None and from_peers is not None:
            listing, holders = _hub_listing(repo_id, download.revision, listing.commit, holders)
        if INDEX_FILE in names:
            index_file = listing.files[INDEX_FILE]
            if INDEX_FILE not in verified:
                origins[INDEX_FILE] = _fetch_one(
                    http, sources(INDEX_FILE), directory, index_file, None, None
                )
                verified[INDEX_FILE] = index_file.expected.digest
            index = json.loads((directory / INDEX_FILE).read_text())
        needed = needed_files(names, index, download.shard)
        if any(path not in listing.files for path in needed):
            # The peers lack some of the shard's files: the Hub lists them.
            listing, holders = _hub_listing(repo_id, download.revision, listing.commit, holders)
            universe = None
            needed = needed_files(listing.files, index, download.shard)
        to_fetch = [listing.files[path] for path in needed if path not in verified]
        _check_disk(directory, to_fetch, free_bytes)
        tracker = ProgressTracker(
            {path: listing.files[path].expected.size for path in needed},
            on_progress,
            sha256={
                path: listing.files[path].expected.digest
                for path in needed
                if listing.files[path].expected.algorithm == "sha256"
            },
        )
        for path in needed:
            if path in verified:
                source = origins.get(path, "local")
                tracker.start_file(path, listing.files[path].expected.size, source)
        jobs = [(remote, sources(remote.path, spread)) for spread, remote in enumerate(to_fetch)]
        _fetch_parallel(http, directory, jobs, tracker, cancelled, max_parallel)
        verified.update({remote.path: remote.expected.digest for remote in to_fetch})
        sizes = (
            universe
            if universe is not None
            else {path: remote.expected.size for path, remote in listing.files.items()}
        )
        write_marker(
            directory,
            {
                "model_id": download.model_id,
                "repo_id": repo_id,
                "revision": download.revision,
                "commit": listing.commit,
                "repository_files": dict(sorted(sizes.items())),
                "files": dict(sorted(verified.items())),
            },
        )
        tracker.finish()
        return directory
    except DownloadCancelledError:
        raise
    except DownloadError as error:
        if error.status_code in (401, 403):
            raise HubDownloadError(
                gated_message(repo_id, endpoint, error.status_code), error.status_code
            ) from None
        status = 404 if error.status_code == 404 else 503
        raise HubDownloadError(f"downloading {repo_id} failed: {error}", status) from None
    except ValueError as error:
        raise HubDownloadError(f"{repo_id}: unreadable {INDEX_FILE}: {error}") from None
    finally:
        if owns_client:
            http.close()


def _hub_listing(
    repo_id: str, revision: str, peers_commit: str, holders: dict[str, list[PeerSource]]
) -> tuple[RepositoryListing, dict[str, list[PeerSource]]]:
    """The Hub's listing, keeping the peers as sources only when they hold the same commit."""
    listing = list_repository(repo_id, revision)
    return listing, holders if listing.commit == peers_commit else {}


PEER_RETRY_POLICY = RetryPolicy(max_attempts=2, base_delay_seconds=0.2)


@dataclass(frozen=True, slots=True)
class _Source:
    """Where one file may come from, tried in order: `label` is "hub" or "peer:<node>"."""

    label: str
    url: str
    headers: Mapping[str, str]
    policy: RetryPolicy


def _expected_from_marker(size: object, digest: object) -> ExpectedFile | None:
    if not isinstance(size, int) or not isinstance(digest, str):
        return None
    if len(digest) == 64:
        return ExpectedFile(size, "sha256", digest)
    if len(digest) == 40:
        return ExpectedFile(size, "git-blob", digest)
    return None


def _peer_listing(
    http: httpx.Client, peers: Sequence[PeerSource], download: HubDownload
) -> tuple[RepositoryListing, dict[str, int], dict[str, list[PeerSource]]] | None:
    """The repository as the peers' completion markers describe it: the files some peer
    holds verified (with their digests), every file's size, and which peers hold each.
    Only peers at the commit of the first that answers count. None when no peer answers
    with a marker of this repository and revision."""
    commit: str | None = None
    universe: dict[str, int] = {}
    files: dict[str, RemoteFile] = {}
    holders: dict[str, list[PeerSource]] = {}
    for peer in peers:
        try:
            response = http.get(
                peer.url(directory_name_of(download.model_id), COMPLETION_MARKER),
                headers=peer.headers,
                timeout=PEER_MARKER_TIMEOUT_SECONDS,
            )
            marker = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            continue
        if not isinstance(marker, dict) or marker.get("repo_id") != download.repo_id:
            continue
        if download.revision not in (marker.get("revision"), marker.get("commit")):
            continue
        if commit is None:
            commit = str(marker.get("commit"))
        elif marker.get("commit") != commit:
            continue
        sizes = marker.get("repository_files")
        verified = marker.get("files")
        if not isinstance(sizes, dict) or not isinstance(verified, dict):
            continue
        universe.update({str(path): int(size) for path, size in sizes.items()})
        for path, digest in verified.items():
            expected = _expected_from_marker(sizes.get(path), digest)
            if expected is None:
                continue
            files.setdefault(path, RemoteFile(path, expected))
            holders.setdefault(path, []).append(peer)
    if commit is None:
        return None
    return RepositoryListing(download.repo_id, commit, files), universe, holders


PEER_MARKER_TIMEOUT_SECONDS = 5.0


def directory_name_of(model_id: str) -> str:
    return model_id.strip("/").replace("/", "--")


def _check_disk(directory: Path, to_fetch: list[RemoteFile], free_bytes: FreeBytes) -> None:
    needed = 0
    for remote in to_fetch:
        partial = partial_path(directory / remote.path)
        have = partial.stat().st_size if partial.is_file() else 0
        needed += max(0, remote.expected.size - have)
    free = free_bytes(directory)
    if needed + DISK_RESERVE_BYTES > free:
        raise HubDownloadError(
            f"not enough disk space in {directory}: the files need {_gib(needed)} "
            f"(+{_gib(DISK_RESERVE_BYTES)} kept free), {_gib(free)} is free",
            507,
        )


def _gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def _fetch_one(
    http: httpx.Client,
    sources: Sequence[_Source],
    directory: Path,
    remote: RemoteFile,
    tracker: ProgressTracker | None,
    cancelled: threading.Event | None,
) -> str:
    """Fetch `remote` from its sources in order: the next one resumes the partial file a
    failed one left. The last source's failure is raised.

    Returns:
        The label of the source that completed it.
    """
    destination = directory / remote.path
    destination.parent.mkdir(parents=True, exist_ok=True)
    if destination.exists():
        destination.unlink()  # not in the marker: unverified, fetched again
    failure: Exception | None = None
    for source in sources:
        on_bytes = None
        if tracker is not None:
            partial = partial_path(destination)
            on_disk = partial.stat().st_size if partial.is_file() else 0
            tracker.start_file(remote.path, on_disk, source.label)

            def on_bytes(size: int) -> None:
                tracker.update(remote.path, size)

        try:
            fetch_file(
                http,
                source.url,
                destination,
                remote.expected,
                headers=source.headers,
                on_bytes=on_bytes,
                cancelled=cancelled,
                policy=source.policy,
            )
            return source.label
        except DownloadCancelledError:
            raise
        except (DownloadError, httpx.HTTPError) as error:
            failure = error
            if source is not sources[-1]:
                logger.warning(f"{remote.path} from {source.label} failed ({error}); next source")
    assert failure is not None
    raise failure


def _fetch_parallel(
    http: httpx.Client,
    directory: Path,
    jobs: Sequence[tuple[RemoteFile, Sequence[_Source]]],
    tracker: ProgressTracker,
    cancelled: threading.Event | None,
    max_parallel: int,
) -> None:
    """Fetch every file, `max_parallel` at a time; the first failure stops the others
    (their partial files stay) and is raised."""
    if not jobs:
        return
    stop = threading.Event()

    def watch_cancel() -> None:
        if cancelled is not None:
            while not stop.wait(0.1):
                if cancelled.is_set():
                    stop.set()

    watcher = threading.Thread(target=watch_cancel, daemon=True, name="download-cancel")
    watcher.start()
    try:
        with ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(jobs)))) as pool:
            futures = [
                pool.submit(_fetch_one, http, sources, directory, remote, tracker, stop)
                for remote, sources in jobs
            ]
            first: BaseException | None = None
            for future in as_completed(futures):
                error = future.exception()
                if error is not None and first is None:
                    first = error
                    stop.set()
            if first is not None:
                if cancelled is not None and cancelled.is_set():
                    raise DownloadCancelledError("download cancelled")
                # A file stopped because another failed reports the other's failure.
                raise first
        if cancelled is not None and cancelled.is_set():
            raise DownloadCancelledError("download cancelled")
    finally:
        stop.set()
        watcher.join()
