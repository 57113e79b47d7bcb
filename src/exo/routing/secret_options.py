"""`exo`'s cluster secret flags: `--cluster-secret`, `--cluster-secret-file` and the
environment variable `EXO_CLUSTER_SECRET` (see `exo.routing.cluster_tls`)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path

from exo.routing.cluster_tls import ClusterSecret, ClusterSecretError, read_secret_file

SECRET_ENVIRONMENT_VARIABLE = "EXO_CLUSTER_SECRET"


def add_cluster_secret_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags choosing the cluster secret (at most one of them)."""
    group = parser.add_argument_group("cluster secret")
    choice = group.add_mutually_exclusive_group()
    choice.add_argument(
        "--cluster-secret",
        default=None,
        metavar="SECRET",
        help="only nodes with this secret join; node links become mutual TLS (default: none; "
        f"env {SECRET_ENVIRONMENT_VARIABLE})",
    )
    choice.add_argument(
        "--cluster-secret-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="read the cluster secret from the first line of this file (default: none)",
    )


def cluster_secret_option(
    args: argparse.Namespace, parser: argparse.ArgumentParser, bootstrap_peers: Sequence[str]
) -> ClusterSecret | None:
    """The parsed cluster secret (flag, file, else environment), None for an open cluster;
    `parser.error` for a short or unreadable secret, or a bootstrap peer that is not
    `tls/` while a secret is set."""
    text: str | None = args.cluster_secret
    try:
        if args.cluster_secret_file is not None:
            text = read_secret_file(args.cluster_secret_file)
        if text is None:
            text = os.environ.get(SECRET_ENVIRONMENT_VARIABLE) or None
        if text is None:
            return None
        secret = ClusterSecret(text)
    except ClusterSecretError as error:
        parser.error(str(error))
    for peer in bootstrap_peers:
        if not peer.startswith("tls/"):
            parser.error(
                f"bootstrap peer {peer!r}: with a cluster secret links are TLS, "
                "so peers are tls/HOST:PORT"
            )
    return secret


PEER_SCHEMES = ("tcp", "tls", "udp", "quic")
"""The zenoh transports a `--bootstrap-peers` entry may name."""


def bootstrap_peer_problem(peer: str) -> str | None:
    """What is wrong with one `--bootstrap-peers` entry (`SCHEME/HOST:PORT`, the host an
    address or name, IPv6 in brackets), in terms of its own scheme; None when it is fine."""
    scheme, slash, address = peer.partition("/")
    if not slash or scheme not in PEER_SCHEMES:
        return (
            f"bootstrap peer {peer!r} must look like tcp/HOST:PORT (tls/HOST:PORT with a "
            "cluster secret; udp/ and quic/ also work)"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        return f"bootstrap peer {peer!r} must look like {scheme}/HOST:PORT (a port 1-65535)"
    return None


def tls_peer_warnings(secret: ClusterSecret | None, bootstrap_peers: Sequence[str]) -> list[str]:
    """Warnings for `tls/` bootstrap peers given to a node without a cluster secret: it
    has no certificate, so it cannot connect to them."""
    if secret is not None:
        return []
    return [
        f"bootstrap peer {peer!r} is a TLS link, but this node has no cluster secret, so it "
        f"cannot connect to it: start it with the cluster's secret (--cluster-secret, "
        f"--cluster-secret-file or {SECRET_ENVIRONMENT_VARIABLE}), or use tcp/ for an open "
        "cluster"
        for peer in bootstrap_peers
        if peer.startswith("tls/")
    ]


def cluster_banner_line(secret: ClusterSecret | None) -> str:
    """The start banner's line about who may join."""
    if secret is None:
        return (
            "  [bold yellow]access    OPEN: anyone on the network who knows the namespace may "
            "join, read prompts and answers, and send commands (see --cluster-secret)[/]"
        )
    return "  access    closed: TLS links, only nodes with the cluster secret may join"
