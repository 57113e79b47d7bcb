"""The cluster secret: what keeps nodes that do not know it out of the cluster.

Every node started with the same secret derives the same certificate authority (CA) key
from it, with no exchange and nothing to copy between machines:

    root   = scrypt(secret, salt="exo cluster secret v1", n=2**15, r=8, p=1), 32 bytes
    CA key = the P-256 private key whose scalar is
             1 + HKDF-SHA256(root, info="exo cluster CA key v1", 48 bytes) mod (n - 1)

(scrypt: RFC 7914, its cost makes each guess of a weak secret slow; HKDF: RFC 5869; the
reduction of 48 random bytes modulo the group order follows FIPS 186-5 A.4.1's
"extra random bits" method). At each start a node makes its own leaf key, fresh and
random, and a certificate for it signed by that CA, and zenoh's TLS links run with mutual
authentication against the CA: a process without the secret cannot produce a certificate
any member accepts, and accepts none of theirs.

The CA certificate itself is rebuilt by each node (ECDSA signatures are randomized, so the
bytes differ between nodes); what matters to TLS is the CA's name and public key, which are
the same on every node with the secret.

Certificates name no node: a process without the secret that connects to a member's port
sees that member's leaf certificate (TLS 1.3 sends it before asking for the client's), and
learns only that an exo cluster member listens there.

The API's peer credential (`X-Exo-Peer-Credential`, `exo.download.peers`) is also derived
from the root: HMAC-SHA256(HKDF(root, info="exo peer credential v1"), namespace). So is the
key split instances' ranks authenticate each other with (rendezvous store, rank links, and
gloo's pairs where `EXO_RANK_LINKS=0` forms a gloo group:
`exo.worker.engines.torch.comm.group_auth`): HKDF(root, info="exo rank group key v1").
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from cryptography.hazmat.primitives.kdf.scrypt import Scrypt
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

MIN_SECRET_CHARACTERS = 12
TLS_DIRECTORY_NAME = "cluster-tls"
CA_NAME = "exo cluster CA"
LEAF_NAME = "exo cluster member"
# The name leaf certificates carry; links do not check it (every member may take any name).
LEAF_DNS_NAME = "exo-cluster-member"
# scrypt's cost (RFC 7914): 2**15 x 8 x 128 bytes = 32 MiB and ~0.1 s per derivation.
SCRYPT_N = 2**15
SCRYPT_R = 8
SCRYPT_P = 1
_SCRYPT_SALT = b"exo cluster secret v1"
_CA_INFO = b"exo cluster CA key v1"
_CREDENTIAL_INFO = b"exo peer credential v1"
_RANK_GROUP_INFO = b"exo rank group key v1"
# The CA certificate's validity: fixed, so that it never depends on a node's clock.
_CA_NOT_BEFORE = datetime.datetime(2000, 1, 1, tzinfo=datetime.UTC)
_CA_NOT_AFTER = datetime.datetime(2999, 12, 31, tzinfo=datetime.UTC)
# A leaf is made at each start; it is valid from a day before (clocks differ between
# machines) for ten years (a node may run long).
_LEAF_BACKDATE = datetime.timedelta(days=1)
_LEAF_LIFETIME = datetime.timedelta(days=3650)
# The order n of the P-256 group (SEC 2, section 2.4.2).
_P256_ORDER = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551


class TlsFilesError(RuntimeError):
    """The cluster's TLS files could not be written (`ClusterSecret.write_tls_files`)."""


class ClusterSecretError(ValueError):
    """A cluster secret that cannot be used (too short, unreadable file)."""


