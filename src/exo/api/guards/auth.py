"""API keys: who may use this node's HTTP API.

Three modes (`ApiAuth.mode`):
- `keys`: keys were configured (`--api-key`, `--api-key-file`, `EXO_API_KEY`); every request
  needs one of them, from any address.
- `generated`: nothing configured (the default). The node creates one key on first start,
  keeps it in `<EXO_HOME>/api_key` (0600) and requires it from every client that is not on
  loopback; loopback clients (this machine) need none.
- `open`: `--no-auth`; nobody needs a key.

A client presents a key as `Authorization: Bearer KEY` (OpenAI's and Ollama's clients),
`x-api-key: KEY` (Anthropic's), or the session cookie the dashboard gets from
`POST /auth/session` (EventSource cannot send headers). The cookie is a random session id
the node keeps server-side (`exo.api.guards.sessions`), never the key; it stops working on
sign-out and when its key is revoked. Keys are compared in constant time against every key
(`hmac.compare_digest`), and never logged: refusals name the client's address and the path
only. An address that keeps presenting keys that are not valid is locked out for a while
(429): `exo.api.guards.throttle`.

Revocation reaches open responses too: a response served to a key (or to a session of
one) is watched while it lasts, and when a SIGHUP removes the key or the session signs out
it ends at once: a stream is closed (its body ended cleanly), a response not yet begun is
a 401. Without that an `/events` stream opened before the revocation would go on sending
the cluster state (every client's prompts) for as long as the connection lasts.

Requests between nodes (topology probes, model file transfers) carry the cluster's peer
credential (`exo.download.peers`) instead of a key; it opens only `NODE_PATHS`.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
import secrets
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import anyio
from loguru import logger
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from exo.api.guards.sessions import SESSION_IDENTITY_PREFIX, DashboardSessions
from exo.api.guards.throttle import AuthThrottle
from exo.download.peers import PEER_CREDENTIAL_HEADER, PEER_FILES_PREFIX

AuthMode = Literal["keys", "generated", "open"]
API_KEY_FILE_NAME = "api_key"
KEY_IDENTITY_PREFIX = "key:"
SESSION_COOKIE = "exo_session"
SESSION_PATH = "/auth/session"
# The dashboard's page and its files load without a key, so that its key screen can show.
PUBLIC_PATHS = frozenset({"/", "/index.html", "/favicon.ico"})
PUBLIC_PREFIXES = ("/static/",)
# What a node asks another node for: its id and a bandwidth sample (topology probes) and
# model files (peer downloads).
NODE_PATHS = frozenset({"/node_id", "/bandwidth_probe"})
NODE_PREFIXES = (f"{PEER_FILES_PREFIX}/",)
CLIENT_SCOPE_KEY = "exo.client"
"""The ASGI scope key the auth middleware sets: who the request is from (`client_identity`)."""


class KeyFileError(ValueError):
    """An API key file that cannot be read or holds an unusable line."""


def check_key(key: str, source: str) -> str:
    """`key` stripped, if it can travel in an HTTP header.

    Raises:
        KeyFileError: an empty key, or one with whitespace, control or non-ASCII characters.
    """
    key = key.strip()
    if not key:
        raise KeyFileError(f"{source}: an API key must not be empty")
    if not all(33 <= ord(character) <= 126 for character in key):
        raise KeyFileError(
            f"{source}: an API key may hold only visible ASCII characters (no spaces)"
        )
    return key


def read_key_file(path: Path) -> tuple[str, ...]:
    """The keys in `path`: one per line; blank lines and lines starting with `#` are skipped.

    Raises:
        KeyFileError: the file cannot be read, or a line is not a usable key (the error
            names the line number, never its text).
    """
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise KeyFileError(f"cannot read the API key file {path}: {error}") from None
    keys: list[str] = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        keys.append(check_key(line, f"{path} line {number}"))
    return tuple(dict.fromkeys(keys))


def write_private_file(path: Path, data: bytes) -> None:
    """Write `data` to `path` atomically with mode 0600: a temporary file in the same
    directory, created 0600, flushed to disk, then renamed over `path`."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _read_private_file(path: Path) -> bytes | None:
    """`path`'s bytes, or None when it does not exist; a file others may read is made 0600
    (with a warning) before it is read."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        return None
    if mode & 0o077:
        logger.warning(f"{path} was readable by other users; its mode is now 0600")
        path.chmod(0o600)
    return path.read_bytes()


def load_or_create_key(home: Path) -> tuple[str, bool]:
    """This node's generated API key, created on first start in `home/api_key` (0600).

    Returns:
        (the key, whether it was created now).

    Raises:
        KeyFileError: the file exists but holds no usable key.
    """
    path = home / API_KEY_FILE_NAME
    stored = _read_private_file(path)
    if stored is not None:
        keys = read_key_file(path)
        if len(keys) != 1:
            raise KeyFileError(f"{path} must hold exactly one key (delete it to get a new one)")
        return keys[0], False
    key = f"exo-{secrets.token_urlsafe(32)}"
    write_private_file(path, f"{key}\n".encode())
    return key, True


def is_loopback(host: str | None) -> bool:
    """Whether a client address is on this machine's loopback (IPv4-mapped IPv6 included)."""
    if host is None:
        return False
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback


