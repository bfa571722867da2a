"""Structured output and logprobs through the three API surfaces, on a random tiny model served with
and without its drafter: the speculative answer must be the target-alone answer, token for token."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest
from live_server import LiveServer
from scripted_server import script, scripted_server

from dflash_core.settings import ModelSettings, Settings

# Compact JSON (llguidance's own schema option) so the random model cannot pad with whitespace.
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                           "days": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["city", "days"], "additionalProperties": False,
          "x-guidance": {"whitespace_flexible": False}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 5}},
    "required": ["city", "days"], "additionalProperties": False}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
MESSAGES = [{"role": "user", "content": "Weather in a city, as JSON."}]


@pytest.fixture(scope="module", params=["qwen3_5", "gemma4"])
def live(request, qwen3_5_pair, gemma4_pair):
    target, drafter = {"qwen3_5": qwen3_5_pair, "gemma4": gemma4_pair}[request.param]
    settings = Settings(models=[
        ModelSettings(name="spec", target=str(target), drafter=str(drafter), max_context=1024),
        ModelSettings(name="alone", target=str(target), drafter=None, max_context=1024)])
    with LiveServer(settings) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        server.family = request.param
        yield server


def _both(live, **kwargs):
    return [live.client.chat.completions.create(model=m, messages=MESSAGES, **kwargs) for m in ("spec", "alone")]


def _lp(choice):
    return [(e.token, round(e.logprob, 4), [(t.token, round(t.logprob, 4)) for t in e.top_logprobs])
            for e in choice.logprobs.content]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 7}], ids=["greedy", "seeded"])
def test_json_schema_is_lossless_and_valid(live, sampling):
    fmt = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    spec, alone = _both(live, response_format=fmt, max_tokens=60, extra_body=NO_THINKING, **sampling)
    assert spec.choices[0].message.content == alone.choices[0].message.content
    assert spec.model_extra["dflash"]["speculative"] and not alone.model_extra["dflash"]["speculative"]
    assert spec.choices[0].finish_reason == "stop"
    answer = json.loads(spec.choices[0].message.content)
    assert answer["city"] in ("Paris", "Oslo", "Lima") and 0 <= answer["days"] <= 9 and set(answer) == {"city", "days"}


def test_json_object_after_reasoning(live):
    """With thinking on, the JSON comes after the reasoning block, which stays free."""
    spec, alone = _both(live, response_format={"type": "json_object"}, max_tokens=120, temperature=0)
    assert spec.choices[0].message.content == alone.choices[0].message.content
    content = spec.choices[0].message.content
    if spec.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:  # the random model may think for all its tokens: then no JSON has begun
        assert content.strip() == "" or content.lstrip().startswith("{")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_strict_tool_calls_match_their_schema(live, choice):
    """Qwen's XML form and Gemma 4's call:NAME{...} form."""
    spec, alone = _both(live, tools=[WEATHER], tool_choice=choice, max_tokens=80, temperature=0)
    assert spec.choices[0].message.tool_calls[0].function.arguments == alone.choices[0].message.tool_calls[0].function.arguments
    arguments = json.loads(spec.choices[0].message.tool_calls[0].function.arguments)
    assert arguments["city"] in ("Paris", "Oslo") and isinstance(arguments["days"], int)


def test_strict_tools_in_auto_mode_are_lossless(live):
    """The model may write text or calls; whatever it calls matches the schema."""
    spec, alone = _both(live, tools=[WEATHER], max_tokens=60, temperature=0.8, seed=3, extra_body=NO_THINKING)
    assert spec.choices[0].message.content == alone.choices[0].message.content
    for call in spec.choices[0].message.tool_calls or []:
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Oslo")


def test_chat_logprobs_equal_target_alone_and_stream_alike(live):
    spec, alone = _both(live, logprobs=True, top_logprobs=3, max_tokens=20, temperature=0)
    assert _lp(spec.choices[0]) == _lp(alone.choices[0])
    entries = spec.choices[0].logprobs.content
    assert len(entries) == spec.usage.completion_tokens == 20
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in entries)
    assert all(abs(e.logprob - e.top_logprobs[0].logprob) < 1e-6 for e in entries)  # greedy: the top token
    chunks = list(live.client.chat.completions.create(model="spec", messages=MESSAGES, logprobs=True, top_logprobs=3,
                                                      max_tokens=20, temperature=0, stream=True))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [(e.token, round(e.logprob, 4)) for e in entries]


def test_completions_logprobs(live):
    out = live.client.completions.create(model="spec", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2)
    alone = live.client.completions.create(model="alone", prompt="Once upon a time", max_tokens=12, temperature=0, logprobs=2)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 12
    assert [round(v, 4) for v in lp.token_logprobs] == [round(v, 4) for v in alone.choices[0].logprobs.token_logprobs]
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_responses_text_format_and_logprobs(live):
    body = dict(input="Weather as JSON.", max_output_tokens=60, temperature=0, reasoning={"effort": "none"},
                text={"format": {"type": "json_schema", "name": "weather", "schema": SCHEMA}},
                include=["message.output_text.logprobs"], top_logprobs=2)
    spec = live.client.responses.create(model="spec", **body)
    alone = live.client.responses.create(model="alone", **body)
    assert spec.output_text == alone.output_text and json.loads(spec.output_text)["city"] in ("Paris", "Oslo", "Lima")
    part = next(i for i in spec.output if i.type == "message").content[0]
    assert len(part.logprobs) == spec.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in part.logprobs)


def test_messages_output_format(live):
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    out = [client.messages.create(model=m, max_tokens=60, messages=MESSAGES, thinking={"type": "disabled"},
                                  output_config={"format": {"type": "json_schema", "schema": SCHEMA}},
                                  extra_body={"temperature": 0}) for m in ("spec", "alone")]
    assert out[0].content[0].text == out[1].content[0].text
    assert json.loads(out[0].content[0].text)["days"] in range(10)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strang"}}}}),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": 3}}}}),
    ("/v1/messages", {"max_tokens": 5, "messages": MESSAGES,
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "strang"}}}}),
], ids=["chat", "responses", "messages"])
def test_a_schema_that_does_not_compile_is_a_400(live, path, body):
    response = httpx.post(live.url + path, json={"model": "spec", **body}, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "strang" in error["message"] or "type" in error["message"]
    assert live.client.completions.create(model="spec", prompt="ok", max_tokens=2, temperature=0).usage.completion_tokens == 2


def test_logprobs_stop_with_the_stop_string(qwen3_5_pair):
    with scripted_server({"s": qwen3_5_pair}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        script(server, "s", "</think>\n\nOne two STOP three four five six seven.")
        for stream in (False, True):
            out = client.chat.completions.create(model="s", messages=MESSAGES, stop="STOP", logprobs=True,
                                                 stream=stream, **({"stream_options": {"include_usage": True}} if stream else {}))
            if stream:
                chunks = list(out)
                entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
                usage = chunks[-1].usage
            else:
                entries, usage = out.choices[0].logprobs.content, out.usage
            assert len(entries) == usage.completion_tokens
            assert "STOP" in "".join(e.token for e in entries) and "three" not in "".join(e.token for e in entries)


def test_a_thinking_budget_ends_the_reasoning(live):
    if live.family != "qwen3_5":
        pytest.skip("Gemma 4 opens its reasoning channel itself: the budget applies to a block the prompt opens")
    end = live.state.pool._served["spec"].engine.tokenizer._tokenizer.get_added_vocab()["</think>"]
    no_end = {str(end): -100}  # left alone, the random model would not close its reasoning

    def tokens(**extra):
        spec, alone = _both(live, max_tokens=30, temperature=0, logprobs=True, logit_bias=no_end, extra_body=extra)
        assert _lp(spec.choices[0]) == _lp(alone.choices[0])
        ids = [e.bytes for e in spec.choices[0].logprobs.content]
        return ids, spec.choices[0].message

    free, _ = tokens()
    assert list(b"</think>") not in free
    bounded, message = tokens(max_reasoning_tokens=6)
    assert bounded[6] == list(b"</think>")  # the end forced right after 6 tokens, despite the bias
    assert message.model_extra["reasoning_content"] and message.content is not None
    client = anthropic.Anthropic(base_url=live.url, api_key="unused", max_retries=0)
    out = [client.messages.create(model=m, max_tokens=30, messages=MESSAGES, extra_body={"temperature": 0},
                                  thinking={"type": "enabled", "budget_tokens": 6}) for m in ("spec", "alone")]
    assert [b.model_dump() for b in out[0].content] == [b.model_dump() for b in out[1].content]


def test_a_format_with_tools_lets_the_model_call_them(qwen3_5_pair):
    """A response format is the final answer's (Codex sends its output schema with all its tools):
    on every API the model can still call a tool, and its answer still matches the format."""
    call = ("</think>\n\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
    answer = '</think>\n\n{"city":"Oslo","days":2}'  # (compact: SCHEMA's whitespace rule)
    loose = {"name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    with scripted_server({"s": qwen3_5_pair}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
        fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
        for strict in (True, False):
            tool = {"type": "function", "function": {**loose, "strict": strict}}
            script(server, "s", call)
            out = client.chat.completions.create(model="s", messages=MESSAGES, tools=[tool], response_format=fmt)
            assert out.choices[0].finish_reason == "tool_calls"
            assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 3}
            script(server, "s", answer)
            out = client.chat.completions.create(model="s", messages=MESSAGES, tools=[tool], response_format=fmt)
            assert json.loads(out.choices[0].message.content) == {"city": "Oslo", "days": 2}
        script(server, "s", call)
        out = client.responses.create(model="s", input="Weather?", tools=[{"type": "function", **loose}],
                                      text={"format": {"type": "json_schema", "name": "w", "schema": SCHEMA}})
        assert [o.type for o in out.output if o.type != "reasoning"] == ["function_call"] and out.status == "completed"
        assert json.loads(out.output[-1].arguments) == {"city": "Paris", "days": 3}
        out = claude.messages.create(model="s", max_tokens=200, messages=[{"role": "user", "content": "Weather?"}],
                                     tools=[{"name": "get_weather", "input_schema": loose["parameters"]}],
                                     extra_body={"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}})
        assert out.stop_reason == "tool_use" and out.content[-1].input == {"city": "Paris", "days": 3}


LOOSE = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}],
                         ids=["required", "named"])
def test_a_forced_call_of_loose_tools_is_a_call(live, choice):
    """tool_choice required or named, tools not strict: the server opens the call, and the grammar
    has the model finish it as a call of a tool the request has, in the form the parser reads (its
    arguments not held to the schema). Before, only the opening was written, and the model could go
    on with anything: a random model's text is no call. Here it names a tool of the request at once;
    a random model may then write one parameter's text for all its tokens (the grammar leaves
    arguments free), so a call cut short by max_tokens shows the call's form as far as it got."""
    spec, alone = _both(live, tools=[LOOSE, CLOCK], tool_choice=choice, max_tokens=60, temperature=0,
                        extra_body=NO_THINKING)
    def said(message):  # (call ids are drawn per response)
        return message.content, [(c.function.name, c.function.arguments) for c in message.tool_calls or ()]

    assert said(spec.choices[0].message) == said(alone.choices[0].message)
    names = ("get_weather", "get_time") if choice == "required" else ("get_time",)
    message = spec.choices[0].message
    if spec.choices[0].finish_reason == "tool_calls":
        assert message.tool_calls[0].function.name in names
        assert isinstance(json.loads(message.tool_calls[0].function.arguments), dict)
    else:
        opened = [("<|tool_call>call:" + n + "{") if live.family == "gemma4" else f"<tool_call>\n<function={n}>\n"
                  for n in names]
        assert any(message.content.startswith(o) for o in opened), message.content
