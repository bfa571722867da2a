"""Tests for server/output_text.py and server/tool_calls.py (pure text, no model)."""

from __future__ import annotations

import json
import random
import re
from typing import Any, Iterator, Optional

import pytest

from dflash_server.output_text import (
    GEMMA4_MARKERS,
    PLAIN,
    QWEN_JSON_MARKERS,
    QWEN_XML_MARKERS,
    ChatOutputParser,
    Delta,
    Markers,
    StopMatcher,
    ToolCallDelta,
    collect_deltas,
    delta_to_openai,
    markers_for_tokenizer,
    parse_chat_output,
    prompt_starts_in_reasoning,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "zip": {"type": "string"},
                    "days": {"type": "integer"},
                    "lat": {"type": "number"},
                    "metric": {"type": "boolean"},
                    "options": {"type": "object"},
                    "tags": {"type": "array"},
                },
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
    },
]


# ------------------------------------------------------------------------- helpers


def _token_units(text: str) -> list[str]:
    """Rough token-like pieces: tags, words, whitespace runs, single symbols."""
    units = re.findall(r"<[^<>\s]*>|\w+|\s+|[^\w\s]", text)
    assert "".join(units) == text
    return units


def chunkings(text: str, seed: int = 0) -> Iterator[list[str]]:
    """Several ways to cut `text` into increments, as the engine might deliver them."""
    rng = random.Random(seed)
    yield [text]
    yield list(text)  # one character at a time
    yield [text[i : i + 48] for i in range(0, len(text), 48)]
    for _ in range(4):  # random character cuts
        chunks, i = [], 0
        while i < len(text):
            n = rng.randint(1, 12)
            chunks.append(text[i : i + n])
            i += n
        yield chunks
    units = _token_units(text)
    for _ in range(4):  # 1..16 token-like units per commit, as speculative decoding commits
        chunks, i = [], 0
        while i < len(units):
            n = rng.randint(1, 16)
            chunks.append("".join(units[i : i + n]))
            i += n
        yield chunks


def run_stream(chunks: list[str], **kwargs: Any) -> tuple[Any, ...]:
    parser = ChatOutputParser(**kwargs)
    deltas: list[Delta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    assert parser.finish() == [] and parser.feed("more") == []
    content, reasoning, calls = collect_deltas(deltas)
    _check_tool_deltas(deltas)
    parsed_calls = [(name, json.loads(args)) for name, args in calls]
    return content, reasoning, parsed_calls, parser.stop_matched, parser.finish_reason("length")


def _check_tool_deltas(deltas: list[Delta]) -> None:
    """Each call: a header (id, name, empty arguments), then its arguments; indices 0, 1, ..."""
    tool = [d.tool_call for d in deltas if d.tool_call is not None]
    assert len(tool) % 2 == 0
    for i in range(0, len(tool), 2):
        head, args = tool[i], tool[i + 1]
        assert head.index == args.index == i // 2
        assert re.fullmatch(r"call_[0-9a-f]{24}", head.id or "")
        assert head.name and head.arguments == ""
        assert args.id is None and args.name is None
        json.loads(args.arguments)
    for d in deltas:
        assert sum(x is not None for x in (d.content, d.reasoning, d.tool_call)) == 1


def check_all_chunkings(text: str, seed: int = 0, **kwargs: Any) -> tuple[Any, ...]:
    """Same result for every chunking and for the non-streaming helper; returns it."""
    whole = parse_chat_output(text, **kwargs)
    expected = (
        whole.content or "",
        whole.reasoning_content or "",
        [(c.name, json.loads(c.arguments)) for c in whole.tool_calls],
        whole.stop_matched,
    )
    results = set()
    for chunks in chunkings(text, seed):
        got = run_stream(chunks, **kwargs)
        assert got[:4] == expected, chunks
        results.add(repr(got))
    assert len(results) == 1
    return run_stream([text], **kwargs)


def stop_stream(chunks: list[str], stop: Any) -> tuple[str, Optional[str]]:
    matcher = StopMatcher(stop)
    out = "".join(matcher.feed(c) for c in chunks) + matcher.finish()
    return out, matcher.matched


# ----------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    "text, stop, expected, matched",
    [
        ("Hello world, bye", ["world"], "Hello ", "world"),
        ("STOP right there", ["STOP"], "", "STOP"),  # at the very start
        ("the end.STOP", ["STOP"], "the end.", "STOP"),  # at the very end
        ("no stop here", ["zzz"], "no stop here", None),
        ("ends with a partial ST", ["STOP"], "ends with a partial ST", None),
        ("a bc d cb", ["cb", "bc"], "a ", "bc"),  # earliest wins, not list order
        ("xx <end> yy ###", ["###", "<end>", "\n\n"], "xx ", "<end>"),
        ("abcd", ["abcd", "bc"], "", "abcd"),  # an earlier, longer one wins
        ("aab", ["ab"], "a", "ab"),  # self-overlapping prefix
        ("keep all", None, "keep all", None),
        ("keep all", [""], "keep all", None),  # empty stop strings are ignored
        ("one, two", "two", "one, ", "two"),  # a single string
        ("héllo wörld 世界", ["wö"], "héllo ", "wö"),
    ],
)
def test_stop_strings_any_chunking(text, stop, expected, matched):
    for chunks in chunkings(text):
        assert stop_stream(chunks, stop) == (expected, matched), chunks


