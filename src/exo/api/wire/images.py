"""Image input of every dialect: a client's image (a `data:` URL, base64 text, or an
http(s) URL this node fetches) checked and decoded into an `ImageInput`.

Adapters stay pure functions of the request: they ask an `ImageReader` for each image part
and put `IMAGE_MARKER` at its place in the turn's text. The reader knows the model (a model
without the "vision" capability gets no reader that reads: the adapter answers its
dialect's refusal) and this node's `ImagePolicy`:

- **Size**: at most `max_bytes` of image file (`--image-max-bytes`, default 16 MiB: one
  image that large still fits, as base64, in the 24 MiB a generation may carry through the
  cluster, `MAX_GENERATION_BYTES`; OpenAI and Anthropic take up to 20 MB), at most
  `max_pixels` pixels (`--image-max-pixels`, default 7680 x 4320 = 8K UHD); Pillow's own
  decompression-bomb check stops anything far larger before it is decoded.
- **Decoding**: Pillow opens the bytes (PNG, JPEG, WebP, GIF, BMP), checks them
  (`verify`) and decodes them whole (`load`), so a truncated or corrupt file is a 400 here
  and never a failure in the runner. The format Pillow found decides `media_type`; a type
  the client declared is not trusted.
- **Fetching** an http(s) URL: at most `fetch_timeout_seconds` in all
  (`--image-fetch-timeout`) — host name lookups, connections, redirects and the body
  together: the fetch runs in a thread of its own, which the request waits for that long at
  most (`getaddrinfo` cannot be cancelled; a lookup or read still pending then ends on its
  own: a read within the time left when its request was sent, a lookup at the system
  resolver's timeout) —, the body cut off past `max_bytes`, at most `MAX_REDIRECTS`
  redirects, each one's target checked again. Unless
  `allow_private_urls` (`--image-allow-private-urls`), a host whose addresses include a
  loopback, private (RFC 1918, IPv6 unique-local), link-local, carrier-grade NAT, multicast,
  reserved or unspecified address is refused, so a request cannot make the node read its own
  network (server-side request forgery). The connection goes to the address that was
  checked (the URL's host only names it for TLS and `Host`), so a second DNS answer cannot
  swap in another one.

Every failure is an `InvalidRequestError` naming the request part (`param`, and at the
head of the message, since the Claude and Ollama error shapes have no `param`), which each
dialect answers in its own error shape with status 400.

Fetching and decoding block (network, CPU): `exo.api.serving.generation.convert_request`
runs an adapter that meets an image in a worker thread (`ImagesDeferred`).
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import io
import ipaddress
import socket
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from exo.api.wire.errors import InvalidRequestError
from exo.shared.types.text_generation import ImageInput

# One image this large is 21.3 MiB as base64, within the 24 MiB of `MAX_GENERATION_BYTES`
# (a generation's request travels in the cluster's event log); OpenAI and Anthropic take 20 MB.
DEFAULT_IMAGE_MAX_BYTES = 16 * 2**20
# 8K UHD (7680 x 4320): larger than any camera photo a chat client sends, far below what
# would take seconds to decode. Vision models downscale to a few megapixels anyway.
DEFAULT_IMAGE_MAX_PIXELS = 7680 * 4320
DEFAULT_IMAGE_FETCH_TIMEOUT_SECONDS = 10.0
# Browsers follow 20, curl 50; an image link needs one or two (a CDN's redirect).
MAX_REDIRECTS = 5
# The formats vision chat templates and their processors read (Pillow's names).
ACCEPTED_FORMATS = frozenset({"PNG", "JPEG", "WEBP", "GIF", "BMP"})
_REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})

# Carrier-grade NAT (RFC 6598): not `is_private` in Python, and no public host's address.
_SHARED_ADDRESS_SPACE = ipaddress.ip_network("100.64.0.0/10")


def _refusal(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param)


@dataclass(frozen=True, slots=True)
class ImagePolicy:
    """This node's limits on image input (see the module docstring); bytes, pixels,
    seconds."""

    max_bytes: int = DEFAULT_IMAGE_MAX_BYTES
    max_pixels: int = DEFAULT_IMAGE_MAX_PIXELS
    fetch_timeout_seconds: float = DEFAULT_IMAGE_FETCH_TIMEOUT_SECONDS
    allow_private_urls: bool = False

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or self.max_pixels < 1:
            raise ValueError("the image byte and pixel limits must be at least 1")
        if not self.fetch_timeout_seconds > 0:
            raise ValueError("the image fetch timeout must be positive")


class ImagesDeferred(Exception):
    """An adapter met an image while converting on the event loop: convert it again in a
    worker thread, where fetching and decoding may block."""


Resolver = Callable[[str, int], list[str]]
"""(host, port) -> the host's IP addresses (as text)."""


