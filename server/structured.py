"""Structured output: the grammar a chat request's output must match, as Lark text for llguidance
(dflash_core/grammar.py applies it at every verified position, so output stays lossless).

- `response_format` `json_object` / `json_schema` (Responses: `text.format`; Messages:
  `output_config.format`): the answer is that JSON, after the model's reasoning when the prompt
  opened a reasoning block; with tools the model may call, either that JSON or tool calls (the
  format is the final answer's).
- `strict` function tools: every tool call the model writes has arguments that match its schema,
  in the tool-call form of the model's template: JSON (`<tool_call>{"name", "arguments"}`, Qwen's
  JSON templates and the generic tools prompt), Qwen's XML parameters, or Gemma 4's `call:NAME{...}`.
  Text outside calls is free.
"""

from __future__ import annotations

import json
import re
from typing import Any, Optional

from dflash_core.grammar import GrammarSpec

from .errors import bad_request
from .tool_calls import GEMMA4, QWEN_JSON, QWEN_XML, Markers

HEADER = "%llguidance {}\n"


class Literals:
    """Lark for literal text. A template's added tokens (<think>, <tool_call>, <|im_end|>...) are
    single tokens that llguidance matches only as `<token>` references, never as text."""

    def __init__(self, added_tokens: dict[str, int]):
        # Longest first, so a token that contains another is found whole.
        self.added = sorted((t for t in added_tokens if t), key=len, reverse=True)
        self.ids = dict(added_tokens)
        # One scan of the text for all of them (leftmost, then longest): a search per token and
        # occurrence took minutes for a tool name of 200,000 "<think>".
        self._tokens = re.compile("|".join(map(re.escape, self.added))) if self.added else None

    def is_token(self, text: str) -> bool:
        return text in self.added

    def __call__(self, text: str) -> str:
        parts, at = [], 0
        for found in self._tokens.finditer(text) if self._tokens is not None else ():
            if found.start() > at:
                parts.append(json.dumps(text[at:found.start()]))
            parts.append(f"<[{self.ids[found.group()]}]>")  # by id: a name like <|"|> would not parse
            at = found.end()
        if at < len(text):
            parts.append(json.dumps(text[at:]))
        return " ".join(parts) or '""'

    def until(self, name: str, marker: str) -> str:
        """A rule `name` matching any text through the first `marker`."""
        if self.is_token(marker):  # free text cannot contain the token: no laziness needed
            return f"{name}: /(.|\\n)*/ {self(marker)}"
        return f"{name}[lazy]: /(.|\\n)*/ {json.dumps(marker)}"


def _reasoning_prefix(lit: Literals, markers: Markers, starts_in_reasoning: bool) -> str:
    """A rule `think` matching the open reasoning block through its end marker, or nothing when
    the output does not start in reasoning."""
    if not (starts_in_reasoning and markers.reasoning_end):
        return ""
    return lit.until("think", markers.reasoning_end) + "\n"


def format_schema(response_format) -> Optional[Any]:
    """The JSON schema a response format asks the answer to match (None: free text)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return {"type": "object"}
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
    _refuse_wide_bounds(spec.schema_, "response_format")
    return spec.schema_


INT64 = 2**63 - 1
BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _refuse_wide_bounds(schema: Any, param: str) -> None:
    """A 400 for a numeric bound beyond 64 bits anywhere in `schema`: llguidance holds integers in
    64 bits, and a minimum of 1e30 gave 9223372036854775807 (a value below it) and a 200."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in BOUNDS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                        and abs(value) > INT64:
                    raise bad_request(f"a schema's {key} of {value!r} is beyond what can be enforced (64-bit integers)",
                                      param=param)
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def response_format_grammar(schema: Optional[Any], markers: Markers, starts_in_reasoning: bool,
                            lit: Literals) -> Optional[GrammarSpec]:
    """The answer is JSON matching `schema` (`format_schema`; None: free text, no grammar)."""
    if schema is None:
        return None
    think = _reasoning_prefix(lit, markers, starts_in_reasoning)
    start = "start: think WS %json " if think else "start: WS %json "
    return GrammarSpec("lark", HEADER + start + json.dumps(schema) + "\nWS: /[ \\t\\n]*/\n" + think)


