"""SIGTERM drains: new requests get 503, running ones finish, and at the deadline what still runs
ends with its API's error (a stream's error event and [DONE], a 503 body), then the server exits."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest
from live_server import LiveServer

from dflash_core.settings import ModelSettings, ServerSettings, Settings


@pytest.mark.timed  # the short request must finish within the 1.5 s drain
def test_sigterm_drains_then_ends_what_still_runs(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(shutdown_timeout=1.5, max_active=4),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter))])
    server = LiveServer(settings).__enter__()
    served = server.state.pool._served["tiny"]
    # The random model never ends by itself: no end of sequence, and a chat no start of a new turn.
    endless = {str(t): -100 for t in served.engine.eos_token_ids | {served.turn_start_token}}
    results = {}

    def stream():
        lines = []
        body = {"model": "tiny", "prompt": "go", "max_tokens": 100_000, "logit_bias": endless, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        results["stream"] = lines

    def whole():
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 100_000,
                "logit_bias": endless}
        results["whole"] = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)

    def short():
        results["short"] = httpx.post(server.url + "/v1/completions", timeout=60,
                                      json={"model": "tiny", "prompt": "hi", "max_tokens": 40, "logit_bias": endless})

    threads = [threading.Thread(target=f) for f in (stream, whole)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.state.scheduler.active < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    threads.append(threading.Thread(target=short))
    threads[-1].start()
    while server.state.scheduler.active < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    signalled = time.monotonic()
    server.server.handle_exit(signal.SIGTERM, None)

    refused = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    anthropic = httpx.post(server.url + "/v1/messages", json={"model": "tiny", "max_tokens": 1,
                                                              "messages": [{"role": "user", "content": "x"}]})
    assert anthropic.status_code == 503 and anthropic.json()["type"] == "error"
    assert httpx.get(server.url + "/health").json() == {"status": "draining"}

    for t in threads:
        t.join(timeout=30)
    assert results["short"].status_code == 200  # finished within the deadline
    assert results["short"].json()["usage"]["completion_tokens"] == 40
    error = json.loads(results["stream"][-2][6:])
    assert error["error"]["code"] == "shutting_down" and results["stream"][-1] == "data: [DONE]"
    assert results["whole"].status_code == 503 and results["whole"].json()["error"]["code"] == "shutting_down"
    server.thread.join(timeout=15)
    assert not server.thread.is_alive() and time.monotonic() - signalled < 1.5 + 8
    server.sock.close()
