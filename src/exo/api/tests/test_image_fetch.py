"""Fetching image URLs within `--image-fetch-timeout` (a server that stalls, one that
trickles its body, a host name lookup that hangs: each a 400 naming the part, soon after the
timeout), and http(s) image URLs through the official clients of the dialects whose URL
parts `test_image_input.py` feeds only data: Claude's `image` block with a `url` source
(`anthropic`) and the Responses API's `input_image` (`openai`; its chat `image_url` with an
http URL is in `test_image_input.py`). Every server here is on loopback, so the node's
policy allows private URLs."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest
from PIL import Image

from exo.api.tests.serving import scripted_app, serving
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import ImagePolicy, ImageReader
from exo.shared.types.text_generation import IMAGE_MARKER
from exo.testing.builders import SMOLLM2, smollm2_card
from exo.testing.image_server import Body, Redirect, Route, Stall, Trickle, serving_routes
from exo.testing.scripted_cluster import ScriptedCluster

TIMEOUT_SECONDS = 0.5
# The answer's allowance past the timeout: thread start, the refusal, a loaded CI machine.
SLACK_SECONDS = 1.5
STALL_SECONDS = 6.0  # far past the timeout: the old code waited this long or more
TRICKLE_BYTES, TRICKLE_GAP_SECONDS = 30, 0.1  # 3 s of body, one byte at a time


def _png() -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 200, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = _png()
ROUTES: dict[str, Route] = {
    "/image.png": Body(PNG),
    "/stall": Stall(STALL_SECONDS),
    "/redirect-to-stall": Redirect("/stall"),
    "/trickle": Trickle(TRICKLE_BYTES, TRICKLE_GAP_SECONDS),
}


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    with serving_routes(ROUTES) as url:
        yield url


def _reader(**overrides: Any) -> ImageReader:
    policy = ImagePolicy(fetch_timeout_seconds=TIMEOUT_SECONDS, allow_private_urls=True)
    return ImageReader(policy, vision=True, **overrides)


def _refused_in_time(reader: ImageReader, url: str) -> InvalidRequestError:
    """The reader's refusal of `url`, asserted to come within the timeout and the slack."""
    start = time.monotonic()
    with pytest.raises(InvalidRequestError) as raised:
        reader.read_url(url, "messages[0].content[1].image_url")
    elapsed = time.monotonic() - start
    assert elapsed < TIMEOUT_SECONDS + SLACK_SECONDS, elapsed
    return raised.value


@pytest.mark.parametrize("path", ["/stall", "/trickle", "/redirect-to-stall"])
def test_a_slow_server_is_refused_at_the_timeout_naming_the_part(
    image_server: str, path: str
) -> None:
    """A stall before the headers, a body trickled one byte at a time (each read quick, so
    a per-read timeout never fires), a redirect to a stall."""
    refusal = _refused_in_time(_reader(), f"{image_server}{path}")
    assert refusal.param == "messages[0].content[1].image_url"
    assert str(refusal).startswith("messages[0].content[1].image_url: ")
    assert "took longer than 0.5 s (--image-fetch-timeout)" in str(refusal)


def test_a_hanging_host_name_lookup_counts_in_the_timeout(image_server: str) -> None:
    """`getaddrinfo` blocks for the system resolver's timeout (seconds) on a dead DNS
    server; the lookup runs inside the fetch's time."""
    port = int(image_server.rsplit(":", 1)[1])

    release = threading.Event()  # set below: the pending lookup returns

    def hanging(host: str, port: int) -> list[str]:
        release.wait(STALL_SECONDS)
        return ["127.0.0.1"]

    try:
        refusal = _refused_in_time(_reader(resolve=hanging), f"http://images.test:{port}/image.png")
    finally:
        release.set()
    assert "--image-fetch-timeout" in str(refusal)
    # A quick lookup of the same name fetches the image.
    quick = _reader(resolve=lambda host, port: ["127.0.0.1"])
    assert quick.read_url(f"http://images.test:{port}/image.png", "p").data == PNG


# ---------------------------------------------------------------- the official clients


@pytest.fixture(scope="module")
def cluster() -> Iterator[ScriptedCluster]:
    """The stand-in cluster with a SmolLM2 card that claims vision, fetching loopback URLs
    with the short timeout."""
    cluster = ScriptedCluster()
    cluster.cards[SMOLLM2] = smollm2_card().model_copy(update={"capabilities": ("text", "vision")})
    cluster.image_policy = ImagePolicy(
        fetch_timeout_seconds=TIMEOUT_SECONDS, allow_private_urls=True
    )
    yield cluster


@pytest.fixture(scope="module")
def base_url(cluster: ScriptedCluster) -> Iterator[str]:
    with serving(scripted_app(cluster)) as (url, _port):
        yield url


def test_claude_image_blocks_with_a_url_source(
    cluster: ScriptedCluster, base_url: str, image_server: str
) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    source: Any = {"type": "url", "url": f"{image_server}/image.png"}
    client.messages.create(
        model=SMOLLM2,
        max_tokens=8,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image", "source": source},
                ],
            }
        ],
    )
    message = cluster.last_params.messages[-1]
    assert (message.content, [image.data for image in message.images]) == (
        f"What is this?\n{IMAGE_MARKER}",
        [PNG],
    )
    stalled: Any = {"type": "url", "url": f"{image_server}/stall"}
    start = time.monotonic()
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.1\.source: ") as e:
        client.messages.create(
            model=SMOLLM2,
            max_tokens=8,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "And this?"},
                        {"type": "image", "source": stalled},
                    ],
                }
            ],
        )
    assert time.monotonic() - start < TIMEOUT_SECONDS + SLACK_SECONDS
    assert "--image-fetch-timeout" in str(e.value) and e.value.status_code == 400


def test_responses_input_images_with_an_http_url(
    cluster: ScriptedCluster, base_url: str, image_server: str
) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    client.responses.create(
        model=SMOLLM2,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Describe"},
                    {
                        "type": "input_image",
                        "image_url": f"{image_server}/image.png",
                        "detail": "low",
                    },
                ],
            }
        ],
    )
    message = cluster.last_params.messages[-1]
    assert (message.content, [image.data for image in message.images]) == (
        f"Describe\n{IMAGE_MARKER}",
        [PNG],
    )
    start = time.monotonic()
    with pytest.raises(openai.BadRequestError) as raised:
        client.responses.create(
            model=SMOLLM2,
            input=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "input_image",
                            "image_url": f"{image_server}/trickle",
                            "detail": "auto",
                        }
                    ],
                }
            ],
        )
    assert time.monotonic() - start < TIMEOUT_SECONDS + SLACK_SECONDS
    assert raised.value.param == "input[0].content[0].image_url"
    assert "--image-fetch-timeout" in raised.value.message