def answer_or_calls_grammar(schema: Optional[Any], tools: list[dict], markers: Markers, starts_in_reasoning: bool,
                            lit: Literals) -> Optional[GrammarSpec]:
    """A response format (its `schema`, `format_schema`) with tools the model may call: as the APIs
    define it, the format is the final answer's, so the output is either that JSON or tool calls in
    the template's form (one or more, whitespace between, no text around them), after the
    reasoning. Strict tools' calls match their schemas; the others' arguments are free. None
    without a format."""
    if schema is None:
        return None
    if not tools or not markers.has_tools:  # nothing the model could call in a form we read
        return response_format_grammar(schema, markers, starts_in_reasoning, lit)
    strict = _strict_functions(tools)
    rules = _Rules(lit)
    if strict:
        bodies = [rules.add(f"{lit(head)} {core} {lit(tail)}") for head, core, tail in
                  (_call_parts(rules, markers, f) for f in strict)]
        rules.lines.append(f"call: {lit(markers.tool_start)} ({' | '.join(bodies)})")
    elif markers.tool_format == GEMMA4:  # (its strings are between special tokens, which no text rule matches)
        rules.lines.append(f'call: {lit(markers.tool_start)} "call:" /[A-Za-z0-9_.:-]+/ '
                           f"{_gemma_any(rules)} {lit(markers.tool_end)}")
    else:
        rules.lines += [f"call: {lit(markers.tool_start)} free", lit.until("free", markers.tool_end)]
    think = _reasoning_prefix(lit, markers, starts_in_reasoning)
    return GrammarSpec("lark", HEADER + "\n".join([
        "start: think body" if think else "start: body", "body: answer | calls",
        f"answer: WS %json {json.dumps(schema)}", "calls: WS call (WS call)* WS", "WS: /[ \\t\\n]*/",
        *rules.lines, think]))


# --------------------------------------------------------------------------- strict tools


class _Rules:
    """Lark rules under construction, with fresh names."""

    def __init__(self, lit: Literals):
        self.lit, self.lines, self.count = lit, [], 0
        self.shared: dict[str, str] = {}  # rules written once for all calls that need them, by what they are

    def once(self, key: str, make) -> str:
        """The rule `key`, written by `make()` the first time it is asked for."""
        if key not in self.shared:
            self.shared[key] = make()
        return self.shared[key]

    def add(self, body: str, lazy: bool = False) -> str:
        self.count += 1
        name = f"r{self.count}"
        self.lines.append(f"{name}{'[lazy]' if lazy else ''}: {body}")
        return name


# Names a call's markup can carry, as mlx-lm's parsers read them: Qwen's <parameter=KEY> tag (no
# whitespace, < or >), Gemma 4's bare keys (word characters).
XML_KEY = re.compile(r"[^\s<>]+")
GEMMA_KEY = re.compile(r"[A-Za-z0-9_]+")
GEMMA_NUMBER = "/-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][-+]?[0-9]+)?/"


def _writable_key(key: str, form: re.Pattern) -> None:
    if not form.fullmatch(key):
        raise bad_request(f"a strict tool's property name {key!r} cannot be written in this model's tool-call "
                          "format", param="tools")


def _xml_params(rules: _Rules, parameters: dict) -> str:
    """Qwen's XML form: one <parameter=P> block per property, in the schema's order (required ones
    always, the others optional); string values raw up to the closing tag, others as JSON."""
    lit, parts = rules.lit, []
    required = set(parameters.get("required") or ())
    for prop, schema in (parameters.get("properties") or {}).items():
        _writable_key(prop, XML_KEY)
        head, close = lit(f"<parameter={prop}>\n"), lit("\n</parameter>\n")
        schema = schema if isinstance(schema, dict) else {}
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None and all(isinstance(c, str) for c in choices):  # raw strings, no quotes
            value = f"({' | '.join(lit(c) for c in choices)}) {close}"
        elif schema.get("type") == "string" and "pattern" not in schema:  # raw text up to the closing tag
            value = rules.add(f"/(.|\\n)*/ {close}", lazy=not lit.is_token("</parameter>"))
        else:
            value = f"%json {json.dumps(schema)} {close}"
        parts.append(rules.add(f"{head} {value}") + ("" if prop in required else "?"))
    return " ".join(parts) or '""'


