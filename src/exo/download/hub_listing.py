"""The Hub's view of a repository: its files at one commit, with the size and digest each
is verified against (`HfApi.model_info(files_metadata=True)`, honouring `HF_ENDPOINT` and
`HF_TOKEN` as set when called), and the errors a download reports."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from exo.download.fetch import ExpectedFile

DEFAULT_ENDPOINT = "https://huggingface.co"
HUB_TIMEOUT_SECONDS = 30.0


class HubDownloadError(RuntimeError):
    """The shard's files could not be fetched: `status_code` 401 / 403 gated without
    access, 404 unknown repository, revision or file, 507 not enough disk, 503 the Hub
    unreachable or failing, 409 offline with files missing, None otherwise."""

    def __init__(self, message: str, status_code: int | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code


def hub_endpoint() -> str:
    """The Hub to ask: `HF_ENDPOINT` as set now (a mirror, or a test server)."""
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def hub_token() -> str | None:
    """`HF_TOKEN` (or the token `huggingface-cli login` stored), as huggingface_hub finds it."""
    from huggingface_hub import get_token

    return get_token()


@dataclass(frozen=True, slots=True)
class RemoteFile:
    path: str
    expected: ExpectedFile


@dataclass(frozen=True, slots=True)
class RepositoryListing:
    """A repository at one commit: every file with its size and digest."""

    repo_id: str
    commit: str
    files: Mapping[str, RemoteFile]


def list_repository(repo_id: str, revision: str) -> RepositoryListing:
    """The repository's files at `revision`, pinned to its commit.

    Raises:
        HubDownloadError: 404 unknown repository or revision, 401 / 403 refused, 503
            the Hub unreachable or failing.
    """
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    endpoint = hub_endpoint()
    try:
        info = HfApi(endpoint=endpoint).model_info(
            repo_id, revision=revision, files_metadata=True, timeout=HUB_TIMEOUT_SECONDS
        )
    except GatedRepoError:
        raise HubDownloadError(gated_message(repo_id, endpoint), 401) from None
    except RevisionNotFoundError:
        raise HubDownloadError(f"{repo_id} has no revision {revision!r}", 404) from None
    except RepositoryNotFoundError:
        raise HubDownloadError(
            f"no model repository {repo_id!r} on {endpoint} (a private one needs HF_TOKEN)", 404
        ) from None
    except HfHubHTTPError as error:
        raise HubDownloadError(f"the Hub at {endpoint} refused: {error}", 503) from None
    except Exception as error:  # httpx's and huggingface_hub's network errors
        raise HubDownloadError(
            f"cannot reach the Hugging Face Hub at {endpoint}: {type(error).__name__}: {error}",
            503,
        ) from None
    files: dict[str, RemoteFile] = {}
    for sibling in info.siblings or ():
        if sibling.lfs is not None:
            expected = ExpectedFile(sibling.lfs.size, "sha256", sibling.lfs.sha256)
        elif sibling.blob_id is not None and sibling.size is not None:
            expected = ExpectedFile(sibling.size, "git-blob", sibling.blob_id)
        else:
            raise HubDownloadError(
                f"the Hub at {endpoint} gave no size or digest for {repo_id}/{sibling.rfilename}",
                503,
            )
        files[sibling.rfilename] = RemoteFile(sibling.rfilename, expected)
    return RepositoryListing(repo_id, info.sha or revision, files)


def gated_message(repo_id: str, endpoint: str, status_code: int = 401) -> str:
    if status_code == 401 or hub_token() is None:
        return (
            f"{repo_id} is gated: set HF_TOKEN (on every node) to a token of an account that "
            f"accepted its terms at {endpoint}/{repo_id}"
        )
    return (
        f"{repo_id} is gated and the token in HF_TOKEN has no access to it: accept its terms "
        f"at {endpoint}/{repo_id} with that account"
    )
