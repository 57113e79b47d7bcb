"""Image input in every dialect: the reader (decoding, limits, URL fetching and the
addresses it refuses), and each dialect's route through its official client (`openai`,
`anthropic`, `ollama`) against the real app over a stand-in cluster whose SmolLM2 card is
given the "vision" capability, checking what reaches the generation command."""

from __future__ import annotations

import base64
import hashlib
import io
import re
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import ollama
import openai
import pytest
from PIL import Image

from exo.api.serving.prompt_size import MAX_PROMPT_BYTES_PER_TOKEN, check_prompt_size
from exo.api.tests.serving import scripted_app, serving
from exo.api.wire.errors import InvalidRequestError
from exo.api.wire.images import (
    ImagePolicy,
    ImageReader,
    ImagesDeferred,
    is_forbidden_address,
)
from exo.shared.types.commands import MAX_GENERATION_BYTES
from exo.shared.types.text_generation import (
    IMAGE_MARKER,
    ChatMessage,
    ImageInput,
    TextGenerationTaskParams,
)
from exo.testing.builders import SMOLLM2, smollm2_card
from exo.testing.image_server import Body, Redirect, Route, serving_routes
from exo.testing.scripted_cluster import ScriptedCluster


def image_bytes(width: int = 3, height: int = 2, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (200, 10, 30)).save(buffer, format=image_format)
    return buffer.getvalue()


PNG = image_bytes()
JPEG = image_bytes(5, 4, "JPEG")
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()
NOT_AN_IMAGE = "data:image/png;base64," + base64.b64encode(b"plain text, no image").decode()
NOISE = Image.frombytes("RGB", (30, 30), bytes(range(256)) * 10 + bytes(140))
NOISE_PNG = io.BytesIO()
NOISE.save(NOISE_PNG, format="PNG")
# The file's head (so Pillow knows it and its size) without the rest of its pixels.
TRUNCATED_PNG = base64.b64encode(NOISE_PNG.getvalue()[: len(NOISE_PNG.getvalue()) // 2]).decode()


def vision_reader(**policy: Any) -> ImageReader:
    return ImageReader(ImagePolicy(**policy), vision=True)


# ---------------------------------------------------------------- the reader


def test_a_data_url_becomes_an_image_with_its_size_type_and_digest() -> None:
    image = vision_reader().read_url(PNG_URL, "part")
    assert (image.data, image.media_type, image.width, image.height) == (PNG, "image/png", 3, 2)
    assert image.sha256 == hashlib.sha256(PNG).hexdigest()
    # The bytes decide the type, not the client's word; URL-safe base64 without padding too.
    unpadded = base64.urlsafe_b64encode(JPEG).decode().rstrip("=")
    jpeg = vision_reader().read_base64(unpadded, "part")
    assert (jpeg.media_type, jpeg.width, jpeg.height) == ("image/jpeg", 5, 4)


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (lambda r: r.read_url(NOT_AN_IMAGE, "p"), "cannot be decoded"),
        (lambda r: r.read_base64(TRUNCATED_PNG, "p"), "cannot be decoded"),
        (lambda r: r.read_base64("not base64!", "p"), "not valid base64"),
        (lambda r: r.read_url("data:image/png,rawtext", "p"), "must be base64"),
        (lambda r: r.read_url("file:///etc/passwd", "p"), "http(s) URL or a base64 data URL"),
        (lambda r: r.read_bytes(b"", "p"), "empty"),
        (lambda r: r.read_bytes(image_bytes(image_format="TIFF"), "p"), "format TIFF"),
        (lambda r: r.read_bytes(image_bytes(50, 50), "p"), "more pixels (50 x 50)"),
        (lambda r: r.read_bytes(b"x" * 5000, "p"), "larger than this node accepts (4096 bytes"),
        (lambda r: r.read_base64("A" * 6000, "p"), "larger than this node accepts"),
    ],
)
def test_unreadable_images_are_refused_naming_the_part(read: Any, message: str) -> None:
    reader = vision_reader(max_bytes=4096, max_pixels=2000)
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as raised:
        read(reader)
    assert raised.value.param == "p"
    assert str(raised.value.message).startswith("p: ")


