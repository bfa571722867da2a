"""The HTTP server end to end: a real uvicorn server, the official openai SDK, raw httpx for bad input."""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import threading
import time

import httpx
import openai
import pytest
from live_server import LiveServer
from scripted_server import script, scripted_server

from dflash_core.settings import ModelSettings, ServerSettings, Settings

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def live(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(
        server=ServerSettings(api_key=KEY, queue_size=2, max_active=2),
        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)],
    )
    with LiveServer(settings) as server:
        yield server


@pytest.fixture(scope="module")
def client(live):
    return openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)


def _post(live, path, body, key=KEY, **kwargs):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if isinstance(body, (dict, list)):
        return httpx.post(live.url + path, json=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(live.url + path, content=body, headers={**headers, "content-type": "application/json"},
                      timeout=60, **kwargs)


def _still_serving(live, client):
    assert httpx.get(live.url + "/health").status_code == 200
    out = client.completions.create(model="tiny", prompt="ok", max_tokens=2, temperature=0)
    assert out.usage.completion_tokens == 2


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the sea."}]


# ------------------------------------------------------------------------------ happy paths


def test_chat_non_streaming(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert out.usage.completion_tokens == 12 and out.usage.total_tokens == out.usage.prompt_tokens + 12
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    report = out.model_extra["dflash"]
    assert report["speculative"] is True and report["cycles"] >= 1
    assert report["generated_tokens"] == 12 and len(report["acceptance_by_position"]) == 15


def test_chat_streaming_matches_non_streaming(client):
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    message = full.choices[0].message
    assert text == (message.content or "")
    assert reasoning == (message.model_extra.get("reasoning_content") or "")
    finals = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finals) == 1 and finals[0].choices[0].finish_reason == "length"
    assert finals[0].model_extra["dflash"]["speculative"] is True
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 20


def test_completions(client):
    out = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == 10
    stream = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 10


def test_models_health_metrics(live, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(live.url + "/health").json()["status"] == "ok"
    client.completions.create(model="tiny", prompt="x", max_tokens=3, temperature=0)
    text = httpx.get(live.url + "/metrics", headers=AUTH).text
    for name in ("dflash_requests_total", "dflash_queue_depth", "dflash_active_requests", "dflash_generated_tokens_total",
                 "dflash_time_to_first_token_seconds_bucket", "dflash_inter_token_latency_seconds_bucket",
                 "dflash_spec_cycles_total", "dflash_spec_draft_tokens_accepted_total", "dflash_prefill_tokens_per_second"):
        assert name in text, name


def test_concurrent_streams_equal_their_solo_outputs(client):
    prompts = ["The river", "Numbers: 1 2 3"]
    solo = [client.completions.create(model="tiny", prompt=p, max_tokens=40, temperature=0).choices[0].text for p in prompts]

    def stream(prompt):
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=40, temperature=0, stream=True)
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        assert list(pool.map(stream, prompts)) == solo


def test_disconnect_frees_the_worker(live, client):
    scheduler = live.state.scheduler
    body = {"model": "tiny", "prompt": "Go on and on", "max_tokens": 400, "temperature": 0, "stream": True}
    with httpx.stream("POST", live.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"},
                      timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert scheduler.active == 1
    deadline = time.monotonic() + 10
    while scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scheduler.active == 0, "the cancelled generation still holds the worker"
    start = time.monotonic()
    out = client.completions.create(model="tiny", prompt="next", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and time.monotonic() - start < 5
    assert 'dflash_cancelled_requests_total{endpoint="completions"} 1.0' in httpx.get(live.url + "/metrics", headers=AUTH).text


# ------------------------------------------------------------------------------ bad input


def _error(response, status, param=None, code=None):
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.mark.parametrize(
    "body, status, param, code",
    [
        ('{"model": "tiny", "messages": [', 400, None, None),
        ({"model": "tiny", "messages": MESSAGES, "temperature": "hot"}, 400, "temperature", None),
        ({"model": "tiny", "messages": "hello"}, 400, "messages", None),
        ({"model": "tiny", "messages": MESSAGES, "n": 2}, 400, "n", None),
        ({"model": "tiny", "messages": MESSAGES, "top_logprobs": 2}, 400, "top_logprobs", None),
        ({"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", None),
        ({"model": "tiny", "messages": MESSAGES, "response_format": {"type": "xml"}}, 400, "response_format.type", None),
        ({"model": "tiny", "messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "strang"}}}}, 400, "response_format", None),
        ({"model": "tiny", "messages": MESSAGES, "frobnicate": 1}, 400, "frobnicate", None),
        ({"model": "tiny", "messages": MESSAGES, "top_p": 0}, 400, "top_p", None),
        ({"model": "tiny", "messages": MESSAGES, "logit_bias": {"99999999": 1}}, 400, "logit_bias", None),
        ({"model": "nope", "messages": MESSAGES}, 404, "model", "model_not_found"),
        ({"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages",
         "context_length_exceeded"),
        ({"model": "tiny", "messages": MESSAGES, "store": True}, 400, "store", None),
        ({"model": "tiny", "messages": MESSAGES, "stop": ["x" * 1025]}, 400, "stop", None),
        # A result for a call never made, or for none: the template shows results without their ids.
        ({"model": "tiny", "messages": [*MESSAGES, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}]},
         400, "messages", None),
        ({"model": "tiny", "messages": [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "content": "sunny"}]}, 400, "messages", None),
    ],
    ids=["malformed-json", "wrong-type", "messages-not-list", "n2", "top-logprobs-alone", "top-logprobs-21",
         "response-format-type", "bad-schema", "unknown-field", "top-p-zero", "logit-bias-range", "unknown-model",
         "prompt-too-long", "store", "stop-length", "tool-result-for-no-call", "tool-result-without-id"],
)
def test_bad_requests(live, client, body, status, param, code):
    _error(_post(live, "/v1/chat/completions", body), status, param, code)
    _still_serving(live, client)


@pytest.mark.parametrize("body", [b"[]", b'"x"', b""], ids=["list", "string", "empty"])
def test_a_body_that_is_not_an_object_is_named_as_such(live, client, body):
    error = _error(_post(live, "/v1/chat/completions", body), 400)
    assert "JSON object" in error["message"] and error["param"] is None
    _still_serving(live, client)


def test_an_unexpected_error_is_a_counted_json_500(live, client, monkeypatch):
    async def broken(name):
        raise RuntimeError("planted bug")

    monkeypatch.setattr(live.state.pool, "get", broken)
    error = _error(_post(live, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES}), 500)
    assert error["type"] == "server_error" and "planted bug" in error["message"]
    monkeypatch.undo()
    metrics = httpx.get(live.url + "/metrics", headers=AUTH).text
    assert 'dflash_requests_total{endpoint="/v1/chat/completions",status="500"}' in metrics
    _still_serving(live, client)


def test_store_false_accepted(live, client):
    ok = _post(live, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "store": False})
    assert ok.status_code == 200


def test_retrieve_model(client):
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_stop_string_usage_counts_only_what_was_generated_before_the_stop(scripted):
    _script(scripted, "scripted-qwen", "</think>\n\nOne STOP two three four five six seven eight nine ten eleven.")
    first = scripted.client.chat.completions.create(model="scripted-qwen", messages=[{"role": "user", "content": "hi"}],
                                                    stop="STOP", temperature=0)
    again = scripted.client.chat.completions.create(model="scripted-qwen", messages=[{"role": "user", "content": "hi"}],
                                                    stop="STOP", temperature=0)
    assert first.choices[0].message.content == "One "
    assert first.usage.completion_tokens == again.usage.completion_tokens  # not racing the worker
    # The scripted model commits 16 tokens a cycle; usage counts only those through the token
    # that completes "STOP", as a target-alone run (one token a step) would.
    script = scripted.state.pool._served["scripted-qwen"].engine.target.script
    decode = scripted.state.pool._served["scripted-qwen"].engine.tokenizer._tokenizer.decode
    through_stop = next(k for k in range(1, len(script) + 1) if "STOP" in decode(script[:k]))
    assert first.usage.completion_tokens == through_stop < 16
    assert first.usage.total_tokens == first.usage.prompt_tokens + through_stop
    text = scripted.client.completions.create(model="scripted-qwen", prompt="hi", stop=["STOP"], temperature=0)
    assert text.choices[0].text == "</think>\n\nOne " and text.usage.completion_tokens == through_stop


def test_max_tokens_past_the_context_generates_up_to_the_limit(live, client):
    """Agent clients send their model's output limit; the room left bounds it (ends with length)."""
    served = live.state.pool._served["tiny"]
    # So the random model runs to the limit: no end of sequence, no start of another turn.
    no_eos = {str(t): -100 for t in served.engine.eos_token_ids | {served.turn_start_token}}
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=600, temperature=0,
                                         logit_bias=no_eos)
    assert out.choices[0].finish_reason == "length" and out.usage.total_tokens == 512
    text = client.completions.create(model="tiny", prompt="word " * 50, max_tokens=10_000, logit_bias=no_eos)
    assert text.choices[0].finish_reason == "length" and text.usage.total_tokens == 512


def test_context_error_reports_token_counts(live):
    error = _error(_post(live, "/v1/completions", {"model": "tiny", "prompt": "word " * 600}), 400,
                   param="prompt", code="context_length_exceeded")
    _error(_post(live, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "word " * 600}]}),
           400, param="messages", code="context_length_exceeded")
    assert "512" in error["message"] and "prompt" in error["message"]


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized_whole(live):
    """Counted piece by piece, a prompt is refused once it is certainly past the context: the
    count it reports is a lower bound found early, far below the prompt's own (a tokenizer takes
    about 200 bytes a character: a 15 MB prompt took 2.7 GB and 21 s)."""
    tokenizer = live.state.pool._served["tiny"].engine.tokenizer
    text = "word " * 200_000  # 1 MB
    whole = len(tokenizer.encode(text))
    for path, body, param in (("/v1/completions", {"model": "tiny", "prompt": text}, "prompt"),
                              ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}]},
                               "messages")):
        error = _error(_post(live, path, body), 400, param=param, code="context_length_exceeded")
        counted = int(re.search(r"at least (\d+) tokens", error["message"]).group(1))
        assert 512 <= counted < whole / 2


