"""`--bootstrap-peers` messages name the peer's own scheme; a node without a cluster secret
is warned that it cannot reach `tls/` peers; a cluster-tls directory that cannot be written
is reported as such (it was reported as "cannot listen")."""

from __future__ import annotations

from pathlib import Path

import pytest
from loguru import logger

from exo.cli import main
from exo.node_options import parse_args
from exo.routing.cluster_tls import TLS_DIRECTORY_NAME, ClusterSecret, TlsFilesError
from exo.routing.secret_options import bootstrap_peer_problem, tls_peer_warnings

SECRET = "correct horse battery staple"


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("tls/nohostport", "must look like tls/HOST:PORT"),
        ("quic/host:", "must look like quic/HOST:PORT"),
        ("tcp/host:99999", "a port 1-65535"),
        ("http/host:1", "must look like tcp/HOST:PORT (tls/HOST:PORT with a cluster secret"),
        ("192.168.1.7:52414", "must look like tcp/HOST:PORT"),
    ],
)
def test_a_bad_peer_is_described_in_its_own_scheme(peer: str, expected: str) -> None:
    problem = bootstrap_peer_problem(peer)
    assert problem is not None and expected in problem and repr(peer) in problem


@pytest.mark.parametrize("peer", ["tcp/192.168.1.7:52414", "tls/node.lan:1", "tcp/[::1]:52414"])
def test_good_peers_pass(peer: str) -> None:
    assert bootstrap_peer_problem(peer) is None


def test_the_command_line_refuses_with_the_peers_scheme(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--bootstrap-peers", "tls/nohostport", "--cluster-secret", SECRET])
    err = capsys.readouterr().err
    assert "tls/HOST:PORT" in err and "tcp/HOST:PORT" not in err


def test_an_open_node_is_warned_about_tls_peers() -> None:
    peers = ["tcp/10.0.0.2:52414", "tls/10.0.0.3:52414"]
    [warning] = tls_peer_warnings(None, peers)
    assert "'tls/10.0.0.3:52414'" in warning and "no cluster secret" in warning
    assert "cannot connect" in warning
    assert tls_peer_warnings(ClusterSecret(SECRET), ["tls/10.0.0.3:52414"]) == []


def test_an_unwritable_tls_directory_is_named(tmp_path: Path) -> None:
    (tmp_path / TLS_DIRECTORY_NAME).write_text("not a directory")
    with pytest.raises(TlsFilesError, match=f"cannot write the cluster's TLS files in {tmp_path}"):
        ClusterSecret(SECRET).write_tls_files(tmp_path)


def test_main_reports_the_tls_directory_not_a_port(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_HOME", str(tmp_path))
    (tmp_path / TLS_DIRECTORY_NAME).write_text("not a directory")
    # main() would replace every loguru sink; the test's sink sees what it logs.
    monkeypatch.setattr("exo.main.configure_logging", lambda level: None)
    logged: list[str] = []
    sink = logger.add(logged.append, level="INFO", format="{message}")
    try:
        with pytest.raises(SystemExit) as stopped:
            main(["--cluster-secret", SECRET, "--no-default-model", "--offline"])
    finally:
        logger.remove(sink)
    assert stopped.value.code == 1
    assert any("cannot write the cluster's TLS files" in line for line in logged), logged
    assert not any("cannot listen" in line for line in logged)