def test_a_deferring_reader_stops_at_the_first_image() -> None:
    with pytest.raises(ImagesDeferred):
        ImageReader(ImagePolicy(), vision=True, defer=True).read_url(PNG_URL, "p")


@pytest.mark.parametrize(
    ("address", "forbidden"),
    [
        ("127.0.0.1", True),
        ("10.1.2.3", True),
        ("192.168.1.1", True),
        ("172.16.0.1", True),
        ("169.254.169.254", True),  # the cloud metadata service
        ("100.64.0.1", True),
        ("0.0.0.0", True),
        ("::1", True),
        ("fd00::1", True),
        ("fe80::1%eth0", True),
        ("::ffff:127.0.0.1", True),
        ("224.0.0.1", True),
        ("93.184.215.14", False),
        ("2606:4700::1111", False),
    ],
)
def test_private_loopback_and_link_local_addresses_are_forbidden(
    address: str, forbidden: bool
) -> None:
    assert is_forbidden_address(address) is forbidden


@pytest.fixture(scope="module")
def image_server() -> Iterator[str]:
    """/image.png: a PNG; /redirect: to it; /to-file: to a file: URL; /loop: to itself;
    /big: a body past 4 KiB; else 404."""
    routes: dict[str, Route] = {
        "/image.png": Body(PNG),
        "/big": Body(b"x" * 10_000),
        "/redirect": Redirect("/image.png"),
        "/to-file": Redirect("file:///etc/passwd"),
        "/loop": Redirect("/loop"),
    }
    with serving_routes(routes) as url:
        yield url


def test_an_http_image_is_fetched_when_private_urls_are_allowed(image_server: str) -> None:
    reader = vision_reader(allow_private_urls=True, max_bytes=4096)
    assert reader.read_url(f"{image_server}/image.png", "p").data == PNG
    assert reader.read_url(f"{image_server}/redirect", "p").data == PNG
    with pytest.raises(InvalidRequestError, match="larger than this node accepts"):
        reader.read_url(f"{image_server}/big", "p")
    with pytest.raises(InvalidRequestError, match="HTTP 404"):
        reader.read_url(f"{image_server}/missing.png", "p")
    # Every redirect's target is checked again.
    with pytest.raises(InvalidRequestError, match=r"its redirect\) must be an http\(s\) URL"):
        reader.read_url(f"{image_server}/to-file", "p")
    with pytest.raises(InvalidRequestError, match="redirects more than 5 times"):
        reader.read_url(f"{image_server}/loop", "p")


def test_a_loopback_image_url_is_refused_by_default(image_server: str) -> None:
    with pytest.raises(InvalidRequestError, match="loopback, private or link-local") as raised:
        vision_reader().read_url(f"{image_server}/image.png", "messages[0].content[1].image_url")
    assert raised.value.param == "messages[0].content[1].image_url"
    # A name that resolves to a private address is refused as its address is.
    named = ImageReader(ImagePolicy(), vision=True, resolve=lambda host, port: ["10.0.0.7"])
    with pytest.raises(InvalidRequestError, match=r"'images\.example'"):
        named.read_url("https://images.example/cat.png", "p")


# ---------------------------------------------------------------- the dialects


@pytest.fixture(scope="module")
def cluster() -> ScriptedCluster:
    return ScriptedCluster()


@pytest.fixture(scope="module")
def base_url(cluster: ScriptedCluster) -> Iterator[str]:
    with serving(scripted_app(cluster)) as (url, _port):
        yield url