@pytest.mark.parametrize("key", [None, "wrong", "sk-\u00e9"])
def test_api_key_is_required(live, client, key):
    headers = {"Authorization": f"Bearer {key}".encode("latin-1")} if key else {}  # bytes: any header octets
    response = httpx.post(live.url + "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES},
                          headers=headers, timeout=60)
    error = _error(response, 401)
    assert error["type"] == "authentication_error"
    # The key is checked before the body is read: a malformed body without it is still a 401.
    _error(_post(live, "/v1/chat/completions", b"{not json", key=None), 401)
    assert httpx.get(live.url + "/v1/models").status_code == 401
    _still_serving(live, client)


def test_an_sdk_message_goes_back_unchanged_and_stream_may_be_null(live, client):
    """Agent loops append `message.model_dump()`: its null refusal/audio/function_call are fine."""
    reply = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=3, temperature=0)
    history = MESSAGES + [reply.choices[0].message.model_dump(), {"role": "user", "content": "More."}]
    assert {"refusal", "audio", "function_call", "annotations"} <= set(history[-2])
    again = client.chat.completions.create(model="tiny", messages=history, max_tokens=3, temperature=0)
    assert again.usage.completion_tokens == 3
    refused = dict(history[-2], refusal="I can't.")
    _error(_post(live, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES + [refused]}), 400,
           param="messages[2].refusal")
    plain = _post(live, "/v1/completions", {"model": "tiny", "prompt": "ok", "max_tokens": 2, "stream": None})
    assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 2