def is_public(method: str, path: str) -> bool:
    """Whether a request needs no key: the dashboard's page and files (GET/HEAD), and
    signing in and out of a dashboard session."""
    if path == SESSION_PATH:
        return method in ("POST", "DELETE")
    if method not in ("GET", "HEAD"):
        return False
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


def is_node_path(method: str, path: str) -> bool:
    """Whether a request is one nodes send each other (the peer credential opens it)."""
    return method in ("GET", "HEAD") and (path in NODE_PATHS or path.startswith(NODE_PREFIXES))


def _key_fingerprint(key: str) -> str:
    # Identifies a key in rate limits and per-client counts without holding the key there.
    return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass(frozen=True, slots=True)
class Credentials:
    """What a request presents: keys from its headers, its session cookie, and the peer
    credential."""

    keys: tuple[str, ...] = ()
    session: str | None = None
    peer: str | None = None

    @classmethod
    def from_headers(cls, headers: Iterable[tuple[bytes, bytes]]) -> Credentials:
        keys: list[str] = []
        session: str | None = None
        peer: str | None = None
        peer_header = PEER_CREDENTIAL_HEADER.lower().encode()
        for name, raw in headers:
            name = name.lower()
            value = raw.decode("latin-1").strip()
            if name == b"authorization":
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer" and token.strip():
                    keys.append(token.strip())
            elif name == b"x-api-key" and value:
                keys.append(value)
            elif name == peer_header:
                peer = value
            elif name == b"cookie":
                for part in value.split(";"):
                    cookie_name, _, cookie_value = part.strip().partition("=")
                    if cookie_name == SESSION_COOKIE and cookie_value:
                        session = cookie_value
        return cls(tuple(keys), session, peer)

    def presented(self) -> str:
        """Every credential presented, as one string (the throttle digests it to tell a
        repeat from a new guess; never logged or kept): one key alone is itself, as
        `POST /auth/session`'s key is."""
        return "\0".join(part for part in (*self.keys, self.session, self.peer) if part)


