"""The brute-force throttle (`exo.api.guards.throttle`): after repeated keys that are not
valid an address gets 429 with `Retry-After` in its dialect's error shape on every route
and on `POST /auth/session`; other addresses and the end of the lockout are unaffected; the
table stays bounded; forwarded headers count only from a trusted proxy. A fake clock stands
in for time: nothing sleeps."""

from __future__ import annotations

import httpx
import pytest
from starlette.testclient import TestClient

from exo.api.guards.auth import ApiAuth
from exo.api.guards.limits import ApiLimits, server_config
from exo.api.guards.throttle import AuthThrottle, address_key
from exo.api.security import ApiSecurity
from exo.api.tests.serving import scripted_app, serving
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster

KEY = "test-key-7f3a9c1e5b2d4680"
WRONG_KEY = "test-key-wrong-99887766"
ATTACKER = "203.0.113.7"
NEIGHBOUR = "198.51.100.20"
MAX_FAILURES = 3


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _throttle(clock: FakeClock, **overrides: float) -> AuthThrottle:
    return AuthThrottle(max_failures=MAX_FAILURES, clock=clock, **overrides)  # type: ignore[arg-type]


def _client(throttle: AuthThrottle, host: str, mode: str = "keys") -> TestClient:
    auth = ApiAuth(mode, (KEY,))  # type: ignore[arg-type]
    app = scripted_app(ScriptedCluster(), ApiSecurity(auth=auth, auth_throttle=throttle))
    return TestClient(app, client=(host, 40000))


def _guess(index: int) -> str:
    """A different wrong key per guess (a repeat of one wrong key counts once)."""
    return f"test-key-guess-{index:08d}"


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_attempt_after_the_last_allowed_failure_is_a_429_with_retry_after() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    attacker = _client(throttle, ATTACKER)
    for guess in range(MAX_FAILURES):
        assert attacker.get("/v1/models", headers=_bearer(_guess(guess))).status_code == 401
    refused = attacker.get("/v1/models", headers=_bearer(WRONG_KEY))
    assert refused.status_code == 429, refused.text
    assert refused.headers["retry-after"] == "60"
    error = refused.json()["error"]
    assert error["type"] == "rate_limit_error"
    assert "retry after 60 s" in error["message"]
    # The right key is refused too while locked out, or each answer would tell a right
    # guess from a wrong one.
    assert attacker.get("/v1/models", headers=_bearer(KEY)).status_code == 429
    clock.now += 30
    assert attacker.get("/v1/models", headers=_bearer(KEY)).headers["retry-after"] == "30"


def test_every_dialect_answers_the_lockout_in_its_own_shape() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    attacker = _client(throttle, ATTACKER)
    for guess in range(MAX_FAILURES):
        attacker.get("/state", headers={"x-api-key": _guess(guess)})
    chat = {"model": SMOLLM2, "messages": [{"role": "user", "content": "Hi"}]}
    openai_answer = attacker.post("/v1/chat/completions", json=chat, headers=_bearer(KEY))
    assert openai_answer.status_code == 429
    assert openai_answer.json()["error"]["type"] == "rate_limit_error"
    claude = attacker.post(
        "/v1/messages", json={**chat, "max_tokens": 8}, headers={"x-api-key": KEY}
    )
    assert claude.status_code == 429
    body = claude.json()
    assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
    ollama_answer = attacker.post("/ollama/api/chat", json=chat, headers=_bearer(KEY))
    assert ollama_answer.status_code == 429
    assert set(ollama_answer.json()) == {"error"}
    assert isinstance(ollama_answer.json()["error"], str)
    session = attacker.post("/auth/session", json={"api_key": KEY})
    assert session.status_code == 429
    for answer in (openai_answer, claude, ollama_answer, session):
        assert int(answer.headers["retry-after"]) >= 1
    # The dashboard's page still loads (it asks for a key; the key is then refused).
    assert attacker.get("/").status_code == 200