def test_wrong_method_answers_405_with_allow(live):
    response = httpx.get(live.url + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    _error(response, 405)
    assert "POST" in response.headers["allow"]


def test_full_queue_answers_429(live, client):
    """max_active=2 and queue_size=2: with two long streams running and two waiting, one more is refused."""
    body = {"model": "tiny", "prompt": "long", "max_tokens": 400, "temperature": 0, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    streams = []
    try:
        for _ in range(4):
            ctx = httpx.stream("POST", live.url + "/v1/completions", json=body, headers=headers, timeout=60)
            streams.append(ctx)
            assert ctx.__enter__().status_code == 200
        error = _error(_post(live, "/v1/completions", {**body, "stream": False}), 429)
        assert error["type"] == "rate_limit_error"
        assert _post(live, "/v1/completions", {**body, "stream": False}).headers["retry-after"]
    finally:
        for ctx in streams:
            ctx.__exit__(None, None, None)
    deadline = time.monotonic() + 10
    while (live.state.scheduler.active or live.state.scheduler.waiting) and time.monotonic() < deadline:
        time.sleep(0.01)
    _still_serving(live, client)


# ------------------------------------------------------------------ forced-output (scripted) models


@pytest.fixture(scope="module")
def scripted(qwen3_5_pair, gemma4_pair):
    with scripted_server({"scripted-qwen": qwen3_5_pair, "scripted-gemma": gemma4_pair}) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


_script = script


def _stream_chat(client, model, **kwargs):
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, temperature=0, **kwargs))
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks if c.choices)
    reasoning_alias = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices)
    assert reasoning == reasoning_alias
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return chunks, content, reasoning, finish


def test_reasoning_goes_to_reasoning_content(scripted):
    _script(scripted, "scripted-qwen", "The user greets me. I should answer politely.\n</think>\n\nHello there, friend!")
    chunks, content, reasoning, finish = _stream_chat(scripted.client, "scripted-qwen")
    assert reasoning == "The user greets me. I should answer politely."
    assert content == "Hello there, friend!" and finish == ["stop"]
    full = scripted.client.chat.completions.create(model="scripted-qwen", messages=[{"role": "user", "content": "hi"}],
                                                   temperature=0)
    message = full.choices[0].message
    assert message.content == "Hello there, friend!"
    assert message.model_extra["reasoning_content"] == message.model_extra["reasoning"] == reasoning
    # Multi-token commits really happened: 16 tokens per cycle.
    assert full.model_extra["dflash"]["tokens_per_cycle"] > 8