class ApiAuth:
    """The keys this node accepts, and the decision for each request.

    Args:
        mode: see the module docstring.
        keys: keys given on the command line or in `EXO_API_KEY` (mode `keys`), or the
            generated key (mode `generated`).
        key_file: `--api-key-file`, read now and again on `reload()` (SIGHUP).
        node_credential: the peer credential of this node's cluster (None: no node paths
            open without a key).

    Raises:
        KeyFileError: the key file cannot be read, or `keys` mode with no key at all.
    """

    def __init__(
        self,
        mode: AuthMode,
        keys: Sequence[str] = (),
        key_file: Path | None = None,
        node_credential: str | None = None,
    ) -> None:
        self.mode: AuthMode = mode
        self._fixed_keys = tuple(dict.fromkeys(check_key(key, "API key") for key in keys))
        self.key_file = key_file
        self.node_credential = node_credential
        self._keys: tuple[bytes, ...] = ()
        self._fingerprints: frozenset[str] = frozenset()
        self.sessions = DashboardSessions()
        self._watchers: set[Callable[[], None]] = set()
        self._load(self._read_file_keys())
        if mode != "open" and not self._keys:
            raise KeyFileError("no API key configured (the key file holds none)")

    @classmethod
    def open(cls) -> ApiAuth:
        return cls("open")

    @property
    def key_count(self) -> int:
        return len(self._keys)

    def _read_file_keys(self) -> tuple[str, ...]:
        return read_key_file(self.key_file) if self.key_file is not None else ()

    def _load(self, file_keys: tuple[str, ...]) -> None:
        keys = tuple(dict.fromkeys((*self._fixed_keys, *file_keys)))
        self._keys = tuple(key.encode() for key in keys)
        self._fingerprints = frozenset(_key_fingerprint(key) for key in keys)
        self.sessions.close_all_but(self._fingerprints)

    def reload(self) -> None:
        """Read the key file again (SIGHUP): keys added there work from now on, keys
        removed stop working, and so do the dashboard sessions made with them. A file that
        cannot be read leaves the keys as they were (an error is logged). Responses open
        for a removed key or its sessions end (`watch`).

        Call it on the event loop's thread (the SIGHUP receiver does): it cancels the
        responses of removed keys there."""
        if self.key_file is None:
            logger.info("SIGHUP: no --api-key-file to read again; keys unchanged")
            return
        try:
            file_keys = self._read_file_keys()
        except KeyFileError as error:
            logger.error(f"SIGHUP: {error}; API keys unchanged")
            return
        self._load(file_keys)
        self._notify_watchers()
        if not self._keys:
            logger.warning(f"SIGHUP: {self.key_file} holds no key: every request is refused")
        else:
            logger.info(f"SIGHUP: {len(self._keys)} API key(s) loaded from {self.key_file}")

    def valid_key(self, presented: str) -> str | None:
        """The fingerprint of `presented` when it is one of the keys, else None. Compares
        against every key, in constant time for each."""
        candidate = presented.encode()
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(key, candidate)
        return _key_fingerprint(presented) if matched else None

    def session_cookie(self, presented_key: str) -> str | None:
        """A new session's cookie value for a valid key, or None."""
        fingerprint = self.valid_key(presented_key)
        if fingerprint is None:
            return None
        return self.sessions.open(fingerprint)

    def end_session(self, cookie: str) -> None:
        """Sign a session out: its cookie stops working, and responses open for it end."""
        if self.sessions.close(cookie):
            self._notify_watchers()

    def valid_session(self, cookie: str) -> str | None:
        """The identity (`session:<digest of the cookie>`) of an open session whose key is
        still valid, else None."""
        found = self.sessions.identity(cookie)
        if found is None or found[1] not in self._fingerprints:
            return None
        return found[0]

    def identity_valid(self, identity: str) -> bool:
        """Whether a request accepted as `identity` would still be: False once its key is
        removed or its session ended; True for identities no key made (addresses, nodes)."""
        if identity.startswith(KEY_IDENTITY_PREFIX):
            return identity.removeprefix(KEY_IDENTITY_PREFIX) in self._fingerprints
        if identity.startswith(SESSION_IDENTITY_PREFIX):
            return self.sessions.key_of_identity(identity) in self._fingerprints
        return True

    def watch(self, on_revocation: Callable[[], None]) -> Callable[[], None]:
        """Call `on_revocation` (on the event loop's thread) after every change that may
        have revoked an identity (a reload, a sign-out); it checks `identity_valid` itself.
        Returns the function that stops watching."""
        self._watchers.add(on_revocation)
        return lambda: self._watchers.discard(on_revocation)

    def _notify_watchers(self) -> None:
        for on_revocation in list(self._watchers):
            on_revocation()

    def client_identity(
        self, method: str, path: str, client_host: str | None, credentials: Credentials
    ) -> str | None:
        """Who the request is from, or None when it must be refused (401).

        The identity is `key:<fingerprint>` for a valid key, `session:<fingerprint>` for a
        valid session cookie, `node` for another node on a node path, else
        `address:<client address>` (open mode, loopback in generated mode, public paths).
        """
        address = f"address:{client_host}"
        for key in credentials.keys:
            fingerprint = self.valid_key(key)
            if fingerprint is not None:
                return f"{KEY_IDENTITY_PREFIX}{fingerprint}"
        if credentials.session is not None:
            session = self.valid_session(credentials.session)
            if session is not None:
                return session
        if self.mode == "open" or is_public(method, path):
            return address
        if (
            self.node_credential is not None
            and credentials.peer is not None
            and is_node_path(method, path)
            and hmac.compare_digest(credentials.peer.encode(), self.node_credential.encode())
        ):
            return "node"
        if self.mode == "generated" and is_loopback(client_host):
            return address
        return None

    def guesses_matter(self, client_host: str | None) -> bool:
        """Whether a client at `client_host` would gain anything by guessing a key: not in
        open mode, nor from loopback in generated mode (such clients need no key), so the
        brute-force throttle (`exo.api.guards.throttle`) leaves them alone."""
        if self.mode == "open":
            return False
        return not (self.mode == "generated" and is_loopback(client_host))

    def describe(self) -> str:
        """One line for the start banner (never a configured key)."""
        if self.mode == "open":
            return "OPEN: --no-auth, anyone who reaches this port may use the API"
        if self.mode == "generated":
            return "required from every client not on loopback (this machine needs none)"
        sources = []
        if self._fixed_keys:
            sources.append(f"{len(self._fixed_keys)} from --api-key/EXO_API_KEY")
        if self.key_file is not None:
            sources.append(f"the file {self.key_file}")
        return f"{self.key_count} API key(s) ({', '.join(sources)}) required from every client"