class ClusterSecret:
    """A cluster secret and what is derived from it.

    Args:
        secret: the secret text, at least `MIN_SECRET_CHARACTERS` characters after
            stripping surrounding whitespace.

    Raises:
        ClusterSecretError: the secret is too short.
    """

    def __init__(self, secret: str) -> None:
        text = secret.strip()
        if len(text) < MIN_SECRET_CHARACTERS:
            raise ClusterSecretError(
                f"the cluster secret must have at least {MIN_SECRET_CHARACTERS} characters "
                f"(it has {len(text)}); e.g. python -c 'import secrets; "
                "print(secrets.token_urlsafe(32))'"
            )
        kdf = Scrypt(salt=_SCRYPT_SALT, length=32, n=SCRYPT_N, r=SCRYPT_R, p=SCRYPT_P)
        self._root = kdf.derive(text.encode())

    def __repr__(self) -> str:
        return "ClusterSecret(<hidden>)"

    def _expand(self, info: bytes, length: int) -> bytes:
        return HKDF(algorithm=hashes.SHA256(), length=length, salt=None, info=info).derive(
            self._root
        )

    def ca_private_key(self) -> ec.EllipticCurvePrivateKey:
        """The cluster CA's P-256 key: the same for every node with this secret."""
        scalar = 1 + int.from_bytes(self._expand(_CA_INFO, 48), "big") % (_P256_ORDER - 1)
        return ec.derive_private_key(scalar, ec.SECP256R1())

    def peer_credential(self, namespace: str) -> str:
        """The credential members of `namespace` present to each other's API (hex)."""
        key = self._expand(_CREDENTIAL_INFO, 32)
        return hmac.new(key, namespace.encode(), hashlib.sha256).hexdigest()

    def rank_group_key(self) -> bytes:
        """The 32-byte key split instances' ranks prove membership with (the same on every
        node with this secret; `comm/group_auth.py`)."""
        return self._expand(_RANK_GROUP_INFO, 32)

    def write_tls_files(self, home: Path) -> TlsFiles:
        """Write the CA certificate, a fresh leaf key and its certificate under
        `home/cluster-tls/` (directory 0700, files 0600, each replaced atomically) for
        zenoh's TLS links. The CA's private key is never written.

        Raises:
            TlsFilesError: the directory or a file cannot be written (the message names
                the directory and the OS error).
        """
        directory = home / TLS_DIRECTORY_NAME
        try:
            return self._write_tls_files(directory)
        except OSError as error:
            raise TlsFilesError(
                f"cannot write the cluster's TLS files in {directory}: {error} (make the "
                "directory writable, or point EXO_HOME at one that is)"
            ) from error

    def _write_tls_files(self, directory: Path) -> TlsFiles:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        directory.chmod(0o700)
        ca_key = self.ca_private_key()
        ca_certificate = _ca_certificate(ca_key)
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf_certificate = _leaf_certificate(leaf_key, ca_key)
        files = TlsFiles(
            ca_certificate=directory / "ca.pem",
            certificate=directory / "node.pem",
            private_key=directory / "node.key",
        )
        _write_private(
            files.ca_certificate, ca_certificate.public_bytes(serialization.Encoding.PEM)
        )
        _write_private(
            files.private_key,
            leaf_key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        # Leaf then CA: the chain a peer is sent.
        _write_private(
            files.certificate,
            leaf_certificate.public_bytes(serialization.Encoding.PEM)
            + ca_certificate.public_bytes(serialization.Encoding.PEM),
        )
        return files


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """Paths of one node's TLS material (PEM): the cluster CA certificate, this node's
    certificate chain (leaf, then CA) and its private key."""

    ca_certificate: Path
    certificate: Path
    private_key: Path

    def zenoh_tls_config(self) -> dict[str, object]:
        """zenoh's `transport/link/tls` section: mutual TLS against the cluster CA, the
        same key and certificate for links this node accepts and links it opens. Names are
        not checked: every member holds the CA, so a name would prove nothing more."""
        return {
            "root_ca_certificate": str(self.ca_certificate),
            "listen_private_key": str(self.private_key),
            "listen_certificate": str(self.certificate),
            "connect_private_key": str(self.private_key),
            "connect_certificate": str(self.certificate),
            "enable_mtls": True,
            "verify_name_on_connect": False,
        }


def read_secret_file(path: Path) -> str:
    """The secret in `path` (its first line, whitespace stripped).

    Raises:
        ClusterSecretError: the file cannot be read or is empty.
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ClusterSecretError(f"cannot read the cluster secret file {path}: {error}") from None
    lines = text.strip().splitlines()
    if not lines:
        raise ClusterSecretError(f"the cluster secret file {path} is empty")
    return lines[0].strip()


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _ca_certificate(ca_key: ec.EllipticCurvePrivateKey) -> x509.Certificate:
    public_key = ca_key.public_key()
    return (
        x509.CertificateBuilder()
        .subject_name(_name(CA_NAME))
        .issuer_name(_name(CA_NAME))
        .public_key(public_key)
        .serial_number(1)
        .not_valid_before(_CA_NOT_BEFORE)
        .not_valid_after(_CA_NOT_AFTER)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(ca_key, hashes.SHA256())
    )


def _leaf_certificate(
    leaf_key: ec.EllipticCurvePrivateKey, ca_key: ec.EllipticCurvePrivateKey
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(_name(LEAF_NAME))
        .issuer_name(_name(CA_NAME))
        .public_key(leaf_key.public_key())
        .serial_number(int.from_bytes(secrets.token_bytes(16), "big") >> 1)
        .not_valid_before(now - _LEAF_BACKDATE)
        .not_valid_after(now + _LEAF_LIFETIME)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(LEAF_DNS_NAME)]), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )


def _write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path` readable by this user only, replacing it atomically."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(temporary, 0o600)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