def test_thinking_off_gives_plain_content(scripted):
    _script(scripted, "scripted-qwen", "Just the answer.")
    _, content, reasoning, _ = _stream_chat(scripted.client, "scripted-qwen",
                                           extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert content == "Just the answer." and reasoning == ""


QWEN_CALL = (
    "I will look it up.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)


def test_tool_call_streaming_and_not(scripted):
    _script(scripted, "scripted-qwen", QWEN_CALL)
    chunks, content, reasoning, finish = _stream_chat(scripted.client, "scripted-qwen", tools=[WEATHER_TOOL])
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls[0].id and calls[0].function.name == "get_weather" and calls[0].index == 0
    arguments = "".join(tc.function.arguments or "" for tc in calls)
    assert json.loads(arguments) == {"city": "Paris", "days": 3}
    assert finish == ["tool_calls"] and content == "" and reasoning == "I will look it up."

    full = scripted.client.chat.completions.create(model="scripted-qwen", messages=[{"role": "user", "content": "hi"}],
                                                   tools=[WEATHER_TOOL], temperature=0)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}


def test_tool_call_round_trip_renders(scripted):
    """An assistant tool call and a tool result are accepted back into the conversation."""
    _script(scripted, "scripted-qwen", "</think>\n\nIt is sunny.")
    out = scripted.client.chat.completions.create(
        model="scripted-qwen", tools=[WEATHER_TOOL], temperature=0,
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )
    assert out.choices[0].message.content == "It is sunny."


def test_named_tool_choice_forces_the_call(scripted):
    # The server writes the opening; the model only continues with the parameters. Stop strings
    # apply to what the model writes, not to that opening.
    _script(scripted, "scripted-qwen", "<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>")
    out = scripted.client.chat.completions.create(
        model="scripted-qwen", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL], temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, stop=["<tool_call>"])
    assert out.choices[0].finish_reason == "tool_calls"
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Oslo"}


def test_malformed_tool_call_falls_back_to_content(scripted):
    text = "</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome"
    _script(scripted, "scripted-qwen", text)
    _, content, _, finish = _stream_chat(scripted.client, "scripted-qwen", tools=[WEATHER_TOOL])
    assert "<tool_call>" in content and "Rome" in content and finish == ["stop"]


