"""Connection changes: which exo nodes of this cluster (namespace) are reachable.

The networked router turns zenoh liveliness tokens into these messages; a node never
reports itself.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from exo.shared.types.common import FrozenModel, NodeId


class PeerConnected(FrozenModel):
    """`node_id` appeared in the cluster (it was already there when this node started,
    or it just joined)."""

    kind: Literal["PeerConnected"] = "PeerConnected"
    node_id: NodeId


class PeerDisconnected(FrozenModel):
    """`node_id` left: it closed its router, or its zenoh lease expired (killed process,
    lost link)."""

    kind: Literal["PeerDisconnected"] = "PeerDisconnected"
    node_id: NodeId


ConnectionMessage = Annotated[PeerConnected | PeerDisconnected, Field(discriminator="kind")]
