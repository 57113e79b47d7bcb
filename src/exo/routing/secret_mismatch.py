"""Saying which peers the cluster secret keeps out: zenoh refuses a TLS link whose
certificate the cluster's CA did not sign without a word to Python, so a node whose peer
runs with another secret looked alone and logged nothing about why.

`SecretMismatchWatch` runs beside a `NetworkRouter` that has a cluster secret. Every
`interval_seconds` it looks at the peers this node should link with but does not: the
`--bootstrap-peers` endpoints and the zenoh peers that answer multicast scouting (their
`Hello`: zenoh id and locators) whose zenoh id is not among the session's linked peers.
For each such `tls/` address it opens one TLS handshake of its own, with this node's
certificate and the cluster CA (`probe_tls`):

- the peer's certificate fails verification against the cluster CA: the peer runs with
  another secret (or is a zenoh TLS peer of another system): one warning naming it;
- the handshake succeeds: same secret (zenoh links it, or is about to): never probed again;
- no connection (refused, timeout) or not TLS: looked at again in the next round.

At most one warning per peer address for the router's lifetime, however many rounds or
refused links follow. `tcp/` peers are not probed (any zenoh application on the default
multicast group answers scouting). A peer that dials this node with another secret but is
neither a bootstrap peer nor heard by scouting is still refused in silence: zenoh gives no
hook on refused incoming handshakes.
"""

from __future__ import annotations

import contextlib
import json
import socket
import ssl
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import zenoh
from loguru import logger

from exo.routing.cluster_tls import TlsFiles

PROBE_TIMEOUT_SECONDS = 2.0
"""How long one probe may take to connect and shake hands (loopback or LAN: well under)."""
DEFAULT_INTERVAL_SECONDS = 10.0
SCOUTING_ANSWERS_KEPT = 256

ProbeVerdict = Literal["same secret", "another secret", "no answer"]


def probe_tls(host: str, port: int, tls: TlsFiles, timeout: float) -> ProbeVerdict:
    """One TLS handshake with the listener at (`host`, `port`) as a cluster member would
    make it (this node's certificate, the cluster CA, no name check), closed at once.

    Returns:
        "another secret" when the listener's certificate is not signed by the cluster CA,
        "same secret" when the handshake succeeds, "no answer" otherwise (nothing
        listening, a timeout, a listener that does not speak TLS).
    """
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.load_verify_locations(tls.ca_certificate)
    context.load_cert_chain(tls.certificate, tls.private_key)
    try:
        with (
            socket.create_connection((host, port), timeout=timeout) as raw,
            context.wrap_socket(raw),
        ):
            return "same secret"
    except ssl.SSLCertVerificationError:
        return "another secret"
    except OSError:  # ssl.SSLError included: refused, reset, timed out, not TLS
        return "no answer"


def tls_address(locator: str) -> tuple[str, int] | None:
    """(host, port) of a `tls/HOST:PORT` zenoh locator or endpoint (`tls/[::1]:7447`, any
    `?...` or `#...` suffix dropped); None for another protocol or a malformed one."""
    protocol, _, rest = locator.partition("/")
    if protocol != "tls":
        return None
    address = rest.split("?", 1)[0].split("#", 1)[0]
    host, _, port = address.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not host or not port.isdigit():
        return None
    return host, int(port)