def _gemma_value(rules: _Rules, schema: Any) -> str:
    """Gemma 4's argument syntax (its template's `gval`): strings between <|"|> tokens, keys bare
    and sorted, numbers, booleans and null as JSON. Keywords beyond type, properties, required,
    items, enum, const (and an integer's minimum and maximum, when less than 256 apart) allow any
    value of that type or place."""
    lit = rules.lit
    quote = lit('<|"|>')
    schema = schema if isinstance(schema, dict) else {}
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
    if choices is not None:
        return "(" + " | ".join(f"{quote} {lit(c)} {quote}" if isinstance(c, str) else lit(json.dumps(c))
                                for c in choices) + ")"
    kind = schema.get("type")
    if kind == "string":
        return f"{quote} /(.|\\n)*/ {quote}"
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if isinstance(low, int) and isinstance(high, int) and 0 <= high - low < 256:  # a small range: each value
            return "(" + " | ".join(lit(str(v)) for v in range(low, high + 1)) + ")"
        return "/-?(0|[1-9][0-9]{0,18})/"  # an int64 at most; bounds beyond a small range are not enforced
    if kind == "number":
        return GEMMA_NUMBER
    if kind == "boolean":
        return '("true" | "false")'
    if kind == "null":
        return '"null"'
    if kind == "array" and "items" in schema:
        item = rules.add(_gemma_value(rules, schema["items"]))
        return f'"[" ({item} ("," {item})*)? "]"'
    if kind == "object" and "properties" in schema:
        return '"{" ' + _gemma_members(rules, schema) + ' "}"'
    return _gemma_any(rules)


def _gemma_members(rules: _Rules, schema: dict) -> str:
    """key:value pairs in sorted key order (the template's dictsort), separated by commas, the
    required ones always there."""
    props = sorted((schema.get("properties") or {}).items())
    for key, _ in props:
        _writable_key(key, GEMMA_KEY)
    required = set(schema.get("required") or ())
    after = {}  # (index, is_first) -> rule for the members from index on
    for i in range(len(props), -1, -1):
        # One rule per value, used by both forms of the pair (writing the value twice doubled the
        # grammar at every level of nesting: 20 levels made millions of rules).
        value = rules.add(_gemma_value(rules, props[i][1])) if i < len(props) else None
        for first in (True, False):
            if i == len(props):
                after[i, first] = '""'
                continue
            key = props[i][0]
            pair = ("" if first else '"," ') + f'{rules.lit(key + ":")} {value}'
            taken = rules.add(f"{pair} {after[i + 1, False]}")
            after[i, first] = taken if key in required else rules.add(f"{taken} | {after[i + 1, first]}")
    return after[0, True]


def _gemma_any(rules: _Rules) -> str:
    def make() -> str:
        quote, key = rules.lit('<|"|>'), f"/{GEMMA_KEY.pattern}/"
        rules.lines.append(
            f'gany: {quote} /(.|\\n)*/ {quote} | {GEMMA_NUMBER} | "true" | "false" | "null"'
            f' | "[" (gany ("," gany)*)? "]" | "{{" ({key} ":" gany ("," {key} ":" gany)*)? "}}"')
        return "gany"

    return rules.once("gemma_any", make)


def _strict_functions(tools: Optional[list[dict]]) -> list[dict]:
    """The functions of the strict tools: every tool's, or none (a request mixing them is a 400),
    each with schema bounds a grammar can enforce (`_refuse_wide_bounds`)."""
    strict = [t["function"] for t in tools or () if t["function"].get("strict")]
    if strict and len(strict) != len(tools):
        raise bad_request("strict must be the same for every tool of a request", param="tools")
    for function in strict:
        _refuse_wide_bounds(function.get("parameters"), "tools")
    return strict