@pytest.mark.parametrize("value", ["1e999", "NaN", "-Infinity"])
def test_a_call_with_a_number_json_cannot_hold_is_content(scripted, value):
    """Python's json reads NaN, Infinity and 1e999 (as inf); no JSON parser of a client does. Such a
    call stays text, on every API, streamed or not (the Messages API answered a 500 before)."""
    text = '</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "x", "n": %s}}\n</tool_call>' % value
    _script(scripted, "scripted-qwen", text)
    _, content, _, finish = _stream_chat(scripted.client, "scripted-qwen", tools=[WEATHER_TOOL])
    assert "<tool_call>" in content and finish == ["stop"]
    tool = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
    body = {"model": "scripted-qwen", "max_tokens": 100, "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}
    for stream in (False, True):
        r = httpx.post(scripted.url + "/v1/messages", json={**body, "stream": stream}, timeout=60)
        assert r.status_code == 200 and "tool_use" not in r.text and value in r.text, r.text[-500:]


def test_gemma4_tool_call(scripted):
    _script(scripted, "scripted-gemma", '<|tool_call>call:get_weather{city:<|"|>Lima<|"|>,days:2}<tool_call|>')
    chunks, content, _, finish = _stream_chat(scripted.client, "scripted-gemma", tools=[WEATHER_TOOL])
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert calls and calls[0].function.name == "get_weather"
    assert json.loads("".join(tc.function.arguments or "" for tc in calls)) == {"city": "Lima", "days": 2}
    assert finish == ["tool_calls"]


def test_gemma4_reasoning_channel(scripted):
    _script(scripted, "scripted-gemma", "<|channel>thought\nPondering.<channel|>Answer.")
    _, content, reasoning, _ = _stream_chat(scripted.client, "scripted-gemma")
    assert reasoning.strip() == "Pondering." and content == "Answer."


@pytest.mark.parametrize("stop", ["brown fox", ["zzz", "lazy"], "Answer: The quick"])
def test_stop_strings_straddling_commits_never_leak(scripted, stop):
    text = "</think>\n\nAnswer: The quick brown fox jumps over the lazy dog, again and again and again."
    _script(scripted, "scripted-qwen", text)
    _, content, _, finish = _stream_chat(scripted.client, "scripted-qwen", stop=stop)
    stops = [stop] if isinstance(stop, str) else stop
    visible = text.split("</think>\n\n", 1)[1]
    cut = min(visible.index(s) for s in stops if s in visible)
    assert content == visible[:cut] and finish == ["stop"]
    completion = scripted.client.completions.create(model="scripted-qwen", prompt="x", stop=stop, temperature=0)
    assert all(s not in completion.choices[0].text for s in stops)
    assert completion.choices[0].finish_reason == "stop"


def test_multibyte_characters_split_across_tokens_stream_intact(scripted):
    text = "</think>\n\nGrüße 東京 🚀🔥 naïve café ✓"
    tokens = _script(scripted, "scripted-qwen", text)
    hf = scripted.state.pool._served["scripted-qwen"].engine.tokenizer._tokenizer
    assert any("\ufffd" in hf.decode([t]) for t in tokens), "the script should split a character"
    chunks, content, _, _ = _stream_chat(scripted.client, "scripted-qwen")
    pieces = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert all("\ufffd" not in p for p in pieces)
    assert content == "Grüße 東京 🚀🔥 naïve café ✓"
    # Target-alone decoding hands out one token at a time: still intact.
    engine = scripted.state.pool._served["scripted-qwen"].engine
    drafter, engine.drafter = engine.drafter, None
    try:
        _, content, _, _ = _stream_chat(scripted.client, "scripted-qwen")
    finally:
        engine.drafter = drafter
    assert content == "Grüße 東京 🚀🔥 naïve café ✓"


# ------------------------------------------------------------------------------ several models


def test_several_models_lazy_loading_and_memory_budget(qwen3_pair, gemma4_pair):
    """Two models, one loaded on first use; a budget that fits one model unloads the least recently used."""
    settings = Settings(
        memory_budget_gb=0.002,  # each tiny target + drafter is 1.2 to 1.3 MB of weights
        models=[
            ModelSettings(name="a", target=str(qwen3_pair[0]), drafter=str(qwen3_pair[1])),
            ModelSettings(name="b", target=str(gemma4_pair[0]), drafter=str(gemma4_pair[1]), load_at_start=False),
        ],
    )
    with LiveServer(settings) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        pool = server.state.pool
        assert [m.id for m in client.models.list().data] == ["a", "b"]
        assert [m.name for m in pool.served()] == ["a"]
        out = client.completions.create(model="b", prompt="hello", max_tokens=4, temperature=0)
        assert out.usage.completion_tokens == 4 and out.model_extra["dflash"]["speculative"]
        assert [m.name for m in pool.served()] == ["b"]  # "a" was unloaded to make room
        client.completions.create(model="a", prompt="hello", max_tokens=4, temperature=0)
        assert [m.name for m in pool.served()] == ["a"]


def test_a_model_that_cannot_load_answers_503_and_the_server_stays_up(qwen3_pair, tmp_path):
    settings = Settings(models=[
        ModelSettings(name="ok", target=str(qwen3_pair[0]), drafter=str(qwen3_pair[1])),
        ModelSettings(name="missing", target=str(tmp_path / "nowhere"), drafter=None, load_at_start=False),
    ])
    with LiveServer(settings) as server:
        response = httpx.post(server.url + "/v1/completions", json={"model": "missing", "prompt": "x"}, timeout=30)
        error = _error(response, 503, code="model_unavailable")
        assert "nowhere" in error["message"]
        ok = httpx.post(server.url + "/v1/completions", json={"model": "ok", "prompt": "x", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


def test_an_exception_fails_only_its_request(scripted):
    target = scripted.state.pool._served["scripted-qwen"].engine.target
    _script(scripted, "scripted-qwen", "</think>\n\nA long enough answer to need several cycles of decoding here.")
    target.forwards, target.fail_after = 0, 2
    try:
        body = {"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}
        error = _error(httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=30), 500)
        assert "planted failure" in error["message"]
        target.forwards = 0
        with httpx.stream("POST", scripted.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert any("planted failure" in e for e in events) and events[-1] == "data: [DONE]"
    finally:
        target.fail_after = None
    _, content, _, finish = _stream_chat(scripted.client, "scripted-qwen")
    assert content.startswith("A long enough answer") and finish == ["stop"]
    # The worker drops finished jobs at its next turn.
    deadline = time.monotonic() + 10
    while scripted.state.scheduler.active and time.monotonic() < deadline:
        time.sleep(0.01)
    assert scripted.state.scheduler.active == 0


TWO_CALLS = ("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
             "</tool_call>\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n"
             "</tool_call>")


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_ends_with_the_first_call(scripted, stream):
    script_ids = _script(scripted, "scripted-qwen", TWO_CALLS)
    kwargs = dict(model="scripted-qwen", messages=[{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL],
                  temperature=0)
    both = scripted.client.chat.completions.create(**kwargs)
    assert [json.loads(c.function.arguments)["city"] for c in both.choices[0].message.tool_calls] == ["Paris", "Oslo"]
    if stream:
        chunks = list(scripted.client.chat.completions.create(**kwargs, parallel_tool_calls=False, stream=True,
                                                              stream_options={"include_usage": True}))
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or []) if tc.id]
        usage, finish = chunks[-1].usage, [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        one = scripted.client.chat.completions.create(**kwargs, parallel_tool_calls=False)
        calls, usage, finish = one.choices[0].message.tool_calls, one.usage, [one.choices[0].finish_reason]
    assert len(calls) == 1 and finish == ["tool_calls"]
    # Usage counts the tokens through the first call, as the target alone would have stopped there.
    decode = scripted.state.pool._served["scripted-qwen"].engine.tokenizer._tokenizer.decode
    first_end = TWO_CALLS.index("</tool_call>") + len("</tool_call>")
    through = next(k for k in range(1, len(script_ids) + 1) if len(decode(script_ids[:k])) >= first_end)
    assert usage.completion_tokens == through < both.usage.completion_tokens


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": True}, "max_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "temperature": True}, "temperature"),
    ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "stream": "yes"}, "stream"),
    ("/v1/completions", {"model": "tiny", "prompt": [True]}, "prompt"),
    ("/v1/responses", {"model": "tiny", "input": "x", "max_output_tokens": "10"}, "max_output_tokens"),
    ("/v1/responses", {"model": "tiny", "input": "x", "stream": 1}, "stream"),
    ("/v1/messages", {"model": "tiny", "messages": MESSAGES, "max_tokens": "10"}, None),
], ids=["max-tokens-string", "max-tokens-bool", "temperature-bool", "stream-string", "prompt-bools",
        "responses-max", "responses-stream", "messages-max"])
