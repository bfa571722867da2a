"""Gemma 4 tool calls are read as mlx-lm reads them (`mlx_lm.tool_parsers.gemma4`), by a
conversion of the arguments that is linear in their strings (mlx-lm's is quadratic)."""

from __future__ import annotations

import json
import time

import mlx_lm.tool_parsers.gemma4 as mlx_lm_gemma4
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_server.tool_calls import (
    GEMMA4,
    GEMMA4_PATTERN_SECONDS,
    GEMMA4_STRING,
    gemma4_arguments_json,
    parse_gemma4_calls,
    parse_tool_body,
)

# What a model may write inside and around strings: the delimiter's pieces, braces, separators,
# quotes, escapes, newlines and non-ASCII (no NUL: mlx-lm's placeholders are made of it).
TEXT = st.lists(st.sampled_from(list('ab_9 {}[],:<|">\\\n\'é中-') + [GEMMA4_STRING]), max_size=12).map("".join)
KEYS = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True) | st.sampled_from(["é", "中文", "k-1", "1"])


def _value(depth: int):
    scalar = (st.builds(lambda s: GEMMA4_STRING + s.replace(GEMMA4_STRING, "") + GEMMA4_STRING, TEXT)
              | st.sampled_from(["1", "-2.5", "true", "false", "null", "1e3", "x"]))
    if depth == 0:
        return scalar
    inner = _value(depth - 1)
    return scalar | _object(inner) | st.lists(inner, max_size=3).map(lambda v: "[" + ",".join(v) + "]")


def _object(values):
    return st.lists(st.tuples(KEYS, values), max_size=4).map(lambda kv: "{" + ",".join(f"{k}:{v}" for k, v in kv) + "}")


CALL = st.tuples(st.from_regex(r"[a-z_][a-z0-9_-]{0,8}", fullmatch=True), _object(_value(2))).map(
    lambda c: f"call:{c[0]}{c[1]}")
# Whole regions: calls, text between them, and damage (a cut, an inserted piece).
REGION = st.tuples(st.lists(CALL, min_size=0, max_size=3), TEXT, st.integers(0, 400), TEXT).map(
    lambda r: (r[1].join(r[0]))[: r[2]] + r[3] + (r[1].join(r[0]))[r[2]:])


def _outcome(parse, text):
    try:
        return ("ok", json.dumps(parse(text), sort_keys=True))
    except Exception:  # noqa: BLE001 - any failure is "malformed": the region stays content
        return ("error",)


def _mlx_lm_calls(text):
    parsed = mlx_lm_gemma4.parse_tool_call(text)
    return parsed if isinstance(parsed, list) else [parsed]


@settings(max_examples=600, derandomize=True, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(REGION)
def test_gemma4_calls_parse_as_mlx_lm_parses_them(region):
    assert _outcome(parse_gemma4_calls, region) == _outcome(_mlx_lm_calls, region)


@settings(max_examples=600, derandomize=True, deadline=None)
@given(_object(_value(2)) | TEXT)
def test_gemma4_arguments_convert_as_mlx_lm_converts_them(text):
    try:
        ours = gemma4_arguments_json(text)
    except ValueError:  # an unclosed string: mlx-lm's conversion leaves a delimiter in its JSON
        assert GEMMA4_STRING in mlx_lm_gemma4._gemma4_args_to_json(text)
        return
    assert ours == mlx_lm_gemma4._gemma4_args_to_json(text)


def test_many_strings_in_one_call_convert_in_linear_time():
    """20,000 string values took mlx-lm's conversion 4.3 s on this machine; the work now grows with
    the text (checked as a ratio of two sizes, not a wall-time bound)."""
    def seconds(n):
        body = "call:f{" + ",".join(f'a{i}:{GEMMA4_STRING}v{GEMMA4_STRING}' for i in range(n)) + "}"
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            calls = parse_tool_body(GEMMA4, body)
            best = min(best, time.perf_counter() - start)
        assert len(json.loads(calls[0].arguments)) == n
        return best

    small, large = seconds(2000), seconds(16000)
    assert large < 8 * small * 2.5  # 8x the strings: linear is ~8x, quadratic ~64x


@pytest.mark.timed
def test_a_region_of_unclosed_calls_is_given_up_in_bounded_time():
    """mlx-lm's call pattern is quadratic in unclosed calls (2000 took 2 s): a region is given up
    as no call (its text stays content) once the pattern has run GEMMA4_PATTERN_SECONDS."""
    start = time.perf_counter()
    with pytest.raises(ValueError):
        parse_gemma4_calls("call:f{" * 4000)
    assert time.perf_counter() - start < GEMMA4_PATTERN_SECONDS + 1.0


def test_gemma4_calls_of_tools_named_with_dots_and_colons_are_read():
    """mlx-lm's call pattern reads call:NAME of \\w and - only; tool names may hold . and : (as
    `web.search`), so the request's names are read as such: outside strings only, and only names
    of the request's tools."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {}}} for n in ("web.search", "fs:read", "plain")]
    body = 'call:web.search{q:<|"|>see call:web.search{x} and call:fs:read{<|"|>}call:fs:read{path:<|"|>a<|"|>}'
    calls = parse_tool_body(GEMMA4, body, tools)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("web.search", {"q": "see call:web.search{x} and call:fs:read{"}), ("fs:read", {"path": "a"})]
    assert parse_tool_body(GEMMA4, "call:plain{n:1}", tools)[0].name == "plain"
    with pytest.raises(ValueError):  # not a tool of the request: mlx-lm's reading, no call
        parse_tool_body(GEMMA4, "call:other.tool{n:1}", tools)
    with pytest.raises(ValueError):
        parse_tool_body(GEMMA4, "call:web.search{n:1}", None)



def test_a_gemma4_call_of_a_dotted_tool_comes_back_as_a_call(gemma4_pair):
    import openai
    from scripted_server import script, scripted_server

    tools = [{"type": "function", "function": {"name": "web.search", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}]
    with scripted_server({"scripted": gemma4_pair}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        script(server, "scripted", '<|tool_call>call:web.search{q:<|"|>tides<|"|>}<tool_call|>')
        out = client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "go"}],
                                             tools=tools)
    call = out.choices[0].message.tool_calls[0]
    assert out.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "web.search" and json.loads(call.function.arguments) == {"q": "tides"}