@pytest.fixture
def vision(cluster: ScriptedCluster) -> Iterator[ScriptedCluster]:
    """The stand-in cluster with a SmolLM2 card that claims vision, and the default policy
    (tests set `allow_private_urls`); the plain card again afterwards."""
    plain = cluster.cards[SMOLLM2]
    cluster.cards[SMOLLM2] = smollm2_card().model_copy(update={"capabilities": ("text", "vision")})
    cluster.image_policy = ImagePolicy()
    try:
        yield cluster
    finally:
        cluster.cards[SMOLLM2] = plain
        cluster.image_policy = ImagePolicy()


def last_message(cluster: ScriptedCluster, index: int = -1) -> ChatMessage:
    return cluster.last_params.messages[index]


def test_openai_chat_images_reach_the_command(
    vision: ScriptedCluster, base_url: str, image_server: str
) -> None:
    vision.image_policy = ImagePolicy(allow_private_urls=True)
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    client.chat.completions.create(
        model=SMOLLM2,
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Compare"},
                    {"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}},
                    {"type": "image_url", "image_url": {"url": f"{image_server}/image.png"}},
                    {"type": "text", "text": "please."},
                ],
            }
        ],
    )
    message = last_message(vision)
    assert message.content == f"Compare\n{IMAGE_MARKER}\n{IMAGE_MARKER}\nplease."
    assert [image.data for image in message.images] == [PNG, PNG]


def test_openai_chat_refusals_name_the_part(vision: ScriptedCluster, base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)

    def send(url: str) -> openai.BadRequestError:
        with pytest.raises(openai.BadRequestError) as raised:
            client.chat.completions.create(
                model=SMOLLM2,
                messages=[
                    {"role": "system", "content": "Be brief."},
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]},
                ],
            )
        return raised.value

    undecodable = send(NOT_AN_IMAGE)
    assert undecodable.param == "messages[1].content[0].image_url"
    assert "cannot be decoded" in undecodable.message
    vision.image_policy = ImagePolicy(max_pixels=4)
    assert "more pixels" in send(PNG_URL).message
    vision.image_policy = ImagePolicy()
    forbidden = send("http://127.0.0.1:9/cat.png")
    assert "loopback, private or link-local" in forbidden.message
    assert forbidden.param == "messages[1].content[0].image_url"


def test_a_model_without_vision_keeps_its_refusal(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="no vision capability") as raised:
        client.chat.completions.create(
            model=SMOLLM2,
            messages=[
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG_URL}}]}
            ],
        )
    assert raised.value.param == "messages[0].content[0]"
    response = httpx.post(
        f"{base_url}/ollama/api/generate",
        json={"model": SMOLLM2, "prompt": "what is this?", "images": [PNG_URL.split(",")[1]]},
    )
    assert response.status_code == 400 and "no vision capability" in response.json()["error"]


def test_a_marker_typed_by_the_client_is_refused(vision: ScriptedCluster, base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="reserves for an image"):
        client.chat.completions.create(
            model=SMOLLM2, messages=[{"role": "user", "content": f"hi {IMAGE_MARKER}"}]
        )


def test_claude_image_blocks_reach_the_command_including_tool_results(
    vision: ScriptedCluster, base_url: str
) -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="x", max_retries=0)
    source: Any = {"type": "base64", "media_type": "image/png", "data": PNG_URL.split(",")[1]}
    client.messages.create(
        model=SMOLLM2,
        max_tokens=8,
        messages=[
            {"role": "user", "content": "Take a screenshot."},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": "toolu_1", "name": "shot", "input": {}}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [
                            {"type": "text", "text": "here"},
                            {"type": "image", "source": source},
                        ],
                    },
                    {"type": "image", "source": source},
                    {"type": "text", "text": "What is on it?"},
                ],
            },
        ],
    )
    tool, user = last_message(vision, -2), last_message(vision, -1)
    assert (tool.role, tool.content, [i.data for i in tool.images]) == (
        "tool",
        f"here\n{IMAGE_MARKER}",
        [PNG],
    )
    assert (user.content, [i.data for i in user.images]) == (
        f"{IMAGE_MARKER}\nWhat is on it?",
        [PNG],
    )
    broken: Any = {"type": "image", "source": {**source, "data": NOT_AN_IMAGE.split(",")[1]}}
    with pytest.raises(anthropic.BadRequestError, match=r"messages\.0\.content\.0\.source: "):
        client.messages.create(
            model=SMOLLM2, max_tokens=8, messages=[{"role": "user", "content": [broken]}]
        )


