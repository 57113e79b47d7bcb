"""Model files from other nodes of the cluster.

A node serves the files of models it holds complete (`GET /peer/files/{directory}/{path}`
on its API, `Range` supported): only the files its completion marker lists as verified, and
the marker itself (which names the repository's commit, its files' sizes and the digests
they were verified against). A node that needs a model another node holds reads that
marker, then fetches each file from a peer, verified against the same digest as a Hub
download, and falls back to the Hub for a file whose peer fails or goes away mid-file (the
partial file resumes there).

Who may ask: a request must carry `X-Exo-Peer-Credential`, an HMAC of the cluster's
namespace. This keeps out clients that do not know the namespace (a browser page, a
scanner on the LAN); the namespace is no secret (the default is the protocol version), so
it does not keep out someone who knows or guesses it. With a cluster secret
(`exo.routing.cluster_tls`) the credential is derived from the secret instead.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from exo.routing.cluster_tls import ClusterSecret
from exo.shared.types.common import ModelId, NodeId
from exo.shared.types.nodes import DownloadCompleted
from exo.shared.types.state import State

PEER_CREDENTIAL_HEADER = "X-Exo-Peer-Credential"
PEER_FILES_PREFIX = "/peer/files"
# A peer whose measured link is slower than this is not worth asking before the Hub
# (Mbit/s; an unmeasured link is tried: peers are usually on the LAN).
HUB_ASSUMED_MBPS = 50.0


def peer_credential(namespace: str, secret: ClusterSecret | None = None) -> str:
    """What a member of the cluster `namespace` presents to another member's API (hex):
    derived from the cluster secret when there is one, else from the namespace."""
    if secret is not None:
        return secret.peer_credential(namespace)
    return hmac.new(namespace.encode(), b"exo peer files v1", hashlib.sha256).hexdigest()


def credential_matches(presented: str | None, expected: str) -> bool:
    """Whether `presented` is the `expected` peer credential (constant-time compare)."""
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


@dataclass(frozen=True, slots=True)
class PeerSource:
    """A node that holds the model complete, at `base_url` (`http://address:port`)."""

    node_id: NodeId
    base_url: str
    credential: str
    bandwidth_mbps: float | None = None

    def url(self, directory_name: str, path: str) -> str:
        return f"{self.base_url}{PEER_FILES_PREFIX}/{quote(directory_name)}/{quote(path)}"

    @property
    def headers(self) -> Mapping[str, str]:
        return {PEER_CREDENTIAL_HEADER: self.credential}


def peers_holding(
    state: State,
    node_id: NodeId,
    model_id: ModelId,
    credential: str,
    hub_mbps: float = HUB_ASSUMED_MBPS,
) -> list[PeerSource]:
    """The other nodes that reported `model_id` complete and that this node can reach (a
    measured link from it, else an address the node announces), fastest measured link
    first; a peer whose measured link is slower than `hub_mbps` is left out."""
    peers: list[PeerSource] = []
    links = state.topology.get(node_id, {})
    for other, models in sorted(state.downloads.items()):
        if other == node_id or not isinstance(models.get(model_id), DownloadCompleted):
            continue
        info = state.node_info.get(other)
        if info is None or not info.api_port:
            continue
        link = links.get(other)
        if link is not None:
            if 0 < link.bandwidth_mbps < hub_mbps:
                continue
            address, bandwidth = link.address, link.bandwidth_mbps or None
        elif info.api_addresses:
            address, bandwidth = info.api_addresses[0], None
        else:
            continue
        host = f"[{address}]" if ":" in address else address
        peers.append(PeerSource(other, f"http://{host}:{info.api_port}", credential, bandwidth))
    return sorted(peers, key=lambda peer: -(peer.bandwidth_mbps or 0.0))


def servable_file(roots: Sequence[Path], directory_name: str, path: str) -> Path | None:
    """The file a peer may be served: `path` of the model `directory_name` in one of
    `roots`, listed as verified in that copy's completion marker (or the marker itself).
    None for anything else (unknown model, unverified or partial file, a path leaving the
    directory)."""
    from exo.download.completion import COMPLETION_MARKER, read_marker

    if "/" in directory_name or directory_name in ("", ".", ".."):
        return None
    parts = Path(path).parts
    if not parts or any(part in ("", ".", "..") for part in parts) or Path(path).is_absolute():
        return None
    for root in roots:
        directory = root / directory_name
        marker = read_marker(directory)
        if marker is None:
            continue
        if path == COMPLETION_MARKER:
            return directory / COMPLETION_MARKER
        verified = marker.get("files")
        if isinstance(verified, dict) and path in verified and (directory / path).is_file():
            return directory / path
    return None
