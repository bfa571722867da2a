"""Anthropic's Messages API end to end: a real uvicorn server and the official anthropic SDK, its
own types checking every event and message; raw httpx for headers and bad input."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pytest
from anthropic.types import Message, RawMessageStreamEvent
from live_server import LiveServer
from pydantic import TypeAdapter
from scripted_server import script, scripted_server

from dflash_core.prompts import encode_rendered
from dflash_core.settings import ModelSettings, ServerSettings, Settings
from dflash_server import chat
from dflash_server.messages import to_chat
from dflash_server.messages_schemas import MessagesRequest

KEY = "sk-ant-test"
EVENTS = TypeAdapter(RawMessageStreamEvent)
WEATHER = {"name": "get_weather", "description": "Weather for a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
HI = [{"role": "user", "content": "Tell me about the sea."}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK no longer takes sampling arguments


@pytest.fixture(scope="module")
def live(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(api_key=KEY), prefill_chunk=16,
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    with LiveServer(settings) as server:
        server.client = anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)
        yield server


@pytest.fixture(scope="module")
def scripted(qwen3_5_pair):
    with scripted_server({"scripted": qwen3_5_pair}) as server:
        server.client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        yield server


def _raw_events(server, body, key=KEY) -> list[tuple[str, dict]]:
    """(event name, data) pairs of a streamed request, read as bytes off the wire."""
    import json

    events = []
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", json={**body, "stream": True}, timeout=60,
                      headers={"x-api-key": key, "anthropic-version": "2023-06-01",
                               "anthropic-beta": "interleaved-thinking-2025-05-14"}) as response:
        assert response.status_code == 200
        name = None
        for line in response.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def test_create_equals_chat_completions(live):
    chat_client = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0)
    reference = chat_client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "Be brief."}, *HI],
                                                    max_tokens=20, temperature=0)
    out = live.client.messages.create(model="tiny", system="Be brief.", messages=HI, max_tokens=20, **GREEDY)
    Message.model_validate(out.model_dump())
    thinking = "".join(b.thinking for b in out.content if b.type == "thinking")
    text = "".join(b.text for b in out.content if b.type == "text")
    assert text == (reference.choices[0].message.content or "")
    assert thinking == (reference.choices[0].message.model_extra.get("reasoning_content") or "")
    assert out.stop_reason == "max_tokens" and out.usage.output_tokens == 20
    assert out.usage.input_tokens + out.usage.cache_read_input_tokens == reference.usage.prompt_tokens


def test_stream_events_are_anthropic_events_and_build_the_same_message(live):
    whole = live.client.messages.create(model="tiny", messages=HI, max_tokens=24, **GREEDY)
    events = _raw_events(live, {"model": "tiny", "messages": HI, "max_tokens": 24, "temperature": 0})
    for name, data in events:
        assert name == data["type"]
        if name != "ping":
            EVENTS.validate_python(data)
    names = [n for n, _ in events if n != "ping"]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "ping" in [n for n, _ in events]
    starts = [d["index"] for n, d in events if n == "content_block_start"]
    stops = [d["index"] for n, d in events if n == "content_block_stop"]
    assert starts == stops == list(range(len(whole.content)))
    with live.client.messages.stream(model="tiny", messages=HI, max_tokens=24, **GREEDY) as stream:
        final = stream.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in whole.content]
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 24


def test_pings_while_a_long_prompt_prefills(live):
    long = [{"role": "user", "content": "word " * 120}]  # many 16-token prefill chunks
    events = _raw_events(live, {"model": "tiny", "messages": long, "max_tokens": 2})
    assert [n for n, _ in events][:2] == ["message_start", "ping"]


def test_count_tokens_is_the_prompt_length(live):
    counted = live.client.messages.count_tokens(model="tiny", system="Be brief.", messages=HI, tools=[WEATHER])
    out = live.client.messages.create(model="tiny", system="Be brief.", messages=HI, tools=[WEATHER], max_tokens=1)
    assert counted.input_tokens == out.usage.input_tokens + out.usage.cache_read_input_tokens > 10
    # The request's automatic-caching field, as a client reusing its create arguments sends it.
    cached = live.client.messages.count_tokens(model="tiny", system="Be brief.", messages=HI, tools=[WEATHER],
                                               cache_control={"type": "ephemeral"})
    assert cached.input_tokens == counted.input_tokens


def test_models_list_in_both_sdks_shapes(live):
    """One /v1/models for both SDKs: Anthropic's fields beside OpenAI's."""
    anthropic_models = live.client.models.list()
    model = anthropic_models.data[0]
    assert (model.id, model.type, model.display_name) == ("tiny", "model", "tiny") and model.created_at.year >= 2026
    assert model.max_input_tokens == 511 and anthropic_models.has_more is False
    assert live.client.models.retrieve("tiny").max_input_tokens == 511
    openai_models = openai.OpenAI(base_url=live.url + "/v1", api_key=KEY, max_retries=0).models.list()
    assert [(m.id, m.object, m.owned_by) for m in openai_models.data] == [("tiny", "model", "dflash")]


@pytest.mark.parametrize("extra", [{"speed": "standard"}, {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                   {"tools": [{**WEATHER, "eager_input_streaming": True, "allowed_callers": ["direct"]}]}],
                         ids=["speed", "ttl", "tool-fields"])
def test_fields_asking_for_what_the_server_does_are_accepted(live, extra):
    assert live.client.messages.create(model="tiny", messages=HI, max_tokens=2, extra_body={"temperature": 0, **extra})


def test_both_key_headers_authenticate(live):
    body = {"model": "tiny", "messages": HI, "max_tokens": 1}
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(live.url + "/v1/messages", json=body, headers=headers, timeout=30).status_code == 200
    wrong = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": "nope"}, timeout=30)
    assert wrong.status_code == 401
    message = wrong.json()["error"]["message"]
    assert wrong.json() == {"type": "error", "error": {"type": "authentication_error", "message": message}}


def _user(*blocks) -> list[dict]:
    return [{"role": "user", "content": list(blocks)}]


@pytest.mark.parametrize("body, status, says", [
    ({"model": "tiny", "messages": HI}, 400, "max_tokens"),  # max_tokens is required
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "tiny", "messages": "hi", "max_tokens": 5}, 400, "messages"),
    ({"model": "tiny", "messages": _user({"type": "text", "text": "What is it?"}, {"type": "image", "source": {}}),
      "max_tokens": 5}, 400, "image blocks are not supported"),
    ({"model": "tiny", "messages": _user({"type": "tool_result", "tool_use_id": "t", "content": [
        {"type": "document", "source": {}}]}), "max_tokens": 5}, 400, "document blocks are not supported"),
    ({"model": "tiny", "messages": _user({"type": "server_tool_use", "id": "s", "name": "web_search", "input": {}}),
      "max_tokens": 5}, 400, "other block types are not supported"),
    ({"model": "tiny", "messages": _user({"type": "text", "text": "x", "colour": "red"}), "max_tokens": 5}, 400,
     "messages[0].content[0].colour"),
    ({"model": "tiny", "messages": [*HI, {"role": "assistant", "content": "The sea is"}], "max_tokens": 5}, 400,
     "prefill"),
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "tools": [{"type": "web_search_20250305", "name": "w"}]}, 400,
     ""),
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "tool_choice": {"type": "tool"}, "tools": [WEATHER]}, 400,
     "name"),
    ({"model": "nope", "messages": HI, "max_tokens": 5}, 404, "nope"),
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "tool_choice": {"type": "auto", "name": "get_weather"},
      "tools": [WEATHER]}, 400, "a name is for tool_choice of type tool"),
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "cache_control": {"type": "ephemeral", "ttl": "2d"}}, 400, "ttl"),
    ({"model": "tiny", "messages": HI, "max_tokens": 5, "speed": "fast"}, 400, "speed"),
    ({"model": "tiny", "messages": HI, "max_tokens": 50, "tools": [WEATHER], "tool_choice": {"type": "any"},
      "thinking": {"type": "enabled", "budget_tokens": 20}}, 400, "thinking may not be enabled"),
    ({"model": "tiny", "messages": HI, "max_tokens": 50, "thinking": {"type": "enabled"}}, 400,
     "budget_tokens is required when thinking.type is enabled"),
    ({"model": "tiny", "messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {}}]},
        *_user({"type": "tool_result", "tool_use_id": "toolu_2", "content": "sunny"})], "max_tokens": 5}, 400,
     "unexpected tool_use_id 'toolu_2'"),
    ({"model": "tiny", "messages": _user(), "max_tokens": 5}, 400, "messages.0: a message's content must not be empty"),
    ({"model": "tiny", "messages": [*HI, {"role": "assistant", "content": ""}, *HI], "max_tokens": 5}, 400,
     "messages.1: a message's content must not be empty"),
], ids=["no-max-tokens", "unknown-field", "messages-type", "image", "document-in-result", "server-block",
        "block-field", "prefill", "server-tool", "tool-without-name", "model", "choice-name-unused", "ttl", "speed",
        "forced-call-and-thinking", "enabled-thinking-without-budget", "result-for-no-call", "empty-content", "empty-turn"])
def test_bad_input_is_anthropic_shaped(live, body, status, says):
    response = httpx.post(live.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"} and error["error"]["message"]
    assert says in error["error"]["message"] and "valid string" not in error["error"]["message"], error
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert live.client.messages.create(model="tiny", messages=HI, max_tokens=2, **GREEDY).usage.output_tokens == 2


def test_tool_use_round_trip(scripted):
    script(scripted, "scripted", "Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
           "</parameter>\n</function>\n</tool_call>")
    out = scripted.client.messages.create(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                          tools=[WEATHER], max_tokens=200)
    assert [b.type for b in out.content] == ["thinking", "tool_use"]
    assert out.content[0].thinking == "Checking." and out.stop_reason == "tool_use"
    use = out.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    with scripted.client.messages.stream(model="scripted", messages=[{"role": "user", "content": "Weather?"}],
                                         tools=[WEATHER], max_tokens=200) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[1].input == {"city": "Paris"} and streamed.stop_reason == "tool_use"

    script(scripted, "scripted", "</think>\n\nSunny.")
    follow = [{"role": "user", "content": "Weather?"},
              {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in out.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                            "content": [{"type": "text", "text": "sunny"}]}]}]
    answer = scripted.client.messages.create(model="scripted", messages=follow, tools=[WEATHER], max_tokens=50)
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"
    # The blocks handed back as the SDK writes them out with every field (toolset_name, caller,
    # citations: nulls) are the same conversation.
    follow[1]["content"] = [b.model_dump() for b in out.content]
    assert any(v is None for b in follow[1]["content"] for v in b.values())
    again = scripted.client.messages.create(model="scripted", messages=follow, tools=[WEATHER], max_tokens=50)
    assert again.content[0].text == "Sunny." and again.usage.input_tokens == answer.usage.input_tokens


def test_blocks_render_as_one_conversation(scripted):
    served = scripted.state.pool._served["scripted"]
    body = MessagesRequest.model_validate({
        "model": "scripted", "max_tokens": 10, "tools": [WEATHER], "thinking": {"type": "disabled"},
        "system": [{"type": "text", "text": "Use tools.", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": "Weather?"},
                     {"role": "assistant", "content": [{"type": "thinking", "thinking": "Need it.", "signature": ""},
                                                       {"type": "tool_use", "id": "t1", "name": "get_weather",
                                                        "input": {"city": "Oslo"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "snow",
                                                   "is_error": True}, {"type": "text", "text": "Thanks"}]},
                     {"role": "system", "content": "Mid-conversation note."}]})
    prompt = chat.chat_prompt(to_chat(body), served.engine.tokenizer, served.markers, {})
    text = prompt.text
    # (the earlier thinking is the template's to show or not: this one shows only the current turn's)
    assert text.index("Use tools.") < text.index("Weather?") < text.index("Oslo")
    assert "<tool_response>\nError: snow\n</tool_response>" in text
    assert text.index("snow") < text.index("Thanks") < text.index("Mid-conversation note.")
    assert text.endswith("<think>\n\n</think>\n\n")  # thinking disabled


def test_stop_sequences_and_stop_reasons(scripted):
    script(scripted, "scripted", "</think>\n\nOne two STOP three.")
    out = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50, stop_sequences=["STOP"])
    assert out.content[0].text == "One two " and out.stop_reason == "stop_sequence" and out.stop_sequence == "STOP"
    # More than OpenAI's 4: Anthropic's API sets no limit.
    many = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50,
                                           stop_sequences=["a1", "b2", "c3", "d4", "two"])
    assert many.content[0].text == "One " and many.stop_sequence == "two"
    # Each is matched as the output streams, on the event loop: bounded in number and length.
    up_to_the_bound = [f"x{i}" for i in range(255)] + ["two"]
    assert scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50,
                                           stop_sequences=up_to_the_bound).stop_sequence == "two"
    for stops in ([f"x{i}" for i in range(257)], ["y" * 1025]):
        r = httpx.post(scripted.url + "/v1/messages", json={"model": "scripted", "messages": HI, "max_tokens": 5,
                                                            "stop_sequences": stops})
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert "stop_sequences" in r.json()["error"]["message"]
    short = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=3)
    assert short.stop_reason == "max_tokens"
    beta = scripted.client.beta.messages.create(model="scripted", messages=HI, max_tokens=50,
                                                betas=["interleaved-thinking-2025-05-14"])
    assert beta.stop_reason == "end_turn"


def test_the_context_limit_is_told_as_anthropic_tells_it(scripted):
    """A prompt that fills the context is Anthropic's "prompt is too long" (Claude Code compacts its
    conversation on it); an answer cut by the context before max_tokens stops with
    model_context_window_exceeded (a larger max_tokens would not help), not max_tokens."""
    engine = scripted.state.pool._served["scripted"].engine
    script(scripted, "scripted", "</think>\n\n" + "word " * 30)
    prompt = scripted.client.messages.count_tokens(model="scripted", messages=HI).input_tokens
    try:
        engine.max_context = prompt + 4
        cut = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50)
        assert cut.stop_reason == "model_context_window_exceeded" and cut.usage.output_tokens == 4
        engine.max_context = prompt
        with pytest.raises(anthropic.BadRequestError) as refused:
            scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50)
        assert refused.value.body["error"]["message"] == f"prompt is too long: {prompt} tokens > {prompt - 1} maximum"
        # The OpenAI APIs keep OpenAI's words.
        chat_refused = httpx.post(scripted.url + "/v1/chat/completions", timeout=30, json={
            "model": "scripted", "messages": HI, "max_tokens": 5})
        assert chat_refused.json()["error"]["code"] == "context_length_exceeded"
        assert "maximum context length" in chat_refused.json()["error"]["message"]
    finally:
        engine.max_context = None
    assert scripted.client.messages.create(model="scripted", messages=HI, max_tokens=3).stop_reason == "max_tokens"


def test_thinking_display_omitted_sends_thinking_blocks_without_their_text(scripted):
    script(scripted, "scripted", "Weighing it up.\n</think>\n\nCalm.")
    shown = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50)
    omitted = scripted.client.messages.create(model="scripted", messages=HI, max_tokens=50,
                                              thinking={"type": "enabled", "budget_tokens": 40, "display": "omitted"})
    assert [b.type for b in shown.content] == [b.type for b in omitted.content] == ["thinking", "text"]
    assert shown.content[0].thinking == "Weighing it up." and omitted.content[0].thinking == ""
    assert omitted.content[1].text == shown.content[1].text == "Calm."
    events = _raw_events(scripted, {"model": "scripted", "messages": HI, "max_tokens": 50,
                                    "thinking": {"type": "enabled", "budget_tokens": 40, "display": "omitted"}},
                         key="unused")
    deltas = [data["delta"]["type"] for name, data in events if name == "content_block_delta"]
    assert "thinking_delta" not in deltas and "text_delta" in deltas
    # As Anthropic's: a thinking block's last delta is its signature (empty: nothing is signed here).
    names = [(name, data.get("delta", {}).get("type"), data.get("index")) for name, data in events]
    assert names.index(("content_block_delta", "signature_delta", 0)) + 1 == names.index(("content_block_stop", None, 0))


def test_a_failing_generation_ends_the_stream_with_an_error_event(scripted):
    target = scripted.state.pool._served["scripted"].engine.target
    script(scripted, "scripted", "</think>\n\n" + "word " * 200)
    target.fail_after, target.forwards = 3, 0
    try:
        events = _raw_events(scripted, {"model": "scripted", "messages": HI, "max_tokens": 500}, key="unused")
    finally:
        target.fail_after = None
    assert events[-1][0] == "error" and events[-1][1]["error"]["type"] == "api_error"
    assert "planted failure" in events[-1][1]["error"]["message"]
    assert scripted.client.messages.create(model="scripted", messages=HI, max_tokens=2).usage.output_tokens == 2


def test_count_tokens_bad_input_is_anthropic_shaped(live):
    response = httpx.post(live.url + "/v1/messages/count_tokens", json={"model": "tiny", "messages": []},
                          headers={"x-api-key": KEY})
    assert response.status_code == 400 and response.json()["type"] == "error"


SEARCH = {"name": "ToolSearch", "description": "Finds deferred tools.",
          "input_schema": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}
DEFERRED = {**WEATHER, "name": "get_forecast", "description": "A week of weather for a city", "defer_loading": True}


def test_deferred_tools_show_where_a_tool_search_loads_them(scripted):
    """Claude Code's client-side tool search: a deferred tool stays out of the tool list; the
    tool_reference in the search's result shows its definition there, and the model may call it."""
    served = scripted.state.pool._served["scripted"]
    searched = [{"role": "user", "content": "Forecast for Oslo?"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch",
                                                   "input": {"query": "forecast"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": [
                    {"type": "text", "text": "Found:"}, {"type": "tool_reference", "tool_name": "get_forecast"}]}]}]

    def rendered(messages, **extra) -> str:
        body = MessagesRequest.model_validate({"model": "scripted", "max_tokens": 10, "messages": messages,
                                               "tools": [SEARCH, DEFERRED], "thinking": {"type": "disabled"},
                                               **extra})
        return chat.chat_prompt(to_chat(body), served.engine.tokenizer, served.markers, {}).text

    before, after = rendered(searched[:1]), rendered(searched)
    assert "get_forecast" not in before and "Finds deferred tools." in before
    definition = ('<function>{"description": "A week of weather for a city", "name": "get_forecast", "parameters": '
                  '{"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}</function>')
    assert f"Found:\n<functions>\n{definition}\n</functions>" in after
    # The tool list is as before the search: the conversation's start (and its cached prefix) holds.
    assert after.index("get_forecast") > after.index("Forecast for Oslo?")
    assert before[:before.index("Forecast for Oslo?")] == after[:after.index("Forecast for Oslo?")]
    # tool_choice naming a deferred tool lists it (the call is forced: the model needs its schema).
    assert "get_forecast" in rendered(searched[:1], tool_choice={"type": "tool", "name": "get_forecast"})
    # count_tokens counts the same prompt: without the deferred tool's definition.
    counted = [scripted.client.messages.count_tokens(model="scripted", messages=searched[:1], tools=[SEARCH, tool],
                                                     thinking={"type": "disabled"}).input_tokens
               for tool in (DEFERRED, {k: v for k, v in DEFERRED.items() if k != "defer_loading"})]
    assert counted[0] == len(encode_rendered(served.engine.tokenizer, before)) < counted[1]

    script(scripted, "scripted", "</think>\n\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n"
           "</parameter>\n</function>\n</tool_call>")
    out = scripted.client.messages.create(model="scripted", messages=searched, tools=[SEARCH, DEFERRED],
                                          max_tokens=200)
    assert out.stop_reason == "tool_use" and out.content[-1].name == "get_forecast"
    assert out.content[-1].input == {"city": "Oslo"}
    # Its arguments are read with its schema, as a listed tool's are (Qwen's XML values are text).
    typed = {**DEFERRED, "input_schema": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "tags": {"type": "array"}}}}
    script(scripted, "scripted", "</think>\n\n<tool_call>\n<function=get_forecast>\n<parameter=city>\nOslo\n</parameter>\n"
           "<parameter=days>\n5\n</parameter>\n<parameter=tags>\n[\"a\"]\n</parameter>\n</function>\n</tool_call>")
    out = scripted.client.messages.create(model="scripted", messages=searched, tools=[SEARCH, typed], max_tokens=200)
    assert out.content[-1].input == {"city": "Oslo", "days": 5, "tags": ["a"]}

    bad = [({"messages": [*searched[:2], {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                          "content": [{"type": "tool_reference", "tool_name": "nope"}]}]}],
             "tools": [SEARCH, DEFERRED]}, "'nope'"),
           ({"messages": searched[:1], "tools": [{**SEARCH, "strict": True}, {**DEFERRED, "strict": True}]},
            "cannot be strict"),
           ({"messages": searched[:1], "tools": [{**SEARCH, "defer_loading": True}, DEFERRED]}, "must not be deferred")]
    for body, said in bad:
        response = httpx.post(scripted.url + "/v1/messages", json={"model": "scripted", "max_tokens": 5, **body},
                              timeout=30)
        assert response.status_code == 400 and said in response.json()["error"]["message"], response.text