class SecretMismatchWatch:
    """Warns once per peer address whose TLS certificate the cluster CA did not sign (see
    the module docstring). `start()` begins scouting and the rounds on a thread of its
    own; `stop()` ends both.

    Args:
        node_id: this node's id, for the thread's name and the log.
        tls: this node's TLS files (its certificate and the cluster CA).
        bootstrap_peers: the router's `--bootstrap-peers` endpoints.
        scouting: the router's zenoh `scouting` section, or None when multicast scouting is
            off (bootstrap peers only).
        linked_zenoh_ids: the zenoh ids this node's session links with now.
        own_zenoh_id: this node's zenoh id (it hears its own scouting answer).
        interval_seconds: time between rounds.
        probe: the handshake (`probe_tls`; replaced in tests).
    """

    def __init__(
        self,
        node_id: str,
        tls: TlsFiles,
        bootstrap_peers: Sequence[str],
        scouting: dict[str, Any] | None,
        linked_zenoh_ids: Callable[[], Iterable[str]],
        own_zenoh_id: str,
        interval_seconds: float = DEFAULT_INTERVAL_SECONDS,
        probe: Callable[[str, int, TlsFiles, float], ProbeVerdict] = probe_tls,
    ) -> None:
        self._node_id = node_id
        self._tls = tls
        self._bootstrap_peers = tuple(bootstrap_peers)
        self._scouting = scouting
        self._linked_zenoh_ids = linked_zenoh_ids
        self._own_zenoh_id = own_zenoh_id
        self._interval_seconds = interval_seconds
        self._probe = probe
        self._heard: dict[str, tuple[str, ...]] = {}  # zenoh id -> locators, from scouting
        self._settled: set[tuple[str, int]] = set()  # same secret, or warned about
        self._stop = threading.Event()
        self._scout: zenoh.Scout[zenoh.Handler[zenoh.Hello]] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._scouting is not None:
            config = zenoh.Config.from_json5(json.dumps({"scouting": self._scouting}))
            # The latest answers, read at each round (older ones dropped, never blocking).
            handler: zenoh.handlers.RingChannel[zenoh.Hello] = zenoh.handlers.RingChannel(
                SCOUTING_ANSWERS_KEPT
            )
            self._scout = zenoh.scout(handler, what="peer", config=config)
        self._thread = threading.Thread(
            target=self._run, name=f"exo-secret-watch-{self._node_id}", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """End the rounds (a probe under way ends within `PROBE_TIMEOUT_SECONDS`) and
        scouting; blocks at most `timeout` seconds."""
        self._stop.set()
        scout, self._scout = self._scout, None
        if scout is not None:
            with contextlib.suppress(zenoh.ZError):
                scout.stop()
        if self._thread is not None:
            self._thread.join(timeout)

    def check_once(self) -> list[str]:
        """One round: probe each unlinked, unsettled `tls/` address once; warn about those
        that run with another secret. Returns the warnings logged."""
        linked = set(self._linked_zenoh_ids())
        scout = self._scout
        while scout is not None and (hello := scout.try_recv()) is not None:
            self.heard(hello)
        candidates: list[tuple[str, str]] = [(peer, peer) for peer in self._bootstrap_peers]
        for zenoh_id, locators in self._heard.items():
            if zenoh_id == self._own_zenoh_id:
                continue
            if zenoh_id in linked:
                self._settled.update(filter(None, map(tls_address, locators)))
                continue
            candidates.extend(
                (f"zenoh peer {zenoh_id} at {locator}", locator) for locator in locators
            )
        warnings: list[str] = []
        for name, locator in candidates:
            address = tls_address(locator)
            if address is None or address in self._settled or self._stop.is_set():
                continue
            verdict = self._probe(*address, self._tls, PROBE_TIMEOUT_SECONDS)
            if verdict == "no answer":
                continue
            self._settled.add(address)
            if verdict == "another secret":
                warning = (
                    f"{name} presents a TLS certificate this cluster's CA did not sign: it runs "
                    "with another cluster secret (or is not an exo node), so the cluster "
                    "secrets differ and every link with it is refused; start every node "
                    "with the same --cluster-secret to join them"
                )
                logger.warning(warning)
                warnings.append(warning)
        return warnings

    def heard(self, hello: zenoh.Hello) -> None:
        """Record a scouting answer (the latest locators of its zenoh id)."""
        self._heard[str(hello.zid)] = tuple(hello.locators)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_seconds):
            try:
                self.check_once()
            except Exception:
                logger.exception(f"router {self._node_id}: the cluster secret check failed")
