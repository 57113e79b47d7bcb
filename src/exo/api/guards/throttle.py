"""Brute-force throttle: an address that keeps presenting credentials that are not valid is
locked out for a while, so that a hand-set API key cannot be guessed at the speed of HTTP.

Policy (documented in docs/security.md, "Failed keys"):
- A **failure** is a request refused (401) for a credential that is not valid: an API key
  (`Authorization: Bearer`, `x-api-key`), a session cookie, the peer credential on a node
  path, or the key of `POST /auth/session`. A request that presents no credential at all is
  no failure (a client that forgot its key is not guessing).
- A **repeat** of the same wrong credential from the same address counts once per window:
  a client with a mistyped key retries it (Claude Code sends about 5 requests per run, and
  the SDKs retry a 429 for minutes), which is no guessing, while each different key is
  another guess and counts. The throttle keeps a keyed digest of each credential it counted
  in the window (BLAKE2b with a random per-process key, 16 bytes), never the credential;
  at most `max_failures` digests per address, since that many distinct ones lock it out.
- `max_failures` failures from one address within `window_seconds` of the first lock it
  out: the failure that reaches the count is still a 401, every following request (a
  correct key included, else each answer would still tell a right guess from a wrong one)
  gets 429 with `Retry-After` until the lockout ends. The first lockout lasts
  `first_lockout_seconds`; each further one of the same address doubles, up to
  `max_lockout_seconds`. An address with no failure for `forget_after_seconds` starts
  again from the first lockout.
- Nothing sleeps: a refusal is answered at once, so an attacker cannot tie up the server by
  keeping requests waiting.
- An address is the client's IP; an IPv6 client counts as its /64 network, since one host
  commonly holds a whole /64 (RFC 6177's end-site assignment) and could otherwise try each
  of its addresses in turn.
- Memory is bounded: at most `max_addresses` addresses are tracked (each record a few
  hundred bytes); past that, the address whose last failure is oldest is forgotten first.
  An attacker with that many addresses gains `max_failures` guesses per address, and has
  them anyway.

Keys are still compared in constant time (`ApiAuth.valid_key`); this module sees a refused
credential only to digest it, and keeps no key.
"""

from __future__ import annotations

import hashlib
import ipaddress
import math
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

DEFAULT_MAX_AUTH_FAILURES = 10
"""Failed credentials an address may present within the window before it is locked out."""
FAILURE_WINDOW_SECONDS = 600.0
FIRST_LOCKOUT_SECONDS = 60.0
MAX_LOCKOUT_SECONDS = 3600.0
FORGET_AFTER_SECONDS = 86_400.0
MAX_TRACKED_ADDRESSES = 10_000
_IPV6_PREFIX = 64


def address_key(host: str | None) -> str:
    """The throttle's name for a client address: the IP itself (IPv4, or the IPv4 inside an
    IPv4-mapped IPv6 address), an IPv6 address's /64 network, or the host string as given
    when it is no IP (ASGI test clients); `unknown` for None."""
    if host is None:
        return "unknown"
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, _IPV6_PREFIX), strict=False))
    return str(address)


@dataclass(slots=True)
class _Record:
    failures: int
    """Failures since `window_start` (reset when a lockout begins or the window passes)."""
    window_start: float
    last_failure: float
    lockouts: int = 0
    locked_until: float = 0.0
    counted: set[bytes] = field(default_factory=set)
    """Digests of the credentials counted in this window (`_credential_digest`)."""