def test_wrong_json_types_are_a_400(live, client, path, body, param):
    response = _post(live, path, body)
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"].startswith(param)
    _still_serving(live, client)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800b"}]}',
     "messages[0].content"),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800"}', "prompt"),
    ("/v1/responses", '{"model": "tiny", "input": "x\\udfff"}', "input"),
    ("/v1/messages", '{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "\\ud800"}]}',
     "messages[0].content"),
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "tools": [{"type": '
     '"function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"k\\udc00": {}}}}}]}',
     "tools[0].function.parameters.properties.'k\\udc00'"),
    ("/v1/messages", '{"model": "tiny", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}], "tools": '
     '[{"name": "f", "input_schema": {"type": "object", "properties": {"\\ud800": {}}}}]}',
     "tools[0].input_schema.properties.'\\ud800'"),
], ids=["chat", "completions", "responses", "messages", "chat-schema-key", "messages-schema-key"])
def test_a_lone_surrogate_is_a_400_naming_the_field(live, client, path, body, param):
    response = _post(live, path, body.encode())
    assert response.status_code == 400, response.text
    error = response.json()["error"]  # Anthropic's shape has no param: the message names it
    assert error.get("param", param) == param and error["message"].startswith(param)
    _still_serving(live, client)


def test_an_oversized_body_is_a_413_in_the_apis_shape(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(max_request_bytes=4096),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    with LiveServer(settings) as server:
        big = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 5000}]}
        assert httpx.post(server.url + "/v1/chat/completions", json=big).json()["error"]["code"] == "request_too_large"
        chunks = (b'{"model": "tiny", "prompt": "' + b"y" * 1000, *[b"y" * 1000] * 4, b'"}')
        streamed = httpx.post(server.url + "/v1/completions", content=iter(chunks))  # no Content-Length
        assert streamed.status_code == 413
        anthropic_shape = httpx.post(server.url + "/v1/messages", json={**big, "max_tokens": 2})
        assert anthropic_shape.status_code == 413 and anthropic_shape.json()["error"]["type"] == "request_too_large"
        small = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert small.status_code == 200


def test_tokenizing_a_large_prompt_does_not_freeze_the_server(qwen3_5_pair):
    """The prompt is rendered and tokenized off the event loop: /health answers meanwhile. (A
    context of 500K tokens: the prompt, of fewer than 8 characters a token, is then tokenized whole
    before it is refused, not counted in pieces as a prompt far past a small context is.)"""
    target, drafter = qwen3_5_pair
    settings = Settings(models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=500_000)])
    with LiveServer(settings) as live:
        _check_tokenizing_does_not_freeze(live)


def _check_tokenizing_does_not_freeze(live):
    stop = threading.Event()
    slowest = []

    def poll():
        while not stop.is_set():
            started = time.perf_counter()
            assert httpx.get(live.url + "/health", timeout=30).status_code == 200
            slowest.append(time.perf_counter() - started)

    watcher = threading.Thread(target=poll)
    watcher.start()
    try:
        started = time.perf_counter()
        response = _post(live, "/v1/chat/completions",
                         {"model": "tiny", "messages": [{"role": "user", "content": "café naïve 日本語 " * 200_000}]}, key=None)
        took = time.perf_counter() - started
    finally:
        stop.set()
        watcher.join()
    assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
    assert took > 1.0  # long enough that a blocked loop would show
    assert max(slowest) < took / 3, (max(slowest), took)


def test_client_template_arguments_are_refused(live, client):
    template = "{% for i in range(9) %}x{% endfor %}"
    body = {"model": "tiny", "messages": MESSAGES, "chat_template_kwargs": {"chat_template": template}}
    _error(_post(live, "/v1/chat/completions", body), 400, "chat_template_kwargs.chat_template")
    ok = {"model": "tiny", "messages": MESSAGES, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}}
    assert _post(live, "/v1/chat/completions", ok).status_code == 200


