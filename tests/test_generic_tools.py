"""Tools on a model whose chat template cannot render them (Gemma 3): the generic tools prompt,
earlier calls and results written as text, and calls parsed back from the JSON form."""

from __future__ import annotations

import json

import openai
import pytest
from scripted_server import script, scripted_server

from dflash_server import chat
from dflash_server.schemas import ChatCompletionRequest

TOOL = {"type": "function", "function": {"name": "lookup", "description": "Look a word up",
                                          "parameters": {"type": "object", "properties": {"word": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def scripted(gemma3_pair):
    with scripted_server({"plain": gemma3_pair}) as server:
        server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        yield server


def test_the_template_has_no_tools_but_the_prompt_does(scripted):
    served = scripted.state.pool._served["plain"]
    assert not served.markers.has_tools
    request = ChatCompletionRequest.model_validate({"model": "plain", "tools": [TOOL], "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a river?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"word": "river"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "a stream of water"}]})
    text = chat.chat_prompt(request, served.engine.tokenizer, served.markers, {}).text
    assert text.index("Be brief.") < text.index("<tools>") < text.index('"name": "lookup"') < text.index("What is a river?")
    assert '<tool_call>\n{"name": "lookup", "arguments": {"word": "river"}}\n</tool_call>' in text
    assert "<tool_response>\na stream of water\n</tool_response>" in text


@pytest.mark.parametrize("stream", [False, True])
def test_calls_come_back_as_tool_calls(scripted, stream):
    script(scripted, "plain", 'Let me check.\n<tool_call>\n{"name": "lookup", "arguments": {"word": "sea"}}\n</tool_call>')
    out = scripted.client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "sea?"}],
                                                  tools=[TOOL], stream=stream)
    if stream:
        chunks = list(out)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        name = "".join(tc.function.name or "" for tc in calls)
        arguments = "".join(tc.function.arguments or "" for tc in calls)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    else:
        call = out.choices[0].message.tool_calls[0]
        name, arguments, finish = call.function.name, call.function.arguments, [out.choices[0].finish_reason]
    assert name == "lookup" and json.loads(arguments) == {"word": "sea"} and finish == ["tool_calls"]


def test_tool_choice_required_opens_the_generic_call(scripted):
    script(scripted, "plain", '{"name": "lookup", "arguments": {"word": "lake"}}\n</tool_call>')
    out = scripted.client.chat.completions.create(model="plain", messages=[{"role": "user", "content": "lake?"}],
                                                  tools=[TOOL], tool_choice="required")
    assert json.loads(out.choices[0].message.tool_calls[0].function.arguments) == {"word": "lake"}
