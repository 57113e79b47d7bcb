"""Request bodies sent compressed (`Content-Encoding: zstd`, `gzip`, `deflate`, or several
of them in order), as Codex sends its Responses requests: decoded before any route reads
them, on every route, within the same size limit as a plain body (`--max-body-size`
bounds the decoded size too, so a small compressed body cannot expand without end).

Any other encoding is a 415 and a body that does not decode a 400, in the route's dialect.
"""

from __future__ import annotations

import io
import zlib
from dataclasses import dataclass

import zstandard

SUPPORTED_ENCODINGS = ("zstd", "gzip", "x-gzip", "deflate", "identity")


@dataclass(frozen=True, slots=True)
class BodyDecodingError(Exception):
    """A body that cannot be decoded: `status` 415 (unknown encoding), 413 (too large once
    decoded) or 400 (corrupt)."""

    status: int
    message: str


def encodings(header: bytes | None) -> list[str]:
    """The encodings a `Content-Encoding` header lists, in the order they were applied."""
    if header is None:
        return []
    names = [name.strip().lower() for name in header.decode("latin-1").split(",")]
    return [name for name in names if name and name != "identity"]


def decode_body(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with the encodings in `applied` undone (last applied first).

    Args:
        body: The body as received.
        applied: The encodings, in the order the client applied them (`encodings`).
        limit: Most bytes the decoded body (and each step) may have.

    Raises:
        BodyDecodingError: an encoding not in `SUPPORTED_ENCODINGS` (415), a decoded body
            over `limit` (413), or data that is not valid for its encoding (400).
    """
    for name in reversed(applied):
        if name not in SUPPORTED_ENCODINGS:
            raise BodyDecodingError(
                415,
                f"Content-Encoding {name!r} is not supported; send the body plain or "
                "compressed with zstd, gzip or deflate",
            )
        try:
            body = _decode_one(body, name, limit)
        except (zlib.error, zstandard.ZstdError) as error:
            raise BodyDecodingError(
                400, f"the request body is not valid {name} data: {error}"
            ) from None
        if len(body) > limit:
            raise BodyDecodingError(
                413,
                f"the request body is larger than this node accepts once decoded ({limit} "
                "bytes; --max-body-size)",
            )
    return body


def _decode_one(body: bytes, name: str, limit: int) -> bytes:
    if name == "zstd":
        # Frames written without their size (streamed) are decoded as a stream too.
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body)) as reader:
            return reader.read(limit + 1)
    if name in ("gzip", "x-gzip"):
        wbits = 16 + zlib.MAX_WBITS
    else:
        # HTTP's "deflate" is zlib-wrapped; some clients send a raw deflate stream.
        wbits = zlib.MAX_WBITS if body[:1] and (body[0] & 0x0F) == 8 else -zlib.MAX_WBITS
    decoder = zlib.decompressobj(wbits)
    decoded = decoder.decompress(body, limit + 1)
    if not decoder.eof and len(decoded) <= limit:
        raise zlib.error("the compressed data ends early")
    return decoded
