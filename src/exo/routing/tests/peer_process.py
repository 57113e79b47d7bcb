"""A router in a process of its own, for tests that SIGKILL a peer.

python -m exo.routing.tests.peer_process NODE_ID NAMESPACE BOOTSTRAP_ENDPOINT
Prints "ready" once started; exits by itself after a minute if nobody kills it.
"""

from __future__ import annotations

import sys

import anyio

from exo.routing.zenoh_router import NetworkRouter

MAX_LIFETIME_SECONDS = 60.0


async def _serve(node_id: str, namespace: str, bootstrap: str) -> None:
    router = NetworkRouter(
        node_id,
        namespace,
        zenoh_port=0,
        listen_host="127.0.0.1",
        bootstrap_peers=[bootstrap],
        multicast=False,
    )
    async with router:
        print("ready", flush=True)
        await anyio.sleep(MAX_LIFETIME_SECONDS)


if __name__ == "__main__":
    node_id, namespace, bootstrap = sys.argv[1:4]
    anyio.run(_serve, node_id, namespace, bootstrap)