def test_stop_holds_back_only_possible_prefixes():
    m = StopMatcher(["</answer>"])
    assert m.feed("Result: 42 </ans") == "Result: 42 "  # "</ans" may become the stop string
    assert m.feed("wer") == ""
    assert m.feed("x") == "</answerx"  # disambiguated: it was not
    assert m.feed("</answer> tail") == "" and m.matched == "</answer>"
    assert m.feed("more") == "" and m.finish() == ""


def test_stop_flushes_at_finish():
    m = StopMatcher(["STOP"])
    assert m.feed("all ST") == "all "
    assert m.finish() == "ST" and m.matched is None


def test_stop_applies_to_reasoning_and_ends_output():
    parser = ChatOutputParser(QWEN_XML_MARKERS, stop=["Wait"], starts_in_reasoning=True)
    deltas = parser.feed("Hmm. Wa") + parser.feed("it, no.</think>Answer")
    assert collect_deltas(deltas) == ("", "Hmm. ", [])  # not touching a marker: kept
    assert parser.stop_matched == "Wait" and parser.finish_reason("length") == "stop"
    assert parser.feed("x") == [] and parser.finish() == []


def test_stop_straddling_in_chat_content():
    text = "<think>\nok\n</think>\n\nThe answer is 4.\nUser: next"
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, stop=["\nUser:", "Observation"])
    assert got == ("The answer is 4.", "ok", [], "\nUser:", "stop")


# -------------------------------------------------------------------------- reasoning


def test_qwen_prompt_opened_think():
    text = "The user wants 2+2.\nThat is 4.\n</think>\n\nIt is **4**.\n"
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, starts_in_reasoning=True)
    assert got == ("It is **4**.\n", "The user wants 2+2.\nThat is 4.", [], None, "length")


def test_qwen_model_opens_think():
    text = "<think>\nLet me see.\n</think>\n\nHello!"
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS)
    assert got[:2] == ("Hello!", "Let me see.")


def test_qwen_thinking_disabled_is_plain_content():
    # enable_thinking=false: the prompt holds "<think>\n\n</think>\n\n"; output is content.
    text = "Hello there.\n\nHow can I help?"
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, starts_in_reasoning=False)
    assert got[:2] == (text, "")
    assert parse_chat_output(text, QWEN_XML_MARKERS).reasoning_content is None


def test_gemma4_thought_channel():
    text = "<|channel>thought\nThe user greets me.\n<channel|>Hi! How are you?"
    got = check_all_chunkings(text, markers=GEMMA4_MARKERS)
    assert got[:2] == ("Hi! How are you?", "The user greets me.")


def test_gemma4_empty_thought_and_no_thought():
    assert check_all_chunkings("<|channel>thought\n<channel|>Hi", markers=GEMMA4_MARKERS)[:2] == (
        "Hi",
        "",
    )
    assert check_all_chunkings("Just text.", markers=GEMMA4_MARKERS)[:2] == ("Just text.", "")


def test_markers_split_across_increments():
    parser = ChatOutputParser(QWEN_XML_MARKERS, starts_in_reasoning=True)
    deltas = []
    for piece in ["abc </", "th", "ink", ">\n", "\nde", "f"]:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    assert collect_deltas(deltas) == ("def", "abc", [])
    parser = ChatOutputParser(GEMMA4_MARKERS)
    deltas = []
    for piece in ["<|chan", "nel>tho", "ught\nx <chan", "nel|", ">y"]:
        deltas += parser.feed(piece)
    deltas += parser.finish()
    assert collect_deltas(deltas) == ("y", "x", [])