def _call_parts(rules: _Rules, markers: Markers, function: dict) -> tuple[str, str, str]:
    """(text after the start marker that names the call, Lark for its arguments, text that ends it)."""
    name = function["name"]
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    end = markers.tool_end
    if markers.tool_format == QWEN_JSON:
        return f'\n{{"name": "{name}", "arguments": ', f"%json {json.dumps(parameters)}", f"}}\n{end}"
    if markers.tool_format == QWEN_XML:
        return f"\n<function={name}>\n", _xml_params(rules, parameters), f"</function>\n{end}"
    return f"call:{name}{{", _gemma_members(rules, parameters), f"}}{end}"


def _any_arguments_parts(rules: _Rules, markers: Markers, function: dict) -> tuple[str, str, str]:
    """`_call_parts` for a tool that is not strict: its name, and arguments held only to the form."""
    name, end = function["name"], markers.tool_end
    if markers.tool_format == QWEN_JSON:  # (one rule for all: each %json is compiled on its own)
        arguments = rules.once("json_object", lambda: rules.add('%json {"type": "object"}'))
        return f'\n{{"name": "{name}", "arguments": ', arguments, f"}}\n{end}"
    if markers.tool_format == QWEN_XML:  # <parameter=KEY> blocks, any keys, values raw to their end tag
        def xml_params() -> str:
            lit = rules.lit
            head, open_, close = lit("<parameter="), lit(">\n"), lit("\n</parameter>\n")
            value = rules.add(f"/(.|\\n)*/ {close}", lazy=not lit.is_token("</parameter>"))
            param = rules.add(f"{head} /{XML_KEY.pattern}/ {open_} {value}")
            return rules.add(f'{param}* ""')

        return f"\n<function={name}>\n", rules.once("xml_params", xml_params), f"</function>\n{end}"

    def gemma_object() -> str:
        value, key = _gemma_any(rules), f"/{GEMMA_KEY.pattern}/"
        return rules.add(f'"{{" ({key} ":" {value} ("," {key} ":" {value})*)? "}}"')

    return f"call:{name}", rules.once("gemma_object", gemma_object), end


def strict_tools_grammar(tools: list[dict], markers: Markers, forced_opening: str, starts_in_reasoning: bool,
                         lit: Literals, named: Optional[str] = None) -> Optional[GrammarSpec]:
    """The grammar for requests with strict function tools: their calls match their schemas. Or,
    where the server opened a call (`forced_opening`: tool_choice required or `named`) for tools
    that are not strict, the call is finished well-formed: a tool of the request, arguments any
    JSON object (Gemma 4: any object of its values; Qwen's XML: any text in the function block), so
    that the forced call parses as one. Otherwise None: no grammar."""
    strict = _strict_functions(tools)
    if not strict and not forced_opening:
        return None
    if markers.tool_format not in (QWEN_JSON, QWEN_XML, GEMMA4):
        raise bad_request("this model's template has no tool-call form to enforce strict schemas in", param="tools")
    rules = _Rules(lit)
    parts = _call_parts if strict else _any_arguments_parts
    calls = [(f["name"], *parts(rules, markers, f)) for f in strict or [t["function"] for t in tools]]
    bodies = [rules.add(f"{lit(head)} {core} {lit(tail)}") for _, head, core, tail in calls]
    # A named tool_choice holds every call of the turn to that tool, the first (opened) and any after it.
    callable_bodies = [body for body, (name, *_) in zip(bodies, calls) if name == (named or name)] or bodies
    rules.lines += ["TEXT: /(.|\\n)*/", lit.until("trigger", markers.tool_start),
                    f"call: trigger ({' | '.join(callable_bodies)})", "rest: call* TEXT"]
    if not forced_opening:
        think = _reasoning_prefix(lit, markers, starts_in_reasoning)
        start = "start: think rest" if think else "start: rest"
        return GrammarSpec("lark", HEADER + "\n".join([start, *rules.lines, think]))
    # The server wrote the opening of a call: the model continues it, then may go on as in `auto`
    # (more calls of the named tool only, where one is named).
    written = forced_opening[len(markers.tool_start):]
    firsts = [f"{lit(head[len(written):])} {core} {lit(tail)}" for name, head, core, tail in calls
              if head.startswith(written) and name == (named or name)]
    if not firsts:
        raise bad_request("tool_choice names no strict tool", param="tool_choice")
    return GrammarSpec("lark", HEADER + "\n".join([f"start: ({' | '.join(firsts)}) rest", *rules.lines]))
