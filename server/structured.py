"""Structured output: the grammar a chat request's output must match, as Lark text for llguidance
(dflash_core/grammar.py applies it at every verified position, so output stays lossless).

- `response_format` `json_object` / `json_schema` (Responses: `text.format`; Messages:
  `output_config.format`): the answer is that JSON, after the model's reasoning when the prompt
  opened a reasoning block.
- `strict` function tools: every tool call the model writes has arguments that match its schema,
  in the tool-call form of the model's template: JSON (`<tool_call>{"name", "arguments"}`, Qwen's
  JSON templates and the generic tools prompt) or Qwen's XML parameters. Text outside calls is free.
  Gemma 4's form is not covered (its values are not JSON), a 400 says so.
"""

from __future__ import annotations

import json
from typing import Any, Optional

from dflash_core.grammar import GrammarSpec

from .errors import bad_request
from .tool_calls import QWEN_JSON, QWEN_XML, Markers

HEADER = "%llguidance {}\n"


class Literals:
    """Lark for literal text. A template's added tokens (<think>, <tool_call>, <|im_end|>...) are
    single tokens that llguidance matches only as `<token>` references, never as text."""

    def __init__(self, added_tokens):
        # Longest first, so a token that contains another is found whole.
        self.added = sorted((t for t in added_tokens if t), key=len, reverse=True)

    def is_token(self, text: str) -> bool:
        return text in self.added

    def __call__(self, text: str) -> str:
        parts, rest = [], text
        while rest:
            at, token = min(((rest.find(t), t) for t in self.added if t in rest), default=(-1, None))
            if token is None:
                parts.append(json.dumps(rest))
                break
            if at:
                parts.append(json.dumps(rest[:at]))
            parts.append(token)
            rest = rest[at + len(token):]
        return " ".join(parts) or '""'

    def until(self, name: str, marker: str) -> str:
        """A rule `name` matching any text through the first `marker`."""
        if self.is_token(marker):  # free text cannot contain the token: no laziness needed
            return f"{name}: /(.|\\n)*/ {marker}"
        return f"{name}[lazy]: /(.|\\n)*/ {json.dumps(marker)}"


def _reasoning_prefix(lit: Literals, markers: Markers, starts_in_reasoning: bool) -> str:
    """A rule `think` matching the open reasoning block through its end marker, or nothing when
    the output does not start in reasoning."""
    if not (starts_in_reasoning and markers.reasoning_end):
        return ""
    return lit.until("think", markers.reasoning_end) + "\n"


def response_format_grammar(response_format, markers: Markers, starts_in_reasoning: bool,
                            lit: Literals) -> Optional[GrammarSpec]:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema: Any = {"type": "object"}
    else:
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise bad_request("response_format json_schema needs json_schema.schema", param="response_format")
        schema = spec.schema_
    think = _reasoning_prefix(lit, markers, starts_in_reasoning)
    start = "start: think WS %json " if think else "start: WS %json "
    return GrammarSpec("lark", HEADER + start + json.dumps(schema) + "\nWS: /[ \\t\\n]*/\n" + think)


# --------------------------------------------------------------------------- strict tools


def _json_call_schema(name: str, parameters: dict) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _xml_params(rule: str, parameters: dict, lit: Literals) -> list[str]:
    """Qwen's XML form: one <parameter=P> block per property, in the schema's order (required ones
    always, the others optional); string values raw up to the closing tag, others as JSON."""
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    rules, parts = [], []
    for j, (prop, schema) in enumerate(properties.items()):
        head = lit(f"<parameter={prop}>\n")
        close = lit("\n</parameter>\n")
        schema = schema if isinstance(schema, dict) else {}
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None and all(isinstance(c, str) for c in choices):  # raw strings, no quotes
            rules.append(f"{rule}_p{j}: {head} ({' | '.join(lit(c) for c in choices)}) {close}")
        elif schema.get("type") == "string" and "pattern" in schema:
            if "/" in schema["pattern"]:
                raise bad_request(f"the pattern of parameter {prop!r} cannot contain '/' in this model's tool form",
                                  param="tools")
            rules.append(f"{rule}_p{j}: {head} /{schema['pattern']}/ {close}")
        elif schema.get("type") == "string":  # raw text up to the closing tag
            rules.append(lit.until(f"{rule}_v{j}", "\n</parameter>\n"))
            rules.append(f"{rule}_p{j}: {head} {rule}_v{j}")
        else:
            rules.append(f"{rule}_p{j}: {head} %json {json.dumps(schema)} {close}")
        parts.append(f"{rule}_p{j}" + ("" if prop in required else "?"))
    rules.append(f"{rule}_params: {' '.join(parts)}" if parts else f'{rule}_params: ""')
    return rules


def strict_tools_grammar(tools: list[dict], markers: Markers, forced_opening: str, starts_in_reasoning: bool,
                         lit: Literals) -> Optional[GrammarSpec]:
    """The grammar for requests with strict function tools, or None when none is strict."""
    strict = [t["function"] for t in tools or () if t["function"].get("strict")]
    if not strict:
        return None
    if markers.tool_format not in (QWEN_JSON, QWEN_XML):
        raise bad_request(f"strict tool schemas are enforced for the JSON and Qwen XML tool-call forms; this model "
                          f"writes the {markers.tool_format} form", param="tools")
    if len(strict) != len(tools):
        raise bad_request("strict must be the same for every tool of a request", param="tools")
    rules, bodies = [], []
    for i, function in enumerate(strict):
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        if markers.tool_format == QWEN_JSON:
            rules.append(f"body{i}: %json {json.dumps(_json_call_schema(function['name'], parameters))} "
                         f"{lit(chr(10) + markers.tool_end)}")
        else:
            rules += _xml_params(f"f{i}", parameters, lit)
            rules.append(f"body{i}: {lit('<function=' + function['name'] + '>' + chr(10))} f{i}_params "
                         f"{lit('</function>' + chr(10) + markers.tool_end)}")
        bodies.append(f"body{i}")
    start_marker = markers.tool_start + "\n"
    rules += [
        "TEXT: /(.|\\n)*/",
        lit.until("trigger", markers.tool_start),
        f"call: trigger \"\\n\" ({' | '.join(bodies)})",
        "rest: call* TEXT",
    ]
    if not forced_opening:
        think = _reasoning_prefix(lit, markers, starts_in_reasoning)
        start = "start: think rest" if think else "start: rest"
        return GrammarSpec("lark", HEADER + "\n".join([start, *rules, think]))
    # The server wrote the opening of a call: the model continues it (a named function's opening
    # also names it), then may go on as in `auto`.
    names = {f["name"]: i for i, f in enumerate(strict)}
    continued = forced_opening[len(start_marker):] if forced_opening.startswith(start_marker) else None
    if continued == "":
        first = f"({' | '.join(bodies)})"
    else:
        name = next((n for n in names if continued in (f'<function={n}>\n', f'{{"name": "{n}", "arguments": ')), None)
        if name is None:
            raise bad_request("tool_choice cannot be combined with strict tools for this model", param="tool_choice")
        i = names[name]
        if markers.tool_format == QWEN_JSON:
            parameters = strict[i].get("parameters") or {"type": "object", "properties": {}}
            first = f"%json {json.dumps(parameters)} {lit('}' + chr(10) + markers.tool_end)}"
        else:
            first = f"f{i}_params {lit('</function>' + chr(10) + markers.tool_end)}"
    return GrammarSpec("lark", HEADER + "\n".join([f"start: {first} rest", *rules]))