def test_reasoning_streams_before_it_closes():
    parser = ChatOutputParser(QWEN_XML_MARKERS, starts_in_reasoning=True)
    assert parser.feed("step one") == [Delta(reasoning="step one")]
    assert parser.feed(", step two\n") == [Delta(reasoning=", step two")]
    assert parser.feed("</thi") == []
    assert parser.feed("nk>\n\nDone") == [Delta(content="Done")]


def test_unclosed_reasoning_stays_reasoning():
    got = check_all_chunkings("still thinking about it", markers=QWEN_XML_MARKERS,
                              starts_in_reasoning=True)
    assert got[:2] == ("", "still thinking about it")


def test_think_tag_inside_answer_is_text():
    text = "Use <think> tags like <think>this</think>."
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS)
    assert got[:2] == (text, "")


def test_reasoning_markers_ignored_for_plain_models():
    text = "<think>x</think>y"
    assert check_all_chunkings(text, markers=PLAIN)[:2] == (text, "")
    # No end marker known: starting "in reasoning" cannot apply.
    assert parse_chat_output("abc", PLAIN, starts_in_reasoning=True).content == "abc"


# ------------------------------------------------------------------------- tool calls

QWEN_XML_CALL = (
    "<tool_call>\n<function=get_weather>\n"
    "<parameter=city>\nSan Francisco\n</parameter>\n"
    "<parameter=zip>\n01234\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n"
    "<parameter=lat>\n37.7\n</parameter>\n"
    "<parameter=metric>\ntrue\n</parameter>\n"
    '<parameter=options>\n{"wind": true, "hours": [1, 2]}\n</parameter>\n'
    '<parameter=tags>\n["a", "b"]\n</parameter>\n'
    "<parameter=note>\nmulti\nline\n</parameter>\n"
    "</function>\n</tool_call>"
)
QWEN_XML_ARGS = {
    "city": "San Francisco",
    "zip": "01234",  # string in the schema: stays a string
    "days": 3,
    "lat": 37.7,
    "metric": True,
    "options": {"wind": True, "hours": [1, 2]},
    "tags": ["a", "b"],
    "note": "multi\nline",  # not in the schema: raw text
}


def test_qwen_xml_call_with_schema_types():
    text = "<think>\nNeed weather.\n</think>\n\n" + QWEN_XML_CALL
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS, tool_choice="auto")
    assert got == ("", "Need weather.", [("get_weather", QWEN_XML_ARGS)], None, "tool_calls")
    parsed = parse_chat_output(text, QWEN_XML_MARKERS, TOOLS, "auto")
    assert parsed.content is None  # OpenAI sends null content with tool calls


def test_qwen_json_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    got = check_all_chunkings(text, markers=QWEN_JSON_MARKERS, tools=TOOLS)
    assert got[2:] == ([("get_weather", {"city": "Paris", "days": 2})], None, "tool_calls")
    # A Qwen model answering in the other form is still understood.
    assert check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS)[2] == got[2]


def test_gemma4_call():
    text = (
        "<|channel>thought\nCall the tool.<channel|>"
        '<|tool_call>call:get_weather{city:<|"|>Paris, {France}<|"|>,days:3,metric:false,'
        'options:{wind:true,levels:[1,2.5]}}<tool_call|>'
    )
    got = check_all_chunkings(text, markers=GEMMA4_MARKERS, tools=TOOLS)
    args = {"city": "Paris, {France}", "days": 3, "metric": False,
            "options": {"wind": True, "levels": [1, 2.5]}}
    assert got == ("", "Call the tool.", [("get_weather", args)], None, "tool_calls")


