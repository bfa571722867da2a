"""Compressed request bodies (`Content-Encoding: gzip` or `deflate`), decoded before the API reads
them.

Starlette hands the app the bytes as sent, so a gzip body would reach the JSON parser as binary and
come back as "invalid JSON", which says nothing of the cause. Clients and proxies that compress
their requests use gzip or deflate (both in the standard library's zlib), so those are decoded;
anything else (zstd, br) is a 415 that names what is decoded. The decoded body is held to the same
byte limit as a plain one (`server.max_request_bytes`): a few kilobytes of gzip can expand to
gigabytes, so decoding stops one byte past the limit.
"""

from __future__ import annotations

import zlib

from .errors import APIError

# zlib's window bits for each coding: gzip's header and trailer, or deflate's zlib wrapper (RFC 9110;
# a raw deflate stream, as some clients send for "deflate", is tried when the wrapper is missing).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
DECODED = ("gzip", "deflate")


def codings(header: bytes) -> list[str]:
    """The codings of a Content-Encoding header, in the order they were applied (identity left
    out)."""
    names = [part.strip().lower() for part in header.decode("latin-1").split(",")]
    return [name for name in names if name and name != "identity"]


def decode(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with each of `applied` undone, last applied first. Raises APIError: 415 for a coding
    not decoded here, 400 for a body that is not valid in its coding, 413 past `limit` bytes."""
    for name in reversed(applied):
        if name not in _WBITS:
            raise APIError(415, f"Content-Encoding {name!r} is not supported: send the body as is, or "
                                f"compressed with {' or '.join(DECODED)}", code="unsupported_content_encoding")
        body = _inflate(body, name, limit)
    return body


def _inflate(body: bytes, name: str, limit: int) -> bytes:
    for wbits in (_WBITS[name], -zlib.MAX_WBITS) if name == "deflate" else (_WBITS[name],):
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error:
            continue
        if len(out) > limit:
            raise APIError(413, f"the request body is larger than {limit} bytes once decoded from {name} "
                                "(server.max_request_bytes)", code="request_too_large")
        if inflater.eof and not inflater.unused_data:
            return out
        break  # cut short, or bytes after its end
    raise APIError(400, f"the request body is not valid {name} data (its Content-Encoding)",
                   code="invalid_content_encoding")