def test_a_thinking_budget_bounds_adaptive_thinking_too():
    """`budget_tokens` bounds the reasoning whenever thinking is on (enabled, or adaptive above
    effort low), and means nothing when it is off."""
    def budget(thinking, **extra):
        body = MessagesRequest.model_validate({"model": "m", "max_tokens": 10, "messages": HI, "thinking": thinking,
                                               **extra})
        return to_chat(body).max_reasoning_tokens

    assert budget({"type": "enabled", "budget_tokens": 6}) == 6
    assert budget({"type": "adaptive", "budget_tokens": 6}) == 6
    assert budget({"type": "adaptive", "budget_tokens": 6}, output_config={"effort": "high"}) == 6
    assert budget({"type": "adaptive", "budget_tokens": 6}, output_config={"effort": "low"}) is None
    assert budget({"type": "disabled", "budget_tokens": 6}) is None


def test_a_tool_s_definition_is_written_out_once_however_often_it_is_referenced():
    """A tool_reference writes its tool's definition where it stands, the first time; later ones
    name the tool (2000 references to a tool with a 100 KB description made a 192 KB request a
    prompt of 200 MB)."""
    from dflash_server.messages import chat_messages

    big = {**DEFERRED, "description": "d" * 100_000}
    refs = [{"type": "tool_reference", "tool_name": "get_forecast"}] * 2000
    body = MessagesRequest.model_validate({"model": "m", "max_tokens": 5, "tools": [SEARCH, big], "messages": [
        {"role": "user", "content": "Forecast?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "ToolSearch", "input": {"query": "f"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": refs}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "ToolSearch", "input": {"query": "f"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2", "content": refs[:1]}]}]})
    text = "".join(m["content"] for m in chat_messages(body))
    assert text.count("d" * 100_000) == 1 and len(text) < 200_000
    assert text.count('<function>{"name": "get_forecast"}</function>') == 2000