def test_metrics_and_docs_need_the_key_health_does_not(live):
    for path in ("/metrics", "/docs", "/openapi.json", "/redoc"):
        assert httpx.get(live.url + path).status_code == 401, path
        assert httpx.get(live.url + path, headers=AUTH).status_code == 200, path
    assert httpx.get(live.url + "/health").status_code == 200


@pytest.mark.parametrize("host, status", [
    ("127.0.0.1:8000", 200), ("localhost", 200), ("[::1]:8000", 200), ("app.localhost", 200),
    ("evil.example:8000", 421), ("192.168.1.5", 421), ("attacker.com", 421),
], ids=lambda v: str(v))
def test_a_loopback_server_answers_only_loopback_host_names(live, host, status):
    """DNS rebinding: a page on attacker.com that resolves to 127.0.0.1 sends Host: attacker.com."""
    response = httpx.get(live.url + "/v1/models", headers={**AUTH, "Host": host})
    assert response.status_code == status, response.text
    if status == 421:
        assert response.json()["error"]["code"] == "invalid_host"


def test_allowed_hosts_extend_the_loopback_names(qwen3_5_pair):
    settings = Settings(server=ServerSettings(allowed_hosts=["dflash.lan"]),
                        models=[ModelSettings(name="tiny", target=str(qwen3_5_pair[0]), drafter=None)])
    with LiveServer(settings) as server:
        assert httpx.get(server.url + "/health", headers={"Host": "dflash.lan:8000"}).status_code == 200
        assert httpx.get(server.url + "/health", headers={"Host": "other.lan"}).status_code == 421


# ------------------------------------------------------------------------------ connections


def test_idle_connections_outlive_the_clients_own_keep_alive():
    """The server keeps an idle connection open longer than the SDKs' HTTP clients keep theirs, so
    a client always closes first and never sends a request on a connection the server is closing
    (with uvicorn's 5 s against httpx's 5 s, a request sent just as the server times the connection
    out fails with "Server disconnected"). And the setting is what uvicorn runs with: a live server
    closes an idle connection after it."""
    import socket

    import anthropic._constants
    import openai._constants

    from dflash_server.app import create_app
    from dflash_server.process import uvicorn_config

    config = uvicorn_config(create_app(Settings(models=[])), ServerSettings())
    for limits in (openai._constants.DEFAULT_CONNECTION_LIMITS, anthropic._constants.DEFAULT_CONNECTION_LIMITS):
        assert config.timeout_keep_alive > limits.keepalive_expiry
    assert config.timeout_keep_alive > 4  # Node's fetch (undici): 4 s

    # (No model: /health answers 503, which is as good a request as any here.)
    with LiveServer(Settings(server=ServerSettings(keep_alive=0.5), models=[]), ready=lambda health: True) as server:
        with socket.create_connection(("127.0.0.1", server.port)) as conn:
            request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
            for _ in range(2):  # kept open between requests
                conn.sendall(request)
                assert _read_response(conn).startswith(b"HTTP/1.1 ")
            idle = time.monotonic()
            conn.settimeout(10)
            assert conn.recv(65536) == b""  # then closed by the server, after the configured time
            assert 0.4 < time.monotonic() - idle < 3  # (uvicorn alone: 5 s)


