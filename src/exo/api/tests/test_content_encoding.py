"""Compressed request bodies (`exo.api.guards.content_encoding`): zstd, gzip and deflate
bodies (Codex sends zstd) are decoded on every dialect's routes, undecodable ones refused in
the route's dialect, and a body over the limit once decoded is a 413. Through the real app
with a stand-in cluster."""

from __future__ import annotations

from typing import Any, cast

import pytest
from fastapi.testclient import TestClient

from exo.api.app import create_app
from exo.api.serving.cluster_client import ClusterClient
from exo.testing.builders import SMOLLM2
from exo.testing.scripted_cluster import ScriptedCluster


@pytest.fixture
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


def _compressed(body: bytes, encoding: str) -> bytes:
    import gzip
    import zlib

    import zstandard

    match encoding:
        case "zstd":
            return zstandard.ZstdCompressor().compress(body)
        case "gzip":
            return gzip.compress(body)
        case "deflate":
            return zlib.compress(body)
        case "gzip, zstd":
            return zstandard.ZstdCompressor().compress(gzip.compress(body))
        case _:
            return body


@pytest.mark.parametrize(
    ("route", "body"),
    [
        ("/v1/responses", {"input": "hi"}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        ("/v1/messages", {"max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]}),
        ("/ollama/api/chat", {"messages": [{"role": "user", "content": "hi"}], "stream": False}),
    ],
)
@pytest.mark.parametrize("encoding", ["zstd", "gzip", "deflate", "gzip, zstd"])
def test_compressed_bodies_are_decoded_on_every_dialects_routes(
    cluster: ScriptedCluster, route: str, body: dict[str, Any], encoding: str
) -> None:
    import json

    from exo.api.guards.limits import ApiLimits
    from exo.api.security import ApiSecurity

    # The node's own guards, where the decoding happens.
    app = create_app(cast(ClusterClient, cluster), security=ApiSecurity(limits=ApiLimits()))
    raw = json.dumps({"model": SMOLLM2, **body}).encode()
    with TestClient(app) as http:
        answer = http.post(
            route,
            content=_compressed(raw, encoding),
            headers={"content-encoding": encoding, "content-type": "application/json"},
        )
    assert answer.status_code == 200, answer.text
    assert cluster.last_params.messages[-1].content == "hi"


@pytest.mark.parametrize(
    ("encoding", "content", "status"),
    [("br", b"\x00\x01", 415), ("gzip", b"not gzip", 400), ("zstd", b"not zstd", 400)],
)
def test_undecodable_bodies_are_refused(
    cluster: ScriptedCluster, encoding: str, content: bytes, status: int
) -> None:
    from exo.api.guards.limits import ApiLimits
    from exo.api.security import ApiSecurity

    app = create_app(cast(ClusterClient, cluster), security=ApiSecurity(limits=ApiLimits()))
    with TestClient(app) as http:
        answer = http.post("/v1/messages", content=content, headers={"content-encoding": encoding})
    assert answer.status_code == status
    assert answer.json()["type"] == "error"  # Anthropic's shape on its route


def test_a_decoded_body_over_the_limit_is_413() -> None:
    import gzip

    from exo.api.guards.content_encoding import BodyDecodingError, decode_body

    with pytest.raises(BodyDecodingError) as raised:
        decode_body(gzip.compress(b"x" * 10_000), ["gzip"], limit=1_000)
    assert raised.value.status == 413