ErrorResponder = Callable[[str, int, str, str, Mapping[str, str]], ASGIApp]
"""(request path, HTTP status, OpenAI-style error type, message, extra headers) -> an ASGI
response in the error shape of the dialect that serves the path."""

WWW_AUTHENTICATE = 'Bearer realm="exo"'


class AuthMiddleware:
    """Refuse (401 with `WWW-Authenticate`, in the dialect's error shape) every request
    `ApiAuth.client_identity` does not accept; put the identity of the others into the
    scope under `CLIENT_SCOPE_KEY`.

    With a `throttle`, a refusal for a credential that is not valid counts against the
    client's address, and a locked-out address gets 429 with `Retry-After` on every request
    but the dashboard's page and files, before any credential is compared.
    """

    def __init__(
        self,
        app: ASGIApp,
        auth: ApiAuth,
        respond: ErrorResponder,
        throttle: AuthThrottle | None = None,
    ) -> None:
        self.app = app
        self.auth = auth
        self.respond = respond
        self.throttle = throttle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        method = scope.get("method", "GET")
        path: str = scope["path"]
        client = scope.get("client")
        host = client[0] if client else None
        throttle = self.throttle
        if throttle is not None and (not throttle.enabled or not self.auth.guesses_matter(host)):
            throttle = None
        if throttle is not None and not (is_public(method, path) and path != SESSION_PATH):
            wait = throttle.refuse(host)
            if wait is not None:
                await self._locked_out(scope, receive, send, wait)
                return
        credentials = Credentials.from_headers(scope["headers"])
        identity = self.auth.client_identity(method, path, host, credentials)
        if identity is not None:
            scope = {**scope, CLIENT_SCOPE_KEY: identity}
            if scope["type"] == "http" and identity.startswith(
                (KEY_IDENTITY_PREFIX, SESSION_IDENTITY_PREFIX)
            ):
                await self._serve_revocable(scope, receive, send, identity)
            else:
                await self.app(scope, receive, send)
            return
        presented = bool(credentials.keys or credentials.session)
        if throttle is not None and (
            presented or (credentials.peer is not None and is_node_path(method, path))
        ):
            throttle.record_failure(host, credentials.presented())
        # The key itself is never logged, nor echoed back.
        logger.debug(
            f"api: refused {method} {path} from {host}: "
            f"{'an API key that is not valid' if presented else 'no API key'}"
        )
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        message = (
            "the API key is not valid"
            if presented
            else "this node requires an API key: send it as 'Authorization: Bearer <key>' "
            "or 'x-api-key: <key>'"
        )
        if self.auth.mode == "generated":
            message += (
                f" (clients not on the node's machine need the key in {API_KEY_FILE_NAME} "
                "of its data directory; the node prints it when it starts)"
            )
        response = self.respond(
            path, 401, "authentication_error", message, {"WWW-Authenticate": WWW_AUTHENTICATE}
        )
        await response(scope, receive, send)

    async def _serve_revocable(
        self, scope: Scope, receive: Receive, send: Send, identity: str
    ) -> None:
        """Serve the request, ending its response when `identity` is revoked meanwhile: a
        response under way gets its last (empty) body chunk, one not begun a 401."""
        started = finished = False

        async def tracked_send(message: Message) -> None:
            nonlocal started, finished
            if message["type"] == "http.response.start":
                started = True
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                finished = True
            await send(message)

        with anyio.CancelScope() as revocable:

            def on_revocation() -> None:
                if not self.auth.identity_valid(identity):
                    revocable.cancel()

            stop_watching = self.auth.watch(on_revocation)
            try:
                await self.app(scope, receive, tracked_send)
            finally:
                stop_watching()
        if not revocable.cancel_called or finished:
            return
        logger.info(f"api: ended {scope['path']}: its API key or session was revoked")
        if started:
            with anyio.move_on_after(1):  # a client that stopped reading: drop it
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        response = self.respond(
            scope["path"], 401, "authentication_error", "the API key was revoked",
            {"WWW-Authenticate": WWW_AUTHENTICATE},
        )  # fmt: skip
        await response(scope, receive, send)

    async def _locked_out(self, scope: Scope, receive: Receive, send: Send, wait: int) -> None:
        logger.debug(f"api: {scope['path']}: client locked out after failed API keys")
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        response = self.respond(
            scope["path"], 429, "rate_limit_error", locked_out_message(wait),
            {"Retry-After": str(wait)},
        )  # fmt: skip
        await response(scope, receive, send)


def locked_out_message(wait: int) -> str:
    """The 429 message for an address locked out after failed keys (`wait` in seconds)."""
    return (
        f"too many requests with an API key that is not valid from this address; retry "
        f"after {wait} s"
    )
