"""The Responses API end to end: a real uvicorn server and the official openai SDK, its own types
checking every event and object; raw httpx for bad input."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from live_server import LiveServer
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter
from scripted_server import script, scripted_server

from dflash_core.settings import ModelSettings, ServerSettings, Settings
from dflash_server import chat
from dflash_server.responses import ResponseBuilder, to_chat, tool_names
from dflash_server.responses_schemas import ResponsesRequest

KEY = "sk-test"
EVENTS = TypeAdapter(ResponseStreamEvent)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
QWEN_CALL = ("Checking.\n</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "</function>\n</tool_call>")


@pytest.fixture(scope="module")
def live(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(server=ServerSettings(api_key=KEY, stored_responses=4),
                        models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter), max_context=512)])
    with LiveServer(settings) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0)
        yield server


@pytest.fixture(scope="module")
def scripted(qwen3_5_pair):
    with scripted_server({"scripted": qwen3_5_pair}) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


def _events(stream) -> list:
    events = list(stream)
    for event in events:  # the SDK's own union of event types accepts each one
        EVENTS.validate_python(event.model_dump())
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def _check_order(types: list[str]) -> None:
    """created, in_progress, then each item opened and closed before the next, then the end."""
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] in ("response.completed", "response.incomplete")
    open_item = False
    for kind in types[2:-1]:
        if kind == "response.output_item.added":
            assert not open_item
            open_item = True
        elif kind == "response.output_item.done":
            assert open_item
            open_item = False
        else:
            assert open_item, kind
    assert not open_item


def test_create_equals_chat_completions(live):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about rivers."}]
    chat_out = live.client.chat.completions.create(model="tiny", messages=messages, max_tokens=24, temperature=0)
    out = live.client.responses.create(model="tiny", instructions="Be brief.", input="Tell me about rivers.",
                                       max_output_tokens=24, temperature=0)
    Response.model_validate(out.model_dump())
    reasoning = "".join(c.text for item in out.output if item.type == "reasoning" for c in item.content)
    assert out.output_text == (chat_out.choices[0].message.content or "")
    assert reasoning == (chat_out.choices[0].message.model_extra.get("reasoning_content") or "")
    assert out.status == "incomplete" and out.incomplete_details.reason == "max_output_tokens"
    assert out.usage.output_tokens == 24 and out.usage.input_tokens == chat_out.usage.prompt_tokens
    assert out.model_extra["dflash"]["speculative"] is True


def test_stream_events_in_order_and_equal_to_the_whole(live):
    whole = live.client.responses.create(model="tiny", input="Say something.", max_output_tokens=30, temperature=0)
    events = _events(live.client.responses.create(model="tiny", input="Say something.", max_output_tokens=30,
                                                  temperature=0, stream=True))
    _check_order([e.type for e in events])
    final = events[-1].response
    assert [i.type for i in final.output] == [i.type for i in whole.output]
    assert final.output_text == whole.output_text
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens == 30


def test_store_get_delete_and_previous_response_id(live):
    first = live.client.responses.create(model="tiny", input="Name a colour.", max_output_tokens=8, temperature=0)
    assert live.client.responses.retrieve(first.id).output_text == first.output_text
    second = live.client.responses.create(model="tiny", input="And another?", previous_response_id=first.id,
                                          max_output_tokens=8, temperature=0)
    # The earlier turn is part of the prompt: longer than both inputs, and its prefix was cached.
    alone = live.client.responses.create(model="tiny", input="And another?", max_output_tokens=8, temperature=0,
                                         store=False)
    assert second.usage.input_tokens > alone.usage.input_tokens + 3
    assert second.usage.input_tokens_details.cached_tokens > 0
    assert second.previous_response_id == first.id
    live.client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(alone.id)  # store=False: never kept
    with pytest.raises(openai.BadRequestError) as e:
        live.client.responses.create(model="tiny", input="x", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id"


def test_the_store_is_bounded(live):
    ids = [live.client.responses.create(model="tiny", input=f"n{i}", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):
        live.client.responses.retrieve(ids[0])  # capacity 4: the oldest went first
    assert live.client.responses.retrieve(ids[-1]).id == ids[-1]


def test_max_output_tokens_past_the_context_ends_with_incomplete(live):
    out = live.client.responses.create(model="tiny", input="Go on.", max_output_tokens=100_000, temperature=0)
    assert out.status in ("incomplete", "completed")
    if out.status == "incomplete":
        assert out.usage.input_tokens + out.usage.output_tokens == 512


def test_function_call_round_trip(scripted):
    script(scripted, "scripted", QWEN_CALL)
    out = scripted.client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER])
    call = next(item for item in out.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"} and call.call_id
    assert [item.type for item in out.output] == ["reasoning", "function_call"]
    assert out.output[0].content[0].text == "Checking."

    events = _events(scripted.client.responses.create(model="scripted", input="Weather in Paris?", tools=[WEATHER],
                                                      stream=True))
    types = [e.type for e in events]
    _check_order(types)
    assert "response.reasoning_text.delta" in types and "response.function_call_arguments.done" in types
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris"}

    script(scripted, "scripted", "</think>\n\nIt is sunny in Paris.")
    follow = [{"type": "message", "role": "user", "content": "Weather in Paris?"},
              *[item.model_dump(exclude_none=True) for item in out.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    answer = scripted.client.responses.create(model="scripted", input=follow, tools=[WEATHER])
    assert answer.output_text == "It is sunny in Paris." and answer.status == "completed"
    # The items handed back as the SDK writes them out with every field (nulls included: phase,
    # caller, async, ...) are the same conversation.
    follow[1:-1] = [item.model_dump(by_alias=True) for item in out.output]
    assert any(v is None for item in follow[1:-1] for v in item.values())
    again = scripted.client.responses.create(model="scripted", input=follow, tools=[WEATHER])
    assert again.output_text == answer.output_text and again.usage.input_tokens == answer.usage.input_tokens


def test_an_item_cut_by_max_output_tokens_is_incomplete(scripted):
    script(scripted, "scripted", "</think>\n\n" + "word " * 40)
    out = scripted.client.responses.create(model="scripted", input="go", max_output_tokens=8)
    assert out.status == "incomplete" and out.output[-1].status == "incomplete"
    events = _events(scripted.client.responses.create(model="scripted", input="go", max_output_tokens=8, stream=True))
    done = [e for e in events if e.type == "response.output_item.done"]
    assert done[-1].item.status == "incomplete" and events[-1].type == "response.incomplete"
    whole = scripted.client.responses.create(model="scripted", input="go", max_output_tokens=300)
    assert whole.status == "completed" and {item.status for item in whole.output} == {"completed"}


def test_items_render_as_one_conversation(qwen3_5_pair, scripted):
    """What the model sees after a call and its result: the call in the assistant turn with the
    reasoning handed back, the result as a tool response."""
    served = scripted.state.pool._served["scripted"]
    body = ResponsesRequest.model_validate({
        "model": "scripted", "instructions": "Use tools.", "tools": [WEATHER],
        "input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "Need it."}]},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "snow"}]})
    request, _ = to_chat(body, [], tool_names(body.tools))
    prompt = chat.chat_prompt(request, served.engine.tokenizer, served.markers, {})
    assert prompt.text.index("Use tools.") < prompt.text.index("Weather?") < prompt.text.index("Need it.")
    assert "<function=get_weather>\n<parameter=city>\nOslo" in prompt.text
    assert "<tool_response>\nsnow\n</tool_response>" in prompt.text


def test_namespace_and_custom_tools(scripted):
    tools = [{"type": "namespace", "name": "agents", "description": "Sub-agents.",
              "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}]},
             {"type": "custom", "name": "apply_patch", "description": "Apply a patch.",
              "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]
    script(scripted, "scripted", "</think>\n\n<tool_call>\n<function=agents__spawn>\n</function>\n</tool_call>")
    # (A namespace may come without a description; the response's list of tools has one.)
    undescribed = {"type": "namespace", "name": "more", "tools": [{"type": "function", "name": "wait"}]}
    out = scripted.client.responses.create(model="scripted", input="go", tools=[*tools, undescribed],
                                           prompt_cache_key="thread-1")
    call = out.output[0]
    assert call.type == "function_call" and call.name == "spawn" and call.namespace == "agents"
    assert Response.model_validate(out.model_dump()).prompt_cache_key == "thread-1"  # the SDK's type, strictly
    script(scripted, "scripted", "</think>\n\n<tool_call>\n<function=apply_patch>\n<parameter=input>\n*** Begin Patch\n"
           "</parameter>\n</function>\n</tool_call>")
    events = _events(scripted.client.responses.create(model="scripted", input="go", tools=tools, stream=True))
    final = events[-1].response
    assert final.output[0].type == "custom_tool_call" and final.output[0].input == "*** Begin Patch"
    assert "response.custom_tool_call_input.done" in [e.type for e in events]


def test_a_namespace_tool_is_called_on_gemma_4(gemma4_pair):
    """Gemma 4's call form reads call:NAME of word characters and -: a namespace's tools are shown
    as namespace__name, so that the call comes back as a call (with namespace.name it was text)."""
    tools = [{"type": "namespace", "name": "agents", "description": "Sub-agents.",
              "tools": [{"type": "function", "name": "spawn", "parameters": {"type": "object", "properties": {}}}]}]
    with scripted_server({"scripted": gemma4_pair}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        script(server, "scripted", '<|tool_call>call:agents__spawn{task:<|"|>look<|"|>}<tool_call|>')
        out = client.responses.create(model="scripted", input="go", tools=tools)
    call = out.output[-1]
    assert call.type == "function_call" and call.name == "spawn" and call.namespace == "agents", out.output
    assert json.loads(call.arguments) == {"task": "look"}


def test_builder_closes_each_item_before_the_next():
    builder = ResponseBuilder(tool_names(None))
    from dflash_server.output_text import Delta, ToolCallDelta
    types = [e["type"] for d in (Delta(reasoning="a"), Delta(content="b"), Delta(tool_call=ToolCallDelta(0, "c1", "f")),
                                 Delta(tool_call=ToolCallDelta(0, arguments="{}")), Delta(content="c"))
             for e in builder.feed(d)] + [e["type"] for e in builder.close()]
    assert [i["type"] for i in builder.output] == ["reasoning", "message", "function_call", "message"]
    assert types.count("response.output_item.added") == types.count("response.output_item.done") == 4


@pytest.mark.parametrize("body, param, says", [
    ({"model": "tiny", "input": 3}, "input", ""),
    ({"model": "tiny", "input": "x", "frobnicate": 1}, "frobnicate", ""),
    ({"model": "tiny", "input": "x", "tools": [{"type": "web_search"}]}, None, ""),
    ({"model": "tiny", "input": "x", "tools": [{"name": "f", "type": {}}]}, "tools", ""),  # was a 500 (a fuzzer's find)
    ({"model": "tiny", "input": "x", "include": ["nothing.we.know"]}, "include", ""),
    ({"model": "tiny", "input": "x", "background": True}, "background", ""),
    ({"model": "tiny", "input": "x", "truncation": "auto"}, "truncation", ""),
    ({"model": "tiny", "input": [{"type": "input_image", "image_url": "x"}]}, None, ""),
    ({"model": "tiny", "input": []}, "input", ""),
    ({"model": "nope", "input": "x"}, "model", ""),
    # Each names what is wrong with the item, not why it is not a string (a union's first choice).
    ({"model": "tiny", "input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "item types are not supported"),
    ({"model": "tiny", "input": [{"role": "user", "content": [
        {"type": "input_text", "text": "What is this?"}, {"type": "input_image", "image_url": "data:"}]}]},
     "input[0].content", "input_image parts are not supported"),
    ({"model": "tiny", "input": [{"type": "function_call_output", "call_id": "c", "output": [
        {"type": "input_file", "file_id": "f"}]}]}, "input[0].output", "input_file parts are not supported"),
    ({"model": "tiny", "input": [{"role": "user", "content": "hi", "colour": "red"}]}, "input[0].colour", "unsupported"),
    ({"model": "tiny", "input": [{"role": "tool", "content": "hi"}]}, "input[0].role", "'developer'"),
    ({"model": "tiny", "input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}",
                                  "caller": {"type": "program", "caller_id": "p"}}]}, "input[0].caller", "'direct'"),
    ({"model": "tiny", "input": "x", "tools": [{"type": "custom", "name": "f", "colour": "red"}]}, "tools[0].colour",
     "unsupported"),
    # OpenAI's metadata limits, which also bound what the response store keeps per response.
    ({"model": "tiny", "input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", ""),
    ({"model": "tiny", "input": "x", "metadata": {"k": "v" * 513}}, "metadata", ""),
    ({"model": "tiny", "input": [{"role": "user", "content": "hi"}, {"type": "function_call", "call_id": "c1",
                                  "name": "f", "arguments": "{}"},
                                 {"type": "function_call_output", "call_id": "c2", "output": "sunny"}]},
     "input", "no tool call found for the output with call_id 'c2'"),
], ids=["input-type", "unknown-field", "tool-type", "tool-type-not-a-string", "include", "background", "truncation",
        "image", "empty", "model", "item-reference", "image-part", "file-output", "item-field", "tool-role",
        "program-caller", "custom-tool-field", "metadata-pairs", "metadata-value", "output-for-no-call"])
def test_bad_input_is_a_400_in_openai_shape(live, body, param, says):
    response = httpx.post(live.url + "/v1/responses", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == (404 if body["model"] == "nope" else 400), response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param or error["param"].startswith(param)
    if says:
        assert says in error["message"] and "valid string" not in error["message"], error["message"]
    assert live.client.responses.create(model="tiny", input="ok", max_output_tokens=2, temperature=0).usage.output_tokens == 2


def test_unknown_response_id_is_a_404(live):
    response = httpx.get(live.url + "/v1/responses/resp_nope", headers={"Authorization": f"Bearer {KEY}"})
    assert response.status_code == 404 and response.json()["error"]["type"] == "not_found_error"


def test_what_the_responses_api_has_and_this_server_does_not_is_named(live):
    stored = live.client.responses.create(model="tiny", input="hi", max_output_tokens=2, temperature=0)
    auth = {"Authorization": f"Bearer {KEY}"}
    replay = httpx.get(live.url + f"/v1/responses/{stored.id}?stream=true", headers=auth)
    assert replay.status_code == 400 and replay.json()["error"]["param"] == "stream"
    for method, path in (("POST", "/v1/responses/compact"), ("POST", "/v1/responses/input_tokens"),
                         ("POST", f"/v1/responses/{stored.id}/cancel"), ("GET", f"/v1/responses/{stored.id}/input_items")):
        refused = httpx.request(method, live.url + path, headers=auth, json={"model": "tiny", "input": "hi"})
        assert refused.status_code == 404 and "is not offered by this server" in refused.json()["error"]["message"]
    assert live.client.responses.retrieve(stored.id).id == stored.id


def test_a_failing_generation_ends_the_stream_with_response_failed(scripted):
    target = scripted.state.pool._served["scripted"].engine.target
    script(scripted, "scripted", "</think>\n\n" + "word " * 200)
    target.fail_after, target.forwards = 3, 0
    try:
        events = list(scripted.client.responses.create(model="scripted", input="go", stream=True))
    finally:
        target.fail_after = None
    assert events[-1].type == "response.failed" and "planted failure" in events[-1].response.error.message
    assert events[-1].response.output[-1].status == "incomplete"  # the message it was writing
    EVENTS.validate_python(events[-1].model_dump())
    assert scripted.client.responses.create(model="scripted", input="go", max_output_tokens=2).usage.output_tokens == 2


def test_the_store_is_bounded_in_size_as_well_as_in_count():
    """A conversation may carry text the prompt leaves out (earlier reasoning), which no context
    limit bounds: the store keeps at most max_bytes of JSON, least recently used out."""
    from dflash_server.errors import APIError
    from dflash_server.response_store import ResponseStore

    store = ResponseStore(capacity=100, max_bytes=10_000)
    big = [{"role": "assistant", "content": "", "reasoning_content": "r" * 3000}]
    for i in range(5):
        store.put({"id": f"resp_{i}", "output": []}, big)
    assert 9_000 < store.bytes <= 10_000  # three of about 3 KB each
    store.get("resp_2")  # used: the least recently used go first
    store.put({"id": "resp_5", "output": []}, big)
    with pytest.raises(APIError):
        store.get("resp_3")
    assert store.get("resp_2")["conversation"] is big
    store.put({"id": "huge", "output": []}, [{"role": "user", "content": "x" * 20_000}])  # over the whole budget
    with pytest.raises(APIError):
        store.get("huge")
    before = store.bytes
    store.delete("resp_5")
    assert store.bytes < before and store.bytes == sum(e["bytes"] for e in store._items.values())
