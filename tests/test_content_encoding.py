"""Compressed request bodies: gzip and deflate are decoded under the body limit; other codings are a
415, a broken stream a 400, a bomb a 413, each in the API's error shape."""

from __future__ import annotations

import gzip
import json
import zlib

import httpx
import pytest
from live_server import LiveServer

from dflash_core.settings import ModelSettings, ServerSettings, Settings
from server.content_encoding import codings, decode
from server.errors import APIError

BODY = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hello " * 50}]}).encode()


def _raw_deflate(data: bytes) -> bytes:
    packer = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return packer.compress(data) + packer.flush()


# (Named cases: gzip stamps the time into its header, and pytest-xdist's workers must collect the
# same test ids.)
@pytest.mark.parametrize("header, packed", [
    (b"gzip", gzip.compress(BODY)),
    (b"x-gzip", gzip.compress(BODY)),
    (b"deflate", zlib.compress(BODY)),
    (b"deflate", _raw_deflate(BODY)),  # what some clients send as "deflate"
    (b"GZIP", gzip.compress(BODY)),
    (b"identity, gzip", gzip.compress(BODY)),
    (b"gzip", gzip.compress(BODY[:100]) + gzip.compress(BODY[100:])),  # two members (RFC 1952)
], ids=["gzip", "x-gzip", "deflate", "raw-deflate", "upper-case", "identity-then-gzip", "two-members"])
def test_gzip_and_deflate_are_decoded(header, packed):
    assert decode(packed, codings(header), limit=len(BODY)) == BODY


def _status(packed: bytes, header: bytes, limit: int) -> tuple[int, str]:
    with pytest.raises(APIError) as caught:
        decode(packed, codings(header), limit)
    return caught.value.status, caught.value.code


def test_what_cannot_be_decoded_is_refused_with_the_reason():
    assert _status(BODY, b"zstd", 10_000) == (415, "unsupported_content_encoding")
    # One coding at most: each layer could expand to the limit, and a header holds thousands.
    assert _status(gzip.compress(gzip.compress(BODY)), b"gzip, gzip", 10_000) == (415, "unsupported_content_encoding")
    members = b"".join(gzip.compress(b"") for _ in range(65))
    assert _status(members, b"gzip", 10_000) == (400, "invalid_content_encoding")  # past 64 members
    assert _status(BODY, b"br", 10_000) == (415, "unsupported_content_encoding")
    assert _status(BODY, b"gzip", 10_000) == (400, "invalid_content_encoding")  # not gzip at all
    assert _status(gzip.compress(BODY)[:-12], b"gzip", 10_000) == (400, "invalid_content_encoding")  # cut short
    assert _status(gzip.compress(BODY) + b"junk", b"gzip", 10_000) == (400, "invalid_content_encoding")


def test_a_bomb_stops_one_byte_past_the_limit():
    bomb = gzip.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB from about 64 KB
    assert len(bomb) < 100_000
    assert _status(bomb, b"gzip", 1024 * 1024) == (413, "request_too_large")
    exact = gzip.compress(b"x" * 4096)
    assert len(decode(exact, ["gzip"], limit=4096)) == 4096
    assert _status(exact, b"gzip", 4095) == (413, "request_too_large")


def test_the_server_answers_a_compressed_body_as_the_plain_one(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(max_request_bytes=64 * 1024),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "count to ten"}], "max_tokens": 8,
            "temperature": 0}
    plain_chat = json.dumps(chat).encode()
    anthropic = json.dumps({**chat, "max_tokens": 8}).encode()
    with LiveServer(settings) as server:
        def post(path, body, encoding=None):
            headers = {"Content-Type": "application/json"} | ({"Content-Encoding": encoding} if encoding else {})
            return httpx.post(server.url + path, content=body, headers=headers, timeout=60)

        plain = post("/v1/chat/completions", plain_chat)
        assert plain.status_code == 200
        for encoding, packed in (("gzip", gzip.compress(plain_chat)), ("deflate", zlib.compress(plain_chat))):
            answer = post("/v1/chat/completions", packed, encoding)
            assert answer.status_code == 200, answer.text
            assert answer.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
        messages = post("/v1/messages", gzip.compress(anthropic), "gzip")
        assert messages.status_code == 200 and messages.json()["type"] == "message"

        # Refusals, each in its API's shape, and the server serves on.
        refused = post("/v1/chat/completions", plain_chat, "zstd")
        assert refused.status_code == 415 and refused.json()["error"]["code"] == "unsupported_content_encoding"
        assert "gzip or deflate" in refused.json()["error"]["message"]
        assert refused.headers["accept-encoding"] == "gzip, deflate"
        refused = post("/v1/messages", anthropic, "zstd")
        assert refused.status_code == 415 and refused.json()["type"] == "error"
        bomb = post("/v1/chat/completions", gzip.compress(b" " * (1024 * 1024)), "gzip")
        assert bomb.status_code == 413 and bomb.json()["error"]["code"] == "request_too_large"
        broken = post("/v1/responses", b"not gzip", "gzip")
        assert broken.status_code == 400 and broken.json()["error"]["code"] == "invalid_content_encoding"
        assert post("/v1/chat/completions", plain_chat).json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]
