"""Dashboard sessions: the cookie `POST /auth/session` sets, revocable on the server.

A session is a random id (32 bytes from `secrets`, URL-safe base64) handed to the browser
as the `exo_session` cookie; the node keeps only the SHA-256 of each id, with the
fingerprint of the key that opened it and its expiry. So a session ends:
- on sign-out (`DELETE /auth/session` with the cookie): its id is forgotten, and replaying
  the cookie afterwards is a 401;
- when its key is revoked (`ApiAuth.reload`, SIGHUP): every session of that key is
  forgotten, so re-adding the key later does not revive them;
- after `max_age_seconds` (the cookie's own Max-Age), or when the node restarts (nothing is
  written to disk: the page asks for the key again);
- when `max_sessions` are open and another is made: the oldest is forgotten first, so a
  client that signs in in a loop costs bounded memory (each entry about 200 bytes).

The cookie is no function of the key (a stolen cookie says nothing about the key) and the
table holds no key.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

SESSION_MAX_AGE_SECONDS = 30 * 24 * 3600
"""A session lasts 30 days (the cookie's Max-Age; the node forgets it then too)."""
MAX_SESSIONS = 4096
SESSION_IDENTITY_PREFIX = "session:"


def _session_digest(cookie: str) -> str:
    # 128 bits of SHA-256: the table's key and the session's identity; never the cookie.
    return hashlib.sha256(cookie.encode("utf-8", "surrogateescape")).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class _Session:
    key_fingerprint: str
    expires_at: float
    """`clock()` seconds."""


@dataclass(slots=True)
class DashboardSessions:
    """The open dashboard sessions (see the module docstring).

    Args:
        max_sessions: the most sessions kept at once (the oldest is forgotten first).
        max_age_seconds: how long a session lasts from sign-in.
        clock: monotonic seconds (tests pass their own).
    """

    max_sessions: int = MAX_SESSIONS
    max_age_seconds: float = SESSION_MAX_AGE_SECONDS
    clock: Callable[[], float] = time.monotonic
    _sessions: OrderedDict[str, _Session] = field(default_factory=OrderedDict)
    """By digest of the cookie, oldest first."""

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, key_fingerprint: str) -> str:
        """A new session of the key with `key_fingerprint`; returns the cookie value."""
        cookie = secrets.token_urlsafe(32)
        self._forget_expired()
        while len(self._sessions) >= self.max_sessions:
            self._sessions.popitem(last=False)
        expires_at = self.clock() + self.max_age_seconds
        self._sessions[_session_digest(cookie)] = _Session(key_fingerprint, expires_at)
        return cookie

    def identity(self, cookie: str) -> tuple[str, str] | None:
        """(the session's identity `session:<digest>`, its key's fingerprint) for an open,
        unexpired session, else None."""
        digest = _session_digest(cookie)
        session = self._live(digest)
        if session is None:
            return None
        return f"{SESSION_IDENTITY_PREFIX}{digest}", session.key_fingerprint

    def key_of_identity(self, identity: str) -> str | None:
        """The key fingerprint of the open session `identity` names, else None."""
        if not identity.startswith(SESSION_IDENTITY_PREFIX):
            return None
        session = self._live(identity.removeprefix(SESSION_IDENTITY_PREFIX))
        return session.key_fingerprint if session is not None else None

    def close(self, cookie: str) -> bool:
        """Forget the session of `cookie`; whether one was open."""
        return self._sessions.pop(_session_digest(cookie), None) is not None

    def close_all_but(self, key_fingerprints: Collection[str]) -> int:
        """Forget every session whose key is not in `key_fingerprints`; how many."""
        closed = [
            digest
            for digest, session in self._sessions.items()
            if session.key_fingerprint not in key_fingerprints
        ]
        for digest in closed:
            del self._sessions[digest]
        return len(closed)

    def _live(self, digest: str) -> _Session | None:
        session = self._sessions.get(digest)
        if session is None:
            return None
        if session.expires_at <= self.clock():
            del self._sessions[digest]
            return None
        return session

    def _forget_expired(self) -> None:
        # Oldest first, and every session lasts as long: stop at the first live one.
        now = self.clock()
        while self._sessions:
            digest, session = next(iter(self._sessions.items()))
            if session.expires_at > now:
                return
            del self._sessions[digest]
