"""The cluster secret's key and certificate derivation (`exo.routing.cluster_tls`)."""

from __future__ import annotations

import argparse
import stat
from pathlib import Path
from typing import cast

import httpx
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.download.peers import PEER_CREDENTIAL_HEADER, peer_credential
from exo.routing.cluster_tls import (
    LEAF_NAME,
    TLS_DIRECTORY_NAME,
    ClusterSecret,
    ClusterSecretError,
    read_secret_file,
)
from exo.routing.secret_options import add_cluster_secret_arguments, cluster_secret_option
from exo.testing.scripted_cluster import ScriptedCluster

SECRET = "correct horse battery staple"


def _public_bytes(secret: ClusterSecret) -> bytes:
    return (
        secret.ca_private_key()
        .public_key()
        .public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    )


def _certificates(path: Path) -> list[x509.Certificate]:
    return x509.load_pem_x509_certificates(path.read_bytes())


def test_the_same_secret_gives_the_same_ca_key() -> None:
    assert _public_bytes(ClusterSecret(SECRET)) == _public_bytes(ClusterSecret(SECRET))
    # Surrounding whitespace (a file's newline, a pasted space) is not part of the secret.
    assert _public_bytes(ClusterSecret(f" {SECRET}\n")) == _public_bytes(ClusterSecret(SECRET))


def test_another_secret_gives_another_ca_key_and_credential() -> None:
    first, second = ClusterSecret(SECRET), ClusterSecret(SECRET + "!")
    assert _public_bytes(first) != _public_bytes(second)
    assert first.peer_credential("ns") != second.peer_credential("ns")
    assert first.peer_credential("ns") == ClusterSecret(SECRET).peer_credential("ns")
    assert first.peer_credential("ns") != first.peer_credential("other")
    # Knowing the namespace no longer gives the credential.
    assert peer_credential("ns", first) != peer_credential("ns")
    assert peer_credential("ns", first) == first.peer_credential("ns")


def test_a_short_secret_is_refused() -> None:
    with pytest.raises(ClusterSecretError, match="at least 12 characters"):
        ClusterSecret("  short  \n")


def test_the_secret_is_not_in_its_repr() -> None:
    assert SECRET not in repr(ClusterSecret(SECRET))


def test_tls_files_are_private_and_chain_to_the_derived_ca(tmp_path: Path) -> None:
    secret = ClusterSecret(SECRET)
    files = secret.write_tls_files(tmp_path)
    directory = tmp_path / TLS_DIRECTORY_NAME
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700
    for path in (files.ca_certificate, files.certificate, files.private_key):
        assert path.parent == directory
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in directory.iterdir()) == ["ca.pem", "node.key", "node.pem"]

    (ca,) = _certificates(files.ca_certificate)
    leaf, chained_ca = _certificates(files.certificate)
    derived = secret.ca_private_key().public_key()
    assert ca.public_key() == derived and chained_ca.public_key() == derived
    leaf.verify_directly_issued_by(ca)
    assert leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert ca.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    # The certificate a stranger connecting to the port sees names no node.
    assert leaf.subject.rfc4514_string() == f"CN={LEAF_NAME}"
    key = serialization.load_pem_private_key(files.private_key.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.public_key() == leaf.public_key()
    # The CA's private key is never written.
    ca_key_pem = (
        secret.ca_private_key()
        .private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        .split(b"\n")[1]
    )
    for path in directory.iterdir():
        assert ca_key_pem not in path.read_bytes()


def test_each_start_makes_a_new_leaf_under_the_same_ca(tmp_path: Path) -> None:
    first = ClusterSecret(SECRET).write_tls_files(tmp_path / "a")
    second = ClusterSecret(SECRET).write_tls_files(tmp_path / "b")
    first_leaf, _ = _certificates(first.certificate)
    second_leaf, _ = _certificates(second.certificate)
    assert first_leaf.public_key() != second_leaf.public_key()
    # Each node's leaf verifies against the other node's copy of the CA.
    (second_ca,) = _certificates(second.ca_certificate)
    first_leaf.verify_directly_issued_by(second_ca)
    foreign = ClusterSecret("a different secret").write_tls_files(tmp_path / "c")
    (foreign_ca,) = _certificates(foreign.ca_certificate)
    with pytest.raises(InvalidSignature):
        first_leaf.verify_directly_issued_by(foreign_ca)


def _parse(argv: list[str]) -> ClusterSecret | None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bootstrap-peers", default="")
    add_cluster_secret_arguments(parser)
    args = parser.parse_args(argv)
    peers = [p for p in args.bootstrap_peers.split(",") if p]
    return cluster_secret_option(args, parser, peers)


def test_secret_from_flag_file_or_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("EXO_CLUSTER_SECRET", raising=False)
    assert _parse([]) is None
    expected = _public_bytes(ClusterSecret(SECRET))
    from_flag = _parse(["--cluster-secret", SECRET])
    assert from_flag is not None and _public_bytes(from_flag) == expected
    path = tmp_path / "secret"
    path.write_text(f"{SECRET}\n", encoding="utf-8")
    assert read_secret_file(path) == SECRET
    from_file = _parse(["--cluster-secret-file", str(path)])
    assert from_file is not None and _public_bytes(from_file) == expected
    monkeypatch.setenv("EXO_CLUSTER_SECRET", SECRET)
    from_environment = _parse(["--bootstrap-peers", "tls/10.0.0.2:52414"])
    assert from_environment is not None and _public_bytes(from_environment) == expected

    for argv, message in (
        (["--bootstrap-peers", "tcp/10.0.0.2:52414"], "peers are tls/HOST:PORT"),
        (["--cluster-secret", "short"], "at least 12 characters"),
        (["--cluster-secret-file", str(tmp_path / "missing")], "cannot read"),
        (["--cluster-secret", SECRET, "--cluster-secret-file", str(path)], "not allowed"),
    ):
        with pytest.raises(SystemExit):
            _parse(argv)
        assert message in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_file_route_takes_only_the_secret_credential(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXO_MODELS_DIRS", str(tmp_path))
    monkeypatch.delenv("EXO_MODELS_READ_ONLY_DIRS", raising=False)
    secret = ClusterSecret(SECRET)
    app = create_app(cast(ClusterClient, ScriptedCluster()))
    app.state.peer_credential = peer_credential("ns", secret)
    transport = httpx.ASGITransport(app=app)
    url = "/peer/files/someone--tiny/config.json"
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
        for wrong in (peer_credential("ns"), peer_credential("ns", ClusterSecret(SECRET + "!"))):
            response = await client.get(url, headers={PEER_CREDENTIAL_HEADER: wrong})
            assert response.status_code == 403
        # Past the credential check: this node holds no such model.
        right = {PEER_CREDENTIAL_HEADER: peer_credential("ns", secret)}
        assert (await client.get(url, headers=right)).status_code == 404