@dataclass(slots=True)
class AuthThrottle:
    """Failed credentials per address, and the lockouts they earn (see the module docstring).

    Args:
        max_failures: failures within `window_seconds` that lock an address out; 0: never.
        window_seconds: how long failures are counted together (seconds).
        first_lockout_seconds: the first lockout; each further one doubles.
        max_lockout_seconds: the longest lockout.
        forget_after_seconds: an address with no failure this long is forgotten (its next
            lockout is a first one again); at least `max_lockout_seconds`.
        max_addresses: the most addresses tracked at once.
        clock: monotonic seconds (tests pass their own).

    Raises:
        ValueError: a negative count, a duration that is not positive, or
            `forget_after_seconds` below `max_lockout_seconds`.
    """

    max_failures: int = DEFAULT_MAX_AUTH_FAILURES
    window_seconds: float = FAILURE_WINDOW_SECONDS
    first_lockout_seconds: float = FIRST_LOCKOUT_SECONDS
    max_lockout_seconds: float = MAX_LOCKOUT_SECONDS
    forget_after_seconds: float = FORGET_AFTER_SECONDS
    max_addresses: int = MAX_TRACKED_ADDRESSES
    clock: Callable[[], float] = time.monotonic
    failures_total: int = 0
    """Failed credentials seen (the `exo_auth_failures_total` metric)."""
    lockouts_total: int = 0
    refusals_total: int = 0
    """Requests answered 429 because their address was locked out."""
    forgotten_total: int = 0
    """Addresses dropped to keep within `max_addresses` (not those forgotten after
    `forget_after_seconds`)."""
    _records: OrderedDict[str, _Record] = field(default_factory=OrderedDict)
    """Ordered by last failure, oldest first."""
    _digest_key: bytes = field(default_factory=lambda: secrets.token_bytes(32))

    def __post_init__(self) -> None:
        if self.max_failures < 0 or self.max_addresses < 1:
            raise ValueError("max_failures must be >= 0 and max_addresses >= 1")
        durations = (self.window_seconds, self.first_lockout_seconds, self.max_lockout_seconds)
        if min(durations) <= 0:
            raise ValueError("the throttle's durations must be positive")
        if self.forget_after_seconds < self.max_lockout_seconds:
            raise ValueError("forget_after_seconds must be at least max_lockout_seconds")

    @property
    def enabled(self) -> bool:
        return self.max_failures > 0

    @property
    def tracked_addresses(self) -> int:
        return len(self._records)

    def locked_addresses(self) -> int:
        """Addresses locked out now (a walk over the table: for scrapes, not per request)."""
        now = self.clock()
        return sum(1 for record in self._records.values() if record.locked_until > now)

    def retry_after(self, host: str | None) -> int | None:
        """Whole seconds (at least 1) until `host`'s lockout ends, or None when it is not
        locked out."""
        record = self._records.get(address_key(host))
        if record is None:
            return None
        left = record.locked_until - self.clock()
        return max(1, math.ceil(left)) if left > 0 else None

    def refuse(self, host: str | None) -> int | None:
        """`retry_after(host)`, counting a refusal when it is not None."""
        wait = self.retry_after(host)
        if wait is not None:
            self.refusals_total += 1
        return wait

    def _credential_digest(self, credential: str) -> bytes:
        return hashlib.blake2b(
            credential.encode("utf-8", "surrogateescape"), key=self._digest_key, digest_size=16
        ).digest()

    def record_failure(self, host: str | None, credential: str | None = None) -> int | None:
        """Count a failed credential from `host`.

        Args:
            credential: what the request presented (None: unknown, always counted); a
                credential already counted for `host` in the current window is not counted
                again.

        Returns:
            The lockout's length in whole seconds when this failure began one, else None.
        """
        if not self.enabled:
            return None
        self.failures_total += 1
        now = self.clock()
        key = address_key(host)
        self._forget_quiet(now)
        record = self._records.get(key)
        if record is None:
            if len(self._records) >= self.max_addresses:
                self._records.popitem(last=False)
                self.forgotten_total += 1
            record = self._records[key] = _Record(failures=0, window_start=now, last_failure=now)
        else:
            self._records.move_to_end(key)
        if now - record.window_start >= self.window_seconds:
            record.failures, record.window_start = 0, now
            record.counted.clear()
        record.last_failure = now
        if credential is not None:
            digest = self._credential_digest(credential)
            if digest in record.counted:
                return None
            record.counted.add(digest)
        record.failures += 1
        if record.failures < self.max_failures:
            return None
        record.lockouts += 1
        doublings = min(record.lockouts - 1, 32)  # 2**32 minutes is past any cap
        lockout = min(self.first_lockout_seconds * 2.0**doublings, self.max_lockout_seconds)
        record.locked_until = now + lockout
        record.failures, record.window_start = 0, now
        record.counted.clear()
        self.lockouts_total += 1
        return math.ceil(lockout)

    def _forget_quiet(self, now: float) -> None:
        # Oldest last failure first; a lockout ends before `forget_after_seconds` passes.
        while self._records:
            key, record = next(iter(self._records.items()))
            if now - record.last_failure < self.forget_after_seconds:
                return
            del self._records[key]