def test_a_correct_key_from_another_address_still_works_and_metrics_count() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    attacker = _client(throttle, ATTACKER)
    for guess in range(MAX_FAILURES + 2):
        attacker.get("/v1/models", headers=_bearer(_guess(guess)))
    neighbour = TestClient(attacker.app, client=(NEIGHBOUR, 40000))
    assert neighbour.get("/v1/models", headers=_bearer(KEY)).status_code == 200
    metrics = neighbour.get("/metrics", headers=_bearer(KEY)).text
    assert f"exo_auth_failures_total {MAX_FAILURES}.0" in metrics
    assert "exo_auth_lockouts_total 1.0" in metrics
    assert "exo_auth_throttled_requests_total 2.0" in metrics
    assert "exo_auth_locked_addresses 1.0" in metrics
    # A locked-out address's 429s are counted with the other answers too.
    assert 'exo_http_requests_total{method="GET",route="/v1/models",status="429"} 2.0' in metrics


def test_after_the_lockout_the_client_may_try_again_and_the_next_lockout_doubles() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    attacker = _client(throttle, ATTACKER)
    for guess in range(MAX_FAILURES):
        attacker.get("/v1/models", headers=_bearer(_guess(guess)))
    assert attacker.get("/v1/models", headers=_bearer(KEY)).status_code == 429
    clock.now += 60
    assert attacker.get("/v1/models", headers=_bearer(KEY)).status_code == 200
    for guess in range(MAX_FAILURES):
        assert attacker.get("/v1/models", headers=_bearer(_guess(guess))).status_code == 401
    assert attacker.get("/v1/models", headers=_bearer(KEY)).headers["retry-after"] == "120"
    # A day without failures: the next lockout is a first one again.
    clock.now += 86_400
    for guess in range(MAX_FAILURES):
        assert attacker.get("/v1/models", headers=_bearer(_guess(guess))).status_code == 401
    assert attacker.get("/v1/models", headers=_bearer(KEY)).headers["retry-after"] == "60"


def test_failures_spread_wider_than_the_window_never_lock_out() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    for _ in range(10 * MAX_FAILURES):
        assert throttle.record_failure(ATTACKER) is None
        clock.now += throttle.window_seconds / (MAX_FAILURES - 1)
    assert throttle.lockouts_total == 0
    assert throttle.retry_after(ATTACKER) is None


def test_session_sign_in_with_wrong_keys_counts_and_locks_out() -> None:
    clock = FakeClock()
    attacker = _client(_throttle(clock), ATTACKER)
    for guess in range(MAX_FAILURES):
        assert attacker.post("/auth/session", json={"api_key": _guess(guess)}).status_code == 401
    refused = attacker.post("/auth/session", json={"api_key": KEY})
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "60"
    assert "exo_session" not in refused.cookies
    clock.now += 61
    assert attacker.post("/auth/session", json={"api_key": KEY}).status_code == 204


def test_requests_without_a_key_and_loopback_in_generated_mode_are_not_counted() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    forgetful = _client(throttle, ATTACKER)
    for _ in range(2 * MAX_FAILURES):
        assert forgetful.get("/v1/models").status_code == 401
    assert throttle.failures_total == 0
    local = _client(throttle, "127.0.0.1", mode="generated")
    for _ in range(2 * MAX_FAILURES):
        assert local.post("/auth/session", json={"api_key": WRONG_KEY}).status_code == 401
        assert local.get("/v1/models", headers=_bearer(WRONG_KEY)).status_code == 200
    assert throttle.failures_total == 0


def test_the_table_stays_bounded_under_many_addresses() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(max_failures=MAX_FAILURES, max_addresses=256, clock=clock)
    for index in range(5000):
        throttle.record_failure(f"10.{index // 65536}.{index // 256 % 256}.{index % 256}")
        clock.now += 0.001
    assert throttle.tracked_addresses == 256
    assert throttle.forgotten_total == 5000 - 256
    # A locked-out address is kept over addresses whose last failure is older.
    for _ in range(MAX_FAILURES):
        throttle.record_failure(ATTACKER)
    throttle.record_failure("192.0.2.1")
    assert throttle.retry_after(ATTACKER) == 60
    # Quiet addresses are dropped once a day has passed.
    clock.now += 86_400 + 1
    throttle.record_failure("192.0.2.2")
    assert throttle.tracked_addresses == 1