def resolve_host(host: str, port: int) -> list[str]:
    """The addresses `getaddrinfo` gives `host` (IPv4 and IPv6), in its order."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def is_forbidden_address(address: str) -> bool:
    """Whether a fetch must not reach `address` without `allow_private_urls`: anything but
    a global unicast address (an IPv4 address mapped into IPv6 is judged as IPv4)."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or ip in _SHARED_ADDRESS_SPACE
        or not ip.is_global
    )


class ImageReader:
    """Reads a request's images for one model.

    Args:
        policy: this node's limits.
        vision: whether the model has the "vision" capability; False: `vision` tells the
            adapter to refuse, and every read raises (an adapter bug otherwise).
        defer: raise `ImagesDeferred` at the first image instead of reading it (the first,
            event-loop pass of `convert_request`).
        resolve: host name lookup (tests stand in a fixed answer).
    """

    def __init__(
        self,
        policy: ImagePolicy,
        *,
        vision: bool,
        defer: bool = False,
        resolve: Resolver = resolve_host,
    ) -> None:
        self.policy = policy
        self.vision = vision
        self._defer = defer
        self._resolve = resolve

    def reading(self) -> ImageReader:
        """The same reader, reading instead of deferring."""
        return ImageReader(self.policy, vision=self.vision, resolve=self._resolve)

    def read_url(self, url: str, param: str) -> ImageInput:
        """An image given as a URL: `data:<type>;base64,<data>` or http(s).

        Raises:
            InvalidRequestError: another scheme, a malformed data URL, or any failure of
                `read_base64` / fetching, naming `param`.
        """
        self._start(param)
        scheme = url[: url.find(":")].lower() if ":" in url else ""
        if scheme == "data":
            header, comma, payload = url.partition(",")
            if not comma or not header.lower().endswith(";base64"):
                raise _refusal(
                    "an image data URL must be base64: data:<media type>;base64,<data>", param
                )
            return self.read_base64(payload, param)
        if scheme in ("http", "https"):
            return self._decode(self._fetch(url, param), param)
        raise _refusal(
            "an image URL must be an http(s) URL or a base64 data URL "
            f"(got {url[:40]!r}{'...' if len(url) > 40 else ''})",
            param,
        )

    def read_base64(self, text: str, param: str) -> ImageInput:
        """An image given as base64 text (standard or URL-safe alphabet, padding optional,
        whitespace ignored).

        Raises:
            InvalidRequestError: not base64, larger than the policy allows, or not an image
                Pillow decodes within the pixel limit, naming `param`.
        """
        self._start(param)
        compact = "".join(text.split())
        # Base64 holds 3 bytes in 4 characters: refuse an oversized image before decoding.
        if len(compact) // 4 * 3 > self.policy.max_bytes + 3:
            raise self._too_large(param)
        alphabet = b"-_" if "-" in compact or "_" in compact else None
        try:
            data = base64.b64decode(compact + "=" * (-len(compact) % 4), alphabet, validate=True)
        except (binascii.Error, ValueError):
            raise _refusal("the image is not valid base64", param) from None
        return self._decode(data, param)

    def read_bytes(self, data: bytes, param: str) -> ImageInput:
        """An image given as its file's bytes (see `read_base64`)."""
        self._start(param)
        return self._decode(data, param)

    def _start(self, param: str) -> None:
        if not self.vision:
            raise AssertionError(f"{param}: an image was read for a model without vision")
        if self._defer:
            raise ImagesDeferred

    def _too_large(self, param: str) -> InvalidRequestError:
        return _refusal(
            f"the image is larger than this node accepts ({self.policy.max_bytes} bytes; "
            "--image-max-bytes)",
            param,
        )

    def _decode(self, data: bytes, param: str) -> ImageInput:
        if not data:
            raise _refusal("the image is empty", param)
        if len(data) > self.policy.max_bytes:
            raise self._too_large(param)
        try:
            with warnings.catch_warnings():
                # Our own pixel limit answers first; the warning would only be log noise.
                warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    image_format, (width, height) = image.format, image.size
                    self._check_pixels(width, height, param)
                    if image_format not in ACCEPTED_FORMATS:
                        raise _refusal(
                            f"image format {image_format} is not accepted; send PNG, JPEG, "
                            "WebP, GIF or BMP",
                            param,
                        )
                    image.verify()
                with Image.open(io.BytesIO(data)) as image:
                    image.load()  # the whole first frame: a truncated file fails here
        except Image.DecompressionBombError:
            raise self._too_many_pixels(param) from None
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as error:
            reason = "not an image" if isinstance(error, UnidentifiedImageError) else "corrupt"
            raise _refusal(
                f"the image cannot be decoded ({reason}); send a PNG, JPEG, WebP, GIF or BMP file",
                param,
            ) from None
        assert image_format is not None  # Pillow names the format of every file it opens
        return ImageInput(
            data=data,
            media_type=Image.MIME[image_format],
            width=width,
            height=height,
            sha256=hashlib.sha256(data).hexdigest(),
        )

    def _check_pixels(self, width: int, height: int, param: str) -> None:
        if width * height > self.policy.max_pixels:
            raise self._too_many_pixels(param, f" ({width} x {height})")

    def _too_many_pixels(self, param: str, size: str = "") -> InvalidRequestError:
        return _refusal(
            f"the image has more pixels{size} than this node accepts "
            f"({self.policy.max_pixels}; --image-max-pixels)",
            param,
        )

    # ------------------------------------------------------------ fetching

    def _fetch(self, url: str, param: str) -> bytes:
        """The body of `url` after at most `MAX_REDIRECTS` checked redirects, within
        `fetch_timeout_seconds` from now, host name lookups included."""
        timeout = self.policy.fetch_timeout_seconds
        deadline = time.monotonic() + timeout
        outcome: list[bytes | InvalidRequestError] = []

        def fetch() -> None:
            try:
                outcome.append(self._fetch_by(url, deadline, param))
            except InvalidRequestError as error:
                outcome.append(error)
            except Exception as error:  # a failure in the thread must reach the request
                outcome.append(
                    _refusal(f"the image URL could not be fetched: {type(error).__name__}", param)
                )

        worker = threading.Thread(target=fetch, name="image-fetch", daemon=True)
        worker.start()
        worker.join(timeout)
        if not outcome:
            raise self._timed_out(param)
        result = outcome[0]
        if isinstance(result, InvalidRequestError):
            raise result
        return result

    def _timed_out(self, param: str) -> InvalidRequestError:
        return _refusal(
            "fetching the image URL took longer than "
            f"{self.policy.fetch_timeout_seconds:g} s (--image-fetch-timeout)",
            param,
        )

    def _time_left(self, deadline: float, param: str) -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise self._timed_out(param)
        return left

    def _fetch_by(self, url: str, deadline: float, param: str) -> bytes:
        """`_fetch`'s work (in its thread): each request's connect and read timeouts are
        the time left before `deadline` when it is sent, and the body is checked against
        the deadline after every chunk the network delivers."""
        with httpx.Client(trust_env=False) as client:
            for _ in range(MAX_REDIRECTS + 1):
                request = self._pinned_request(client, url, deadline, param)
                try:
                    response = client.send(request, stream=True)
                except httpx.TimeoutException:
                    raise self._timed_out(param) from None
                except httpx.HTTPError as error:
                    raise _refusal(
                        f"the image URL could not be fetched: {type(error).__name__}", param
                    ) from None
                try:
                    if response.status_code in _REDIRECT_STATUSES:
                        location = response.headers.get("location")
                        if not location:
                            raise _refusal("the image URL redirects nowhere (no Location)", param)
                        url = urljoin(url, location)
                        continue
                    if response.status_code != 200:
                        raise _refusal(
                            f"fetching the image URL answered HTTP {response.status_code}", param
                        )
                    return self._read_body(response, deadline, param)
                finally:
                    response.close()
        raise _refusal(f"the image URL redirects more than {MAX_REDIRECTS} times", param)

    def _pinned_request(
        self, client: httpx.Client, url: str, deadline: float, param: str
    ) -> httpx.Request:
        """A GET of `url` sent to an address of its host that passed the check, with the
        time left before `deadline` as its timeouts."""
        parts = urlsplit(url)
        if parts.scheme.lower() not in ("http", "https") or not parts.hostname:
            raise _refusal(
                "an image URL (or its redirect) must be an http(s) URL with a host", param
            )
        host = parts.hostname
        try:
            port = parts.port or (443 if parts.scheme.lower() == "https" else 80)
        except ValueError:
            raise _refusal("the image URL has an invalid port", param) from None
        try:
            addresses = self._resolve(host, port)
        except OSError:
            raise _refusal(f"the image URL's host {host!r} could not be resolved", param) from None
        if not addresses:
            raise _refusal(f"the image URL's host {host!r} has no address", param)
        if not self.policy.allow_private_urls and any(map(is_forbidden_address, addresses)):
            raise _refusal(
                f"the image URL's host {host!r} is a loopback, private or link-local address, "
                "which this node does not fetch (--image-allow-private-urls)",
                param,
            )
        pinned = httpx.URL(url).copy_with(host=addresses[0].split("%", 1)[0])
        request = client.build_request(
            "GET",
            pinned,
            timeout=self._time_left(deadline, param),
            headers={
                "Host": parts.netloc.rpartition("@")[2],
                "Accept": "image/*",
                # A compressed body could expand past the size cap between two checks.
                "Accept-Encoding": "identity",
            },
        )
        request.extensions["sni_hostname"] = host
        return request

    def _read_body(self, response: httpx.Response, deadline: float, param: str) -> bytes:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.policy.max_bytes:
            raise self._too_large(param)
        body = bytearray()
        try:
            # Each chunk as the network delivers it (no re-chunking to a size: a server
            # trickling bytes would otherwise be checked against the deadline rarely).
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) > self.policy.max_bytes:
                    raise self._too_large(param)
                self._time_left(deadline, param)
        except httpx.TimeoutException:
            raise self._timed_out(param) from None
        except httpx.HTTPError as error:
            raise _refusal(
                f"the image URL could not be fetched: {type(error).__name__}", param
            ) from None
        return bytes(body)


