"""Compressed request bodies (`Content-Encoding: gzip` or `deflate`), decoded before the API reads
them.

Starlette hands the app the bytes as sent, so a gzip body would reach the JSON parser as binary and
come back as "invalid JSON", which says nothing of the cause. Clients and proxies that compress
their requests use gzip or deflate (both in the standard library's zlib), so those are decoded;
anything else (zstd, br), or more than one coding, is a 415 that names what is decoded. The
decoded body is held to the same byte limit as a plain one (`server.max_request_bytes`): a few
kilobytes of gzip can expand to gigabytes, so decoding stops one byte past the limit.
"""

from __future__ import annotations

import zlib

from .errors import APIError

# zlib's window bits for each coding: gzip's header and trailer, or deflate's zlib wrapper (RFC 9110;
# a raw deflate stream, as some clients send for "deflate", is tried when the wrapper is missing).
_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
DECODED = ("gzip", "deflate")
# gzip members read one after another: a few in practice; a body of 16 MiB of empty ones would be a
# million rounds of the loop below.
MAX_MEMBERS = 64


def codings(header: bytes) -> list[str]:
    """The codings of a Content-Encoding header, in the order they were applied (identity left
    out)."""
    names = [part.strip().lower() for part in header.decode("latin-1").split(",")]
    return [name for name in names if name and name != "identity"]


def _unsupported(message: str) -> APIError:
    return APIError(415, message, code="unsupported_content_encoding",
                    headers={"Accept-Encoding": ", ".join(DECODED)})  # (RFC 9110: what the server reads)


def decode(body: bytes, applied: list[str], limit: int) -> bytes:
    """`body` with its coding undone. Raises APIError: 415 for a coding not decoded here, or more
    than one (each layer could expand to the limit: thousands of them, which a header allows, would
    cost minutes of CPU for one small request); 400 for a body that is not valid in its coding; 413
    past `limit` bytes."""
    if len(applied) > 1:
        raise _unsupported(f"Content-Encoding {', '.join(applied)}: one coding at most, of {' or '.join(DECODED)}")
    name = applied[0]
    if name not in _WBITS:
        raise _unsupported(f"Content-Encoding {name!r} is not supported: send the body as is, or "
                           f"compressed with {' or '.join(DECODED)}")
    return _inflate(body, name, limit)


def _inflate(body: bytes, name: str, limit: int) -> bytes:
    for wbits in (_WBITS[name], -zlib.MAX_WBITS) if name == "deflate" else (_WBITS[name],):
        out, rest = b"", body
        try:
            for _ in range(MAX_MEMBERS):  # gzip may hold several members one after the other (RFC 1952)
                inflater = zlib.decompressobj(wbits)
                out += inflater.decompress(rest, limit + 1 - len(out))
                if len(out) > limit:
                    raise APIError(413, f"the request body is larger than {limit} bytes once decoded from "
                                        f"{name} (server.max_request_bytes)", code="request_too_large")
                if not inflater.eof or inflater.unconsumed_tail:
                    break  # cut short
                rest = inflater.unused_data
                if not rest:
                    return out
                if wbits != _WBITS["gzip"]:
                    break  # bytes after a deflate stream's end
        except zlib.error:
            continue
        break
    raise APIError(400, f"the request body is not valid {name} data (its Content-Encoding)",
                   code="invalid_content_encoding")
