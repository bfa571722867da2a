"""Every route, fed requests generated from the server's own OpenAPI schema (schemathesis, on
Hypothesis): valid bodies, near-misses and wrong types alike. A request is answered or refused
(4xx in its API's error shape), never a 500, a stream it accepts never ends in an error event, and
the server keeps serving. Derandomized, so a run tries the same requests until the schema changes;
a longer search is `FUZZ_EXAMPLES=2000`."""

from __future__ import annotations

import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from live_server import LiveServer

from dflash_core.settings import ModelSettings, ServerSettings, Settings
from dflash_server.app import create_app

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "30"))
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
STREAMING = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages")


@pytest.fixture(scope="module")
def live(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    served = Settings(server=ServerSettings(stored_responses=4),
                      models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    with LiveServer(served) as server:
        yield server


# The schema does not depend on the models served, so it is read from an app that serves none
# (the live server's /openapi.json is the same document). The live stream of the built-in page never
# ends by itself: not a request-response route.
schema = schemathesis.openapi.from_dict(create_app(Settings(models=[])).openapi()).exclude(path="/v1/dflash/live")


def _stream_ends_cleanly(response, case):
    """A stream that was accepted ends as it should: no error event of any of the three APIs
    (chat's error chunk, Messages' `event: error`, Responses' `response.failed`)."""
    if response.status_code == 200 and response.text.startswith(("data:", "event:")):
        # (A quote after a backslash is inside a string of generated text, not the event's own JSON.)
        failed = re.search(r'^event: error$|(?<!\\)"type": ?"(error|response\.failed)"|(?<!\\)"error": ?\{',
                           response.text, re.M)
        assert failed is None, f"{case.method} {case.path}: {response.text[-1500:]}"


def _answered_or_refused(case, live):
    # Aim the generated requests at the served model, so that they reach past the model lookup,
    # and keep generations short (the tiny model's limit is 512 tokens in all).
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = "tiny"
        for field in LENGTH_FIELDS:
            if isinstance(case.body.get(field), int) and case.body[field] > 32:
                case.body[field] = 32
    if case.path_parameters and "model" in case.path_parameters:
        case.path_parameters["model"] = "tiny"
    response = case.call(base_url=live.url, timeout=120)
    assert response.status_code < 500, f"{case.method} {case.path}: {response.status_code} {response.text[:1000]}"
    _stream_ends_cleanly(response, case)
    if response.status_code == 200 and isinstance(case.body, dict) and case.path in STREAMING and not case.body.get("stream"):
        # Few generated requests both pass validation and ask for a stream: stream each one that
        # was answered whole, too.
        case.body["stream"] = True
        streamed = case.call(base_url=live.url, timeout=120)
        assert streamed.status_code == 200, f"{case.path}, streamed: {streamed.status_code} {streamed.text[:1000]}"
        _stream_ends_cleanly(streamed, case)
    if response.status_code >= 400 and case.method != "HEAD":  # a refusal in its API's error shape
        body = response.json()
        assert body["error"]["message"] and body["error"]["type"], body
        if case.path.startswith("/v1/messages"):
            assert body["type"] == "error", body  # Anthropic's
        else:
            assert set(body["error"]) == {"message", "type", "param", "code"}, body  # OpenAI's


def _route_test(method: str, path: str):
    @schema.include(method=method, path=path).parametrize()
    @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
    def test(case, live):
        _answered_or_refused(case, live)

    return test


# One test function per route, each under its own name: schemathesis's own per-route test ids do not
# reach pytest 9.2's items, and pytest-xdist runs only one of several items that share an id.
for _result in schema.get_all_operations():
    _operation = _result.ok()
    _name = f"test_{_operation.method}{re.sub(r'[^a-z0-9]+', '_', _operation.path)}_is_answered_or_refused"
    globals()[_name] = _route_test(_operation.method, _operation.path)


def test_the_server_still_serves_after_the_fuzzing(live):
    response = httpx.post(live.url + "/v1/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3