def add_image_arguments(parser: argparse.ArgumentParser) -> None:
    """The image input flags of `exo` (`image_policy_from_args` reads them)."""
    group = parser.add_argument_group("image input")
    group.add_argument(
        "--image-max-bytes",
        type=int,
        default=DEFAULT_IMAGE_MAX_BYTES,
        metavar="BYTES",
        help="largest image file a request may send or link, larger gets 400 (default "
        "%(default)s: 16 MiB)",
    )
    group.add_argument(
        "--image-max-pixels",
        type=int,
        default=DEFAULT_IMAGE_MAX_PIXELS,
        metavar="N",
        help="most pixels (width x height) of one image, more gets 400 (default %(default)s: "
        "7680 x 4320)",
    )
    group.add_argument(
        "--image-fetch-timeout",
        type=float,
        default=DEFAULT_IMAGE_FETCH_TIMEOUT_SECONDS,
        metavar="SECONDS",
        help="seconds to fetch one http(s) image URL, host lookups and redirects included "
        "(default %(default)s)",
    )
    group.add_argument(
        "--image-allow-private-urls",
        action="store_true",
        help="fetch image URLs on loopback, private and link-local addresses (default: refuse "
        "them)",
    )


def image_policy_from_args(
    args: argparse.Namespace, parser: argparse.ArgumentParser
) -> ImagePolicy:
    """The `ImagePolicy` of parsed arguments; `parser.error` for unusable values."""
    try:
        return ImagePolicy(
            max_bytes=args.image_max_bytes,
            max_pixels=args.image_max_pixels,
            fetch_timeout_seconds=args.image_fetch_timeout,
            allow_private_urls=args.image_allow_private_urls,
        )
    except ValueError as error:
        parser.error(str(error))


NO_VISION = ImageReader(ImagePolicy(), vision=False)
"""The reader adapters get when the caller knows no model's capabilities: images refused."""
