"""The grammars of server/structured.py accept what each tool-call form writes for a valid call and
refuse invalid arguments, checked with llguidance over the fixtures' real tokenizers."""

from __future__ import annotations

import llguidance
import pytest
from mlx_lm.utils import load_tokenizer

from dflash_core.grammar import compile_grammar, tokenizer_info
from dflash_core.prompts import hf_tokenizer
from dflash_server.schemas import ResponseFormat
from dflash_server.structured import (
    Literals,
    answer_or_calls_grammar,
    format_schema,
    response_format_grammar,
    strict_tools_grammar,
)
from dflash_server.tool_calls import GEMMA4_MARKERS, QWEN_JSON_MARKERS, QWEN_XML_MARKERS

WEATHER = {"type": "function", "function": {"name": "get_weather", "strict": True, "parameters": {
    "type": "object", "required": ["city", "days"],
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "unit": {"enum": ["c", "f"]}, "tags": {"type": "array", "items": {"type": "string"}}}}}}


@pytest.fixture(scope="module")
def qwen(qwen3_5_pair):
    return hf_tokenizer(load_tokenizer(qwen3_5_pair[0]))


@pytest.fixture(scope="module")
def gemma(gemma4_pair):
    return hf_tokenizer(load_tokenizer(gemma4_pair[0]))


def _matches(hf, spec, text) -> bool:
    info = tokenizer_info(hf, len(hf))
    matcher = llguidance.LLMatcher(info, compile_grammar(spec, info).text, log_level=0)
    ids = hf.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()


XML_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis <centre>\n</parameter>\n<parameter=days>\n3\n"
            "</parameter>\n<parameter=unit>\nc\n</parameter>\n</function>\n</tool_call>")
JSON_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
GEMMA_CALL = '<|tool_call>call:get_weather{city:<|"|>Lima {x}<|"|>,days:3,tags:[<|"|>a<|"|>,<|"|>b<|"|>]}<tool_call|>'


@pytest.mark.parametrize("form, markers, call, wrong", [
    ("xml", QWEN_XML_MARKERS, XML_CALL, XML_CALL.replace("\n3\n", "\nthree\n")),
    ("xml-unit", QWEN_XML_MARKERS, XML_CALL, XML_CALL.replace("\nc\n", "\nk\n")),
    ("json", QWEN_JSON_MARKERS, JSON_CALL, JSON_CALL.replace('"city"', '"town"')),
    ("gemma", GEMMA4_MARKERS, GEMMA_CALL, GEMMA_CALL.replace("days:3,", "")),
], ids=lambda v: v if isinstance(v, str) and len(v) < 12 else None)
def test_auto_allows_text_and_valid_calls_only(qwen, gemma, form, markers, call, wrong):
    hf = gemma if markers is GEMMA4_MARKERS else qwen
    reasoning = "" if markers is GEMMA4_MARKERS else "Let me see.\n</think>\n\n"
    spec = strict_tools_grammar([WEATHER], markers, "", bool(reasoning), Literals(hf.get_added_vocab()))
    assert _matches(hf, spec, reasoning + "I will call it. " + call + "\nDone.")
    assert _matches(hf, spec, reasoning + "No call needed.")
    assert not _matches(hf, spec, reasoning + wrong)


@pytest.mark.parametrize("markers, opening, rest", [
    (QWEN_XML_MARKERS, "<tool_call>\n", XML_CALL[len("<tool_call>\n"):]),
    (QWEN_XML_MARKERS, "<tool_call>\n<function=get_weather>\n", XML_CALL[len("<tool_call>\n<function=get_weather>\n"):]),
    (QWEN_JSON_MARKERS, '<tool_call>\n{"name": "get_weather", "arguments": ', JSON_CALL.split('"arguments": ')[1]),
    (GEMMA4_MARKERS, "<|tool_call>call:get_weather", GEMMA_CALL[len("<|tool_call>call:get_weather"):]),
], ids=["xml-required", "xml-named", "json-named", "gemma-named"])
def test_a_forced_opening_is_continued(qwen, gemma, markers, opening, rest):
    hf = gemma if markers is GEMMA4_MARKERS else qwen
    spec = strict_tools_grammar([WEATHER], markers, opening, False, Literals(hf.get_added_vocab()), "get_weather")
    assert _matches(hf, spec, rest)
    assert not _matches(hf, spec, "Some text first. " + rest)


