"""Searching the Hugging Face Hub's models (`GET /models/search`): one request to the Hub's
`/api/models` listing, each result with the architecture its config names, so the caller
can tell which models a family file covers. The Hub is found and refused as for a custom
model's card (`exo.download.custom_cards`): `HF_ENDPOINT`, `HF_TOKEN`, 503 when unreachable.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from exo.download.custom_cards import (
    HUB_TIMEOUT_SECONDS,
    CustomModelError,
    hub_endpoint,
    is_network_error,
)


@dataclass(frozen=True, slots=True)
class HubSearchResult:
    """One model the Hub found: its id, the architecture its config names (None when the
    Hub did not say), whether it is gated, and its popularity."""

    model_id: str
    architecture: str | None
    gated: bool
    downloads: int
    likes: int


def search_hub(query: str, limit: int) -> list[HubSearchResult]:
    """The Hub's models whose id matches `query` (at most `limit`, one page). Blocking.

    One request, not `HfApi.list_models`, whose pagination retries an unreachable Hub
    with backoff for about 20 s; a search should fail fast.

    Raises:
        CustomModelError (503): the Hub cannot be reached or refused.
    """
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    endpoint = hub_endpoint()
    params: list[tuple[str, str | int | float | bool | None]] = [("limit", limit)]
    if query:
        params.append(("search", query))
    params += [("expand", name) for name in ("config", "gated", "downloads", "likes")]
    try:
        response = get_session().get(
            f"{endpoint}/api/models",
            params=params,
            headers=build_hf_headers(),
            timeout=HUB_TIMEOUT_SECONDS,
        )
        hf_raise_for_status(response)
        found = response.json()
    except HfHubHTTPError as error:
        raise CustomModelError(f"the Hub at {endpoint} refused the search: {error}", 503) from None
    except ValueError as error:
        raise CustomModelError(f"the Hub at {endpoint} answered no JSON: {error}", 503) from None
    except Exception as error:
        if isinstance(error, OSError) or is_network_error(error):
            raise CustomModelError(
                f"cannot reach the Hugging Face Hub at {endpoint}: {error}", 503
            ) from None
        raise
    if not isinstance(found, list):
        raise CustomModelError(f"the Hub at {endpoint} answered an unexpected search result", 503)
    return [_search_result(item) for item in found[:limit] if isinstance(item, dict)]


def _search_result(item: Mapping[str, Any]) -> HubSearchResult:
    config = item.get("config")
    architectures = config.get("architectures") if isinstance(config, dict) else None
    downloads = item.get("downloads")
    likes = item.get("likes")
    return HubSearchResult(
        model_id=str(item.get("id") or item.get("modelId")),
        architecture=(
            str(architectures[0]) if isinstance(architectures, list) and architectures else None
        ),
        gated=bool(item.get("gated")),
        downloads=downloads if isinstance(downloads, int) else 0,
        likes=likes if isinstance(likes, int) else 0,
    )
