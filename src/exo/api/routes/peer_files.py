"""Model files for other nodes of the cluster (`exo.download.peers`):
`GET /peer/files/{directory}/{path}` serves a file of a model this node holds complete, as
its completion marker lists it (`Range` requests answered with 206), to requests that carry
the cluster's peer credential; anything else is 403 (no or a wrong credential) or 404."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from exo.api.wire.errors import ApiError, ModelNotFoundError
from exo.download.locations import ModelLocations
from exo.download.peers import (
    PEER_CREDENTIAL_HEADER,
    PEER_FILES_PREFIX,
    credential_matches,
    peer_credential,
    servable_file,
)
from exo.shared.constants import models_dir

router = APIRouter()


class PeerCredentialError(ApiError):
    status_code = 403
    error_type = "permission_error"


@router.get(f"{PEER_FILES_PREFIX}/{{directory_name}}/{{path:path}}", include_in_schema=False)
async def peer_file(directory_name: str, path: str, request: Request) -> FileResponse:
    """One verified file of a model this node holds, for a member of its cluster."""
    # The node sets `peer_credential` (secret-derived with a cluster secret); apps that
    # set only `peer_namespace` expect the namespace's credential.
    expected: str | None = getattr(request.app.state, "peer_credential", None)
    namespace: str | None = getattr(request.app.state, "peer_namespace", None)
    if expected is None and namespace is not None:
        expected = peer_credential(namespace)
    if expected is None or not credential_matches(
        request.headers.get(PEER_CREDENTIAL_HEADER), expected
    ):
        raise PeerCredentialError("model files are served only to nodes of this cluster")
    locations = ModelLocations.from_environment(models_dir())
    found = servable_file((*locations.writable, *locations.read_only), directory_name, path)
    if found is None:
        raise ModelNotFoundError(f"this node holds no verified {directory_name}/{path}")
    return FileResponse(found, media_type="application/octet-stream")