def test_no_strict_tool_no_grammar(qwen):
    loose = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
    assert strict_tools_grammar([loose], QWEN_XML_MARKERS, "", False, Literals(qwen.get_added_vocab())) is None


LOOSE = {"type": "function", "function": {**WEATHER["function"], "strict": False}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize("markers, opening, call, off_schema, broken", [
    (QWEN_XML_MARKERS, "<tool_call>\n", XML_CALL, XML_CALL.replace("\n3\n", "\nthree\n"),
     XML_CALL.replace("</function>\n", "")),
    (QWEN_JSON_MARKERS, "<tool_call>\n", JSON_CALL, JSON_CALL.replace('"city"', '"town"'),
     JSON_CALL.replace('"Paris"', "Paris")),
    (GEMMA4_MARKERS, "<|tool_call>call:", GEMMA_CALL, GEMMA_CALL.replace("days:3,", ""),
     GEMMA_CALL.replace("{city:", "{city=")),
], ids=["xml", "json", "gemma"])
@pytest.mark.parametrize("named", [None, "get_weather"], ids=["required", "named"])
def test_a_forced_call_of_loose_tools_is_finished_well_formed(qwen, gemma, markers, opening, call, off_schema,
                                                              broken, named):
    """tool_choice required or named with tools that are not strict: the call the server opened is
    finished as a call the parser reads (a tool of the request, arguments in the form's syntax),
    not held to the schema; text and more calls may follow, as in auto (named: of that tool only)."""
    hf = gemma if markers is GEMMA4_MARKERS else qwen
    if named:
        opening += "get_weather" if markers is GEMMA4_MARKERS else (
            "<function=get_weather>\n" if markers is QWEN_XML_MARKERS else '{"name": "get_weather", "arguments": ')
    spec = strict_tools_grammar([LOOSE, CLOCK], markers, opening, False, Literals(hf.get_added_vocab()), named)
    rest = call[len(opening):]
    assert _matches(hf, spec, rest)
    assert _matches(hf, spec, off_schema[len(opening):])  # loose: arguments off the schema pass
    assert _matches(hf, spec, rest + "\nDone. " + call.replace("Paris", "Rome"))
    assert not _matches(hf, spec, broken[len(opening):])
    assert not _matches(hf, spec, "Some text first. " + rest)
    other = call.replace("get_weather", "get_time")[len(opening):]
    assert _matches(hf, spec, other) is (named is None)  # required: any tool of the request
    # ... and after the forced call too: named, its further calls are of the named tool alone
    assert _matches(hf, spec, rest + "\nDone. " + call.replace("get_weather", "get_time")) is (named is None)
    assert not _matches(hf, spec, call.replace("get_weather", "get_news")[len(opening):])


def test_what_a_loose_forced_call_may_write_is_what_the_parser_reads(qwen, gemma):
    """The grammar's form is the parser's (mlx-lm's): Gemma 4 keys of word characters and JSON
    numbers, Qwen XML parameter names without whitespace, Gemma 4 tool names with . or : (read by
    the request's names)."""
    from dflash_server.tool_calls import GEMMA4, QWEN_XML, parse_tool_body

    spec = strict_tools_grammar([LOOSE], GEMMA4_MARKERS, "<|tool_call>call:", False,
                                Literals(gemma.get_added_vocab()))
    for arguments, readable in [("{path:<|\"|>a<|\"|>,n:-1.5e3}", True), ("{file-path:<|\"|>a<|\"|>}", False),
                                ("{n:1-2}", False), ("{n:007}", False), ("{n:1.2.3}", False)]:
        call = "get_weather" + arguments + "<tool_call|>"
        assert _matches(gemma, spec, call) is readable, arguments
        if readable:
            assert parse_tool_body(GEMMA4, "call:" + call[: -len("<tool_call|>")])[0].name == "get_weather"
    xml = strict_tools_grammar([LOOSE], QWEN_XML_MARKERS, "<tool_call>\n", False, Literals(qwen.get_added_vocab()))
    body = "<function=get_weather>\n<parameter=first name>\nAda\n</parameter>\n</function>\n</tool_call>"
    assert not _matches(qwen, xml, body)
    assert _matches(qwen, xml, body.replace("first name", "first_name"))
    assert parse_tool_body(QWEN_XML, body.replace("first name", "first_name")[: -len("</tool_call>")])[0].arguments \
        == '{"first_name": "Ada"}'
    # A name with . or : (mlx-lm's call pattern stops there): the request's tools are read by name.
    dotted = {"type": "function", "function": {**LOOSE["function"], "name": "web.get:weather"}}
    spec = strict_tools_grammar([dotted], GEMMA4_MARKERS, "<|tool_call>call:", False, Literals(gemma.get_added_vocab()))
    assert _matches(gemma, spec, "web.get:weather{n:1}<tool_call|>")
    assert parse_tool_body(GEMMA4, "call:web.get:weather{n:1}", [dotted])[0].name == "web.get:weather"


def test_json_answer_after_reasoning(qwen):
    spec = response_format_grammar(format_schema(ResponseFormat(type="json_object")), QWEN_XML_MARKERS, True,
                                   Literals(qwen.get_added_vocab()))
    assert _matches(qwen, spec, 'Thinking {about} it.\n</think>\n\n{"a": [1, 2]}')
    assert not _matches(qwen, spec, "Thinking.\n</think>\n\nno json")


ANSWER = ResponseFormat.model_validate({"type": "json_schema", "json_schema": {"name": "out", "schema": {
    "type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}}})


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "loose"])
@pytest.mark.parametrize("form, markers, call", [
    ("xml", QWEN_XML_MARKERS, XML_CALL), ("json", QWEN_JSON_MARKERS, JSON_CALL), ("gemma", GEMMA4_MARKERS, GEMMA_CALL),
])
def test_a_format_with_tools_is_the_answer_or_calls(qwen, gemma, form, markers, call, strict):
    """A response format applies to the final answer: with tools the output is that JSON, or tool
    calls (Codex sends its output schema with all its tools), never text, nor JSON off the schema."""
    hf = gemma if markers is GEMMA4_MARKERS else qwen
    reasoning = "" if markers is GEMMA4_MARKERS else "Let me see.\n</think>\n\n"
    tool = {"type": "function", "function": {**WEATHER["function"], "strict": strict}}
    spec = answer_or_calls_grammar(format_schema(ANSWER), [tool], markers, bool(reasoning), Literals(hf.get_added_vocab()))
    assert _matches(hf, spec, reasoning + '{"answer": "sunny"}')
    assert _matches(hf, spec, reasoning + call)
    assert _matches(hf, spec, reasoning + call + "\n" + call)
    assert not _matches(hf, spec, reasoning + '{"reply": "sunny"}')
    assert not _matches(hf, spec, reasoning + "I will call it. " + call)
    assert not _matches(hf, spec, reasoning + call + '\n{"answer": "sunny"}')
    bad_call = call.replace("get_weather", "get_time")
    assert _matches(hf, spec, reasoning + bad_call) != strict  # strict calls name their tools


def test_a_deep_gemma_schema_makes_a_grammar_of_its_size(gemma):
    """Gemma 4's strict arguments nested 24 objects deep: a rule per value, not two (each level used
    to double the grammar: 20 levels made millions of rules and a 1 KB request took the server's
    memory)."""
    schema: dict = {"type": "string"}
    for _ in range(24):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    tool = {"type": "function", "function": {"name": "deep", "strict": True, "parameters": schema}}
    spec = strict_tools_grammar([tool], GEMMA4_MARKERS, "", False, Literals(gemma.get_added_vocab()))
    assert spec.value.count("\n") < 400
    call = "<|tool_call>call:deep" + "{a:" * 24 + '<|"|>x<|"|>' + "}" * 24 + "<tool_call|>"
    assert _matches(gemma, spec, call)


def test_literals_find_every_added_token_in_one_pass(qwen):
    lit = Literals(qwen.get_added_vocab())
    think = qwen.get_added_vocab()["<think>"]
    assert lit('a "x" <think>b<think>') == f'"a \\"x\\" " <[{think}]> "b" <[{think}]>'
    assert lit("") == '""' and lit("plain") == '"plain"'
    assert lit("<think>" * 20000).count(f"<[{think}]>") == 20000  # (a search per occurrence took minutes)