def test_two_calls_and_text_before():
    text = (
        "Let me check both.\n\n"
        '<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS, tool_choice="required")
    assert got == (
        "Let me check both.",
        "",
        [("get_weather", {"city": "Oslo"}), ("get_time", {})],
        None,
        "tool_calls",
    )


def test_gemma4_two_calls():
    text = (
        "Sure.<|tool_call>call:get_time{}<tool_call|>"
        '<|tool_call>call:get_weather{city:<|"|>Rome<|"|>}<tool_call|>'
    )
    got = check_all_chunkings(text, markers=GEMMA4_MARKERS, tools=TOOLS)
    assert got[:3] == ("Sure.", "", [("get_time", {}), ("get_weather", {"city": "Rome"})])


def test_tool_call_stream_shape():
    parser = ChatOutputParser(QWEN_XML_MARKERS, tools=TOOLS)
    assert parser.feed("Checking.\n\n<tool_") == [Delta(content="Checking.")]
    assert parser.feed('call>\n{"name": "get_time", "arguments": {}}\n</tool') == []
    head, args = parser.feed("_call>")
    assert head.tool_call.name == "get_time" and head.tool_call.arguments == ""
    assert args.tool_call == ToolCallDelta(index=0, arguments="{}")
    assert delta_to_openai(head) == {
        "tool_calls": [{"index": 0, "id": head.tool_call.id, "type": "function",
                        "function": {"name": "get_time", "arguments": ""}}]
    }
    assert delta_to_openai(args) == {"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}
    assert parser.finish() == []
    assert [c.to_openai()["function"] for c in parser.tool_calls] == [
        {"name": "get_time", "arguments": "{}"}
    ]


def test_schema_mismatch_keeps_call_with_raw_value():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n</function>\n</tool_call>"
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS)
    assert got[2] == [("get_weather", {"days": "three"})]


MALFORMED = [
    # unclosed at the end (length limit)
    (QWEN_XML_MARKERS, "Let me look.\n\n<tool_call>\n<function=get_weather>\n<parameter=ci"),
    # bad JSON
    (QWEN_XML_MARKERS, 'Ok.\n<tool_call>\n{"name": "get_time", "arguments": {oops}\n</tool_call>\nDone.'),
    # JSON without a name, arguments not an object
    (QWEN_JSON_MARKERS, '<tool_call>{"arguments": {}}</tool_call>'),
    (QWEN_JSON_MARKERS, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
    # not a function block at all
    (QWEN_XML_MARKERS, "<tool_call>\nsomething else\n</tool_call>"),
    (QWEN_XML_MARKERS, "<tool_call></tool_call>"),
    # Gemma: unbalanced braces, no call: prefix, unclosed
    (GEMMA4_MARKERS, "<|tool_call>call:get_time{a:<tool_call|>"),
    (GEMMA4_MARKERS, "<|tool_call>get_time{}<tool_call|>"),
    (GEMMA4_MARKERS, "Hmm <|tool_call>call:get_time{"),
]


@pytest.mark.parametrize("markers, text", MALFORMED)
def test_malformed_calls_fall_back_to_content(markers, text):
    got = check_all_chunkings(text, markers=markers, tools=TOOLS)
    assert got == (text, "", [], None, "length")


def test_malformed_then_valid_call():
    text = (
        "<tool_call>\nnope\n</tool_call>\n"
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS)
    assert got == ("<tool_call>\nnope\n</tool_call>", "", [("get_time", {})], None, "tool_calls")


def test_call_cut_by_stop_string_is_content():
    text = '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS, stop=['"arguments"'])
    assert got == ('<tool_call>\n{"name": "get_time", ', "", [], '"arguments"', "stop")


@pytest.mark.parametrize("tools, tool_choice", [(TOOLS, "none"), (None, "auto"), ([], None)])
def test_tools_off_leaves_text_alone(tools, tool_choice):
    text = "Answer.\n\n" + QWEN_XML_CALL
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=tools, tool_choice=tool_choice)
    assert got == (text, "", [], None, "length")


def test_tool_call_inside_reasoning_is_reasoning():
    text = "I could emit <tool_call>{}</tool_call> here.\n</think>\n\nNo call."
    got = check_all_chunkings(text, markers=QWEN_XML_MARKERS, tools=TOOLS, starts_in_reasoning=True)
    assert got == ("No call.", "I could emit <tool_call>{}</tool_call> here.", [], None, "length")


def test_tools_as_pydantic_like_objects():
    class Tool:
        def __init__(self, data):
            self.data = data

        def model_dump(self, exclude_none=False):
            return self.data

    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>"
    parsed = parse_chat_output(text, QWEN_XML_MARKERS, [Tool(t) for t in TOOLS], "auto")
    assert json.loads(parsed.tool_calls[0].arguments) == {"days": 5}


# -------------------------------------------------------------- chunk-invariance property

PIECES = [
    "Hello", " world", ".", "\n", "\n\n", " ", "  ", "é", "中文", "{", "}", '"', "<", ">", "|",
    "<think>", "</think>", "</thi", "<thi", "<|channel>thought", "<|channel>", "<channel|>",
    "<tool_call>", "</tool_call>", "<tool_", "<|tool_call>", "<tool_call|>", "STOP", "ST", "OP",
    "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n",
    "<function=get_time>\n</function>",
    '{"name": "get_time", "arguments": {}}', '{"name": "x", "arguments": {"a": [1, 2]}}',
    'call:get_weather{city:<|"|>Nice<|"|>,days:2}', "call:get_time{}", "call:broken{",
    # whole calls, so that random texts often contain parseable ones
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
    "<tool_call>\n<function=get_weather>\n<parameter=days>\n4\n</parameter>\n</function>\n</tool_call>",
    '<|tool_call>call:get_weather{city:<|"|>Nice<|"|>,days:2}<tool_call|>',
]


def _random_case(rng: random.Random) -> tuple[str, dict[str, Any]]:
    text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
    kwargs = {
        "markers": rng.choice([PLAIN, QWEN_XML_MARKERS, QWEN_JSON_MARKERS, GEMMA4_MARKERS]),
        "tools": rng.choice([TOOLS, TOOLS, None]),
        "tool_choice": rng.choice(["auto", "none", None]),
        "stop": rng.choice([None, ["STOP"], ["STOP", "\n\n"], ["</think>", "ld."]]),
        "starts_in_reasoning": rng.random() < 0.4,
    }
    return text, kwargs


def test_random_chunkings_give_identical_results():
    rng = random.Random(1234)
    for case in range(400):
        text, kwargs = _random_case(rng)
        check_all_chunkings(text, seed=case, **kwargs)


def test_output_never_invents_text():
    """Without markers or stops active, the joined output is exactly the input."""
    rng = random.Random(7)
    for case in range(100):
        text = "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 30)))
        got = check_all_chunkings(text, seed=case, markers=QWEN_XML_MARKERS, tools=TOOLS,
                                  tool_choice="none")
        # Only a leading reasoning block can be split off.
        assert got[0] == text or text.lstrip().startswith("<think>")


# ----------------------------------------------------------------- marker inference

QWEN35_TEMPLATE = (
    "{%- if message.tool_calls %}{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
    "{{- '<parameter=' + args_name + '>\\n' }}{{- '</function>\\n</tool_call>' }}{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- else %}{{- '<think>\\n' }}{%- endif %}"
)
QWEN3_JSON_TEMPLATE = (
    "{{- '<tool_call>\\n{\"name\": \"' }}{{- tool_call.name }}{{- '\", \"arguments\": ' }}"
    "{{- '}\\n</tool_call>' }}{%- if '</think>' in content %}{%- set c = content.split('</think>') %}"
    "{{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}"
)
GEMMA4_TEMPLATE = (
    "{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}"
    "{{- '<|tool_call>call:' + function['name'] + '{' -}}{{- '}<tool_call|>' -}}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)
LLAMA_TEMPLATE = "{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>{% endfor %}"


@pytest.mark.parametrize(
    "template, vocab, expected",
    [
        (QWEN35_TEMPLATE, {"<think>": 1, "</think>": 2}, QWEN_XML_MARKERS),
        (QWEN3_JSON_TEMPLATE, {"<think>": 1, "</think>": 2}, QWEN_JSON_MARKERS),
        (GEMMA4_TEMPLATE, {"<|channel>": 1, "<channel|>": 2}, GEMMA4_MARKERS),
        (LLAMA_TEMPLATE, {"<|eot_id|>": 1}, PLAIN),
        (LLAMA_TEMPLATE, {"<think>": 1, "</think>": 2}, PLAIN),  # template decides
        (None, {"<think>": 1, "</think>": 2, "<tool_call>": 3, "</tool_call>": 4}, QWEN_JSON_MARKERS),
        (None, {"<|channel>": 1, "<channel|>": 2, "<|tool_call>": 3, "<tool_call|>": 4},
         GEMMA4_MARKERS),
        (None, None, PLAIN),
    ],
)
def test_markers_for_tokenizer(template, vocab, expected):
    assert markers_for_tokenizer(template, vocab) == expected


def test_markers_reasoning_only_template():
    got = markers_for_tokenizer("{{ '<think>\\n' }}{{ '</think>' }}", {})
    assert got == Markers("qwen", "<think>", "</think>")
    assert not got.has_tools and got.has_reasoning


def test_prompt_starts_in_reasoning():
    assert prompt_starts_in_reasoning("<|im_start|>assistant\n<think>\n", QWEN_XML_MARKERS)
    assert not prompt_starts_in_reasoning(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n", QWEN_XML_MARKERS
    )
    assert not prompt_starts_in_reasoning("<|turn>model\n", GEMMA4_MARKERS)
    assert not prompt_starts_in_reasoning(
        "<|turn>model\n<|channel>thought\n<channel|>", GEMMA4_MARKERS
    )
    assert not prompt_starts_in_reasoning("<think>\n", PLAIN)