def test_responses_input_images_reach_the_command(vision: ScriptedCluster, base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="x", max_retries=0)
    client.responses.create(
        model=SMOLLM2,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": PNG_URL, "detail": "auto"},
                    {"type": "input_text", "text": "Describe it."},
                ],
            }
        ],
    )
    message = last_message(vision)
    assert (message.content, [i.data for i in message.images]) == (
        f"{IMAGE_MARKER}\nDescribe it.",
        [PNG],
    )
    with pytest.raises(openai.BadRequestError, match="exo stores no files") as raised:
        client.responses.create(
            model=SMOLLM2,
            input=[
                {
                    "role": "user",
                    "content": [{"type": "input_image", "file_id": "file-1", "detail": "auto"}],
                }
            ],
        )
    assert raised.value.param == "input[0].content[0].file_id"


def test_ollama_images_reach_the_command(vision: ScriptedCluster, base_url: str) -> None:
    client = ollama.Client(host=f"{base_url}/ollama")
    client.chat(
        model=SMOLLM2,
        messages=[{"role": "user", "content": "What is it?", "images": [PNG]}],
    )
    message = last_message(vision)
    assert (message.content, [i.data for i in message.images]) == (
        f"{IMAGE_MARKER}\nWhat is it?",
        [PNG],
    )
    client.generate(model=SMOLLM2, prompt="Describe.", images=[JPEG])
    message = last_message(vision)
    assert (message.content, [i.media_type for i in message.images]) == (
        f"{IMAGE_MARKER}\nDescribe.",
        ["image/jpeg"],
    )
    with pytest.raises(ollama.ResponseError, match=r"messages\[0\]\.images\[1\]: ") as raised:
        client.chat(
            model=SMOLLM2,
            messages=[{"role": "user", "content": "x", "images": [PNG, b"not an image"]}],
        )
    assert raised.value.status_code == 400
    show = httpx.post(f"{base_url}/ollama/api/show", json={"model": SMOLLM2}).json()
    assert "vision" in show["capabilities"]


def test_the_prompt_size_bound_leaves_images_out_but_not_the_cluster_cap() -> None:
    card = smollm2_card()
    over_the_text_bound = card.context_length * MAX_PROMPT_BYTES_PER_TOKEN + 1

    def params_with_image(size: int) -> TextGenerationTaskParams:
        data = bytes(size)
        image = ImageInput(
            data=data,
            media_type="image/png",
            width=1,
            height=1,
            sha256=hashlib.sha256(data).hexdigest(),
        )
        message = ChatMessage(role="user", content=IMAGE_MARKER, images=(image,))
        return TextGenerationTaskParams(model=SMOLLM2, messages=(message,))

    check_prompt_size(params_with_image(over_the_text_bound), card)
    with pytest.raises(InvalidRequestError, match="send fewer or smaller images") as raised:
        check_prompt_size(params_with_image(MAX_GENERATION_BYTES * 3 // 4 + 1), card)
    assert raised.value.code == "request_too_large"
    # Text past the bound is refused as before, images or not.
    long_text = ChatMessage(role="user", content="x" * over_the_text_bound)
    with pytest.raises(InvalidRequestError, match="shorten the prompt"):
        check_prompt_size(
            params_with_image(10).model_copy(
                update={"messages": (*params_with_image(10).messages, long_text)}
            ),
            card,
        )