def test_ipv6_clients_count_as_their_slash_64() -> None:
    assert address_key("2001:db8:1:2:aaaa::1") == address_key("2001:db8:1:2:bbbb::9")
    assert address_key("2001:db8:1:2::1") == "2001:db8:1:2::/64"
    assert address_key("2001:db8:1:3::1") != address_key("2001:db8:1:2::1")
    assert address_key("::ffff:203.0.113.7") == ATTACKER
    assert address_key("testclient") == "testclient"
    clock = FakeClock()
    throttle = _throttle(clock)
    for index in range(MAX_FAILURES):
        throttle.record_failure(f"2001:db8:1:2::{index + 1:x}")
    assert throttle.retry_after("2001:db8:1:2:ffff::1") == 60


def test_zero_max_failures_turns_the_throttle_off() -> None:
    clock = FakeClock()
    throttle = AuthThrottle(max_failures=0, clock=clock)
    client = _client(throttle, ATTACKER)
    for _ in range(20):
        assert client.get("/v1/models", headers=_bearer(WRONG_KEY)).status_code == 401
    assert client.get("/v1/models", headers=_bearer(KEY)).status_code == 200
    with pytest.raises(ValueError, match="failed API keys"):
        ApiLimits(max_auth_failures=-1)


def test_forwarded_for_counts_only_from_a_trusted_proxy() -> None:
    """Through a real server on 127.0.0.1: by default `X-Forwarded-For` is ignored, so
    every request is 127.0.0.1's; with `--trusted-proxy 127.0.0.1` each forwarded client is
    its own address."""
    assert server_config(scripted_app(ScriptedCluster()), "WARNING", ApiLimits()).proxy_headers is (
        False
    )
    with pytest.raises(ValueError, match="not an IP address"):
        ApiLimits(trusted_proxies=("proxy.example",))
    for trusted, neighbour_status in (((), 429), (("127.0.0.0/8",), 200)):
        clock = FakeClock()
        throttle = _throttle(clock)
        auth = ApiAuth("keys", (KEY,))
        app = scripted_app(ScriptedCluster(), ApiSecurity(auth=auth, auth_throttle=throttle))
        limits = ApiLimits(trusted_proxies=trusted)
        with serving(app, limits) as (url, _), httpx.Client(base_url=url, timeout=10) as http:
            for guess in range(MAX_FAILURES):
                forwarded = {"X-Forwarded-For": ATTACKER, **_bearer(_guess(guess))}
                assert http.get("/v1/models", headers=forwarded).status_code == 401
            neighbour = {"X-Forwarded-For": NEIGHBOUR, **_bearer(KEY)}
            assert http.get("/v1/models", headers=neighbour).status_code == neighbour_status
            attacker = {"X-Forwarded-For": ATTACKER, **_bearer(KEY)}
            assert http.get("/v1/models", headers=attacker).status_code == 429


def test_a_mistyped_key_retried_never_locks_its_client_out() -> None:
    """Trial 40: Claude Code with a mistyped key sends about 5 requests per run and its SDK
    retries the lockout's 429 for minutes; two runs reached the 10-failure lockout. A repeat
    of the same wrong key from the same address counts once per window."""
    clock = FakeClock()
    throttle = AuthThrottle(clock=clock)  # the default policy: 10 failures
    client = _client(throttle, ATTACKER)
    for _ in range(30):
        assert client.get("/v1/models", headers=_bearer(WRONG_KEY)).status_code == 401
        assert client.post("/auth/session", json={"api_key": WRONG_KEY}).status_code == 401
    assert throttle.failures_total == 60 and throttle.lockouts_total == 0
    assert client.get("/v1/models", headers=_bearer(KEY)).status_code == 200
    # The throttle keeps a keyed digest, never the key.
    assert WRONG_KEY not in repr(throttle._records)
    # Guessing still locks out: the repeated key counted once, 9 new guesses make 10.
    for guess in range(9):
        assert client.get("/v1/models", headers=_bearer(_guess(guess))).status_code == 401
    assert client.get("/v1/models", headers=_bearer(KEY)).status_code == 429


def test_a_repeated_wrong_key_counts_again_in_the_next_window() -> None:
    clock = FakeClock()
    throttle = _throttle(clock)
    for _ in range(MAX_FAILURES - 1):
        assert throttle.record_failure(ATTACKER, WRONG_KEY) is None
        clock.now += 601  # past the 10-minute window: a new window, the key counts again
    assert throttle.record_failure(ATTACKER, WRONG_KEY) is None  # 1 in this window
    assert throttle.record_failure(ATTACKER, "another") is None
    assert throttle.record_failure(ATTACKER, "a third") == 60