def _read_response(conn) -> bytes:
    """One whole HTTP/1.1 response (its body by Content-Length) from a socket."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def test_a_request_past_its_timeout_is_a_504_in_each_apis_shape(scripted):
    """request_timeout ends the generation (on the worker: a client that stops reading is held to it
    too) and answers in the API's shape; the server keeps serving."""
    server = scripted.state.settings.server
    _script(scripted, "scripted-qwen", "</think>\n\nAn answer that never gets out in time.")
    saved, server.request_timeout = server.request_timeout, 1e-6
    try:
        body = {"model": "scripted-qwen", "messages": [{"role": "user", "content": "hi"}]}
        error = _error(httpx.post(scripted.url + "/v1/chat/completions", json=body, timeout=30), 504, code="timeout")
        assert "took longer than" in error["message"]
        with httpx.stream("POST", scripted.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert any('"timeout"' in e for e in events) and events[-1] == "data: [DONE]"
        messages = {"model": "scripted-qwen", "max_tokens": 64, "messages": [{"role": "user", "content": "hi"}]}
        response = httpx.post(scripted.url + "/v1/messages", json=messages, timeout=30)
        assert response.status_code == 504 and response.json()["type"] == "error"
    finally:
        server.request_timeout = saved
    _, content, _, finish = _stream_chat(scripted.client, "scripted-qwen")
    assert content.startswith("An answer") and finish == ["stop"]


def test_a_stream_whose_client_stopped_reading_ends_and_releases_the_model(qwen3_5_pair, caplog):
    """A client that stops reading (and never closes) fills the socket's buffers: a send waiting
    `send_timeout` ends the stream, counted as a client gone (not a server error), and the model is
    released; the server goes on serving."""
    settings = Settings(server=ServerSettings(send_timeout=1.0), models=[])
    with scripted_server({"m": qwen3_5_pair}, settings) as server:
        script(server, "m", "</think>\n\n" + " ".join(["the quick brown fox jumps over the lazy dog"] * 1500))
        body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
                           "logprobs": True, "top_logprobs": 20, "max_tokens": 20000}).encode()
        stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        stalled.connect(("127.0.0.1", server.port))
        stalled.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                        b"Content-Length: %d\r\n\r\n" % len(body) + body)
        assert stalled.recv(64).startswith(b"HTTP/1.1 200")  # then it reads no more
        served = server.state.pool._served["m"]
        deadline = time.monotonic() + 60
        while (served.in_use or server.state.scheduler.active) and time.monotonic() < deadline:
            time.sleep(0.05)
        try:
            assert served.in_use == 0 and server.state.scheduler.active == 0
            cancelled = {s.labels["endpoint"]: s.value for s in server.state.metrics.cancelled.collect()[0].samples
                         if s.name.endswith("_total")}
            assert cancelled == {"chat": 1.0}
            assert "stopped reading" in caplog.text and "unexpected error" not in caplog.text
            script(server, "m", "</think>\n\nDone.")
            ok = httpx.post(server.url + "/v1/chat/completions",
                            json={"model": "m", "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
            assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "Done."
        finally:
            stalled.close()


def _partial_post(port: int, path: str, headers: bytes, sent: bytes, length: int) -> socket.socket:
    """A POST that announces `length` bytes of body and sends only `sent`, then waits."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n" + headers
                 + b"Content-Length: %d\r\n\r\n" % length + sent)
    conn.settimeout(30)
    return conn


def _read_response(conn: socket.socket) -> bytes:
    """One whole HTTP response with a Content-Length (headers and body may come in separate reads)."""
    data = b""
    while b"\r\n\r\n" not in data:
        more = conn.recv(4096)
        assert more, f"the connection closed before a whole response: {data!r}"
        data += more
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"content-length: *(\d+)", head, re.I).group(1))
    while len(body) < length:
        more = conn.recv(4096)
        if not more:
            break
        body += more
    return head + b"\r\n\r\n" + body


def test_a_body_is_read_only_for_a_request_with_the_key_and_only_for_so_long(qwen3_5_pair):
    """A client without the key is answered 401 from its headers, before any of its body is read
    (it cannot hold the server's memory with unfinished bodies); a body that stops coming is a 408
    after `server.body_timeout`, in the API's shape."""
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(api_key=KEY, body_timeout=1.0),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    with LiveServer(settings) as server:
        keyless = _partial_post(server.port, "/v1/chat/completions", b"", b'{"model": "tiny", "mess', 10_000_000)
        slow = _partial_post(server.port, "/v1/messages", b"x-api-key: " + KEY.encode() + b"\r\n", b'{"model"', 1000)
        try:
            assert _read_response(keyless).startswith(b"HTTP/1.1 401")
            answer = _read_response(slow)
            assert answer.startswith(b"HTTP/1.1 408") and b'"type":"error"' in answer.replace(b" ", b"")
        finally:
            keyless.close()
            slow.close()
        ok = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200


_OBJECT = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [{"type": "function", "function": {"name": "a>b", "parameters": _OBJECT}}]},
     "tools"),
    ("/v1/messages", {"max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                      "tools": [{"name": "x\ny", "input_schema": _OBJECT}]}, None),
    ("/v1/responses", {"input": "hi", "tools": [{"type": "function", "name": 'a", "b', "parameters": _OBJECT}]}, "tools"),
    # A strict call's property names go into its markup (Qwen's <parameter=...> here).
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required",
                              "tools": [{"type": "function", "function": {
                                  "name": "f", "strict": True,
                                  "parameters": {"type": "object", "properties": {"</parameter>": {"type": "string"}}}}}]},
     "tools"),
    # mlx-lm reads a parameter's name up to whitespace: "first name" would come back as "first".
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "strict": True,
        "parameters": {"type": "object", "properties": {"first name": {"type": "string"}}}}}]},
     "tools"),
    # llguidance holds integers in 64 bits: a wider bound was silently broken.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "minimum": 1e30}}}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {
        "name": "f", "strict": True,
        "parameters": {"type": "object", "properties": {"a": {"type": "integer", "maximum": -2**70}}}}}]},
     "tools"),
], ids=["chat-name", "messages-name", "responses-name", "strict-property", "strict-property-space", "format-int-bound",
        "strict-int-bound"])
def test_tool_names_and_strict_keys_that_markup_cannot_carry_are_a_400(live, client, path, body, param):
    """A tool's name, and a strict tool's property names, are written into the call markup that the
    output is parsed and constrained by: "a>b" made strict calls to an undeclared tool "a". Nor can
    a schema's bounds be wider than the grammar's 64-bit integers."""
    response = _post(live, path, {"model": "tiny", **body})
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"].startswith(param)
    _still_serving(live, client)
