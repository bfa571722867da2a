"""Chat-template markers, and parsing one complete tool-call region into OpenAI calls.

`Markers` names the literal strings a template puts around reasoning and tool calls;
`markers_for_tokenizer` infers them. The streaming layer (`server.output_text`) finds the
region between a family's tool-call markers; `parse_tool_body` parses what lies between.
The format-specific parsing is mlx-lm's own (`mlx_lm/tool_parsers/*.py`), so the server
reads tool calls exactly as mlx-lm does; added here are the OpenAI shape (id, JSON argument
string) and a uniform contract: an exception means "malformed, show it as text".
"""

from __future__ import annotations

import importlib
import json
import secrets
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Mapping, Optional, Sequence

import regex

# Names of the mlx-lm parser modules, used as the tool-call format ids in `Markers`.
QWEN_XML = "qwen3_coder"  # <tool_call>\n<function=NAME>\n<parameter=P>\nV\n</parameter>...
QWEN_JSON = "json_tools"  # <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>
GEMMA4 = "gemma4"  # <|tool_call>call:NAME{key:<|"|>str<|"|>,n:1}<tool_call|>


def new_call_id() -> str:
    """OpenAI-style id: "call_" + 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `arguments` is a JSON object serialized as text, as OpenAI sends it."""

    name: str
    arguments: str
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict[str, Any]:
        """The `message.tool_calls[i]` entry of a non-streaming response."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _mlx_lm_parser(name: str) -> ModuleType:
    """mlx-lm's own parser for one tool-call format (`mlx_lm.tool_parsers.<name>`)."""
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


def plain_tools(tools: Optional[Sequence[Any]]) -> list[dict[str, Any]]:
    """The request's tools as plain dicts (mlx-lm's schema lookup calls `.get` on them).

    Accepts dicts or pydantic models; anything without a usable shape is skipped, since a
    schema is only a hint for converting Qwen XML values.
    """
    result: list[dict[str, Any]] = []
    for tool in tools or ():
        if hasattr(tool, "model_dump"):
            tool = tool.model_dump(exclude_none=True)
        if not isinstance(tool, dict):
            continue
        function = tool.get("function")
        if isinstance(function, dict) and isinstance(function.get("name"), str):
            result.append(tool)
    return result


def _arguments_text(arguments: Any) -> str:
    """Serialize parsed arguments; only a JSON object is a valid OpenAI argument set."""
    if isinstance(arguments, str):
        # The JSON form may carry arguments as an already-encoded string.
        arguments = json.loads(arguments)
    if not isinstance(arguments, dict):
        raise ValueError(f"tool arguments must be an object, got {type(arguments).__name__}")
    # NaN and Infinity (Python's json reads them, and 1e999 as inf) are not JSON: clients' parsers
    # reject them, so such a call is no call (ValueError: its text stays content).
    return json.dumps(arguments, ensure_ascii=False, allow_nan=False)


def _to_tool_call(item: Any) -> ToolCall:
    if not isinstance(item, dict):
        raise ValueError("tool call is not an object")
    name = item.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ValueError("tool call has no name")
    # Some Qwen fine-tunes write "parameters" instead of "arguments".
    arguments = item.get("arguments", item.get("parameters", {}))
    return ToolCall(name=name.strip(), arguments=_arguments_text(arguments))


def _parse_qwen_xml(body: str, tools: list[dict[str, Any]]) -> Any:
    parser = _mlx_lm_parser(QWEN_XML)
    try:
        return parser.parse_tool_call(body, tools)
    except ValueError:
        # mlx-lm raises ValueError both for a broken structure and for a value that does not
        # fit the schema (say "abc" for an integer). Retrying without the schema separates the
        # two: a well-formed call keeps its raw string values instead of being lost, which is
        # also what vLLM does; a broken structure raises again.
        return parser.parse_tool_call(body, None)


GEMMA4_STRING = '<|"|>'  # Gemma 4's string delimiter
# A bare key after { or , (regex's \w, as mlx-lm's conversion has it).
_GEMMA4_BARE_KEY = regex.compile(r"(?<=[{,])(\w+):")


def gemma4_arguments_json(text: str) -> str:
    """A Gemma 4 call's `{...}` as JSON text: what mlx-lm's `_gemma4_args_to_json` gives, in one
    pass. Its version swaps each string for a placeholder and then replaces each placeholder in
    the whole text, quadratic in the strings of a call (a call of 20,000 string values took
    4.3 s, on the event loop, where every other stream waits)."""
    parts = text.split(GEMMA4_STRING)
    if len(parts) % 2 == 0:  # a string never closed: no JSON (mlx-lm leaves the delimiter, which fails)
        raise ValueError("a Gemma 4 string is not closed")
    # Even parts lie outside strings (their bare keys quoted), odd parts are strings.
    return "".join(json.dumps(part) if i % 2 else _GEMMA4_BARE_KEY.sub(r'"\1":', part) for i, part in enumerate(parts))


# The most time mlx-lm's Gemma 4 call pattern may take on one region. It is linear in well-formed
# calls (200 KB in 20 ms) but quadratic in unclosed ones: "call:f{" 2000 times took 2 s, on the
# event loop. A region that takes longer is no call: its text stays content.
GEMMA4_PATTERN_SECONDS = 0.5


# The names mlx-lm's Gemma 4 call pattern reads after "call:" (regex's \w and -).
GEMMA4_CALL_NAME = regex.compile(r"[\w-]+")


def _alias_gemma4_names(text: str, names: Sequence[str]) -> tuple[str, dict[str, str]]:
    """`text` with each call of a known tool whose name the call pattern stops in (a . or :, which
    tool names may hold: `web.search`) renamed, outside strings, to an alias it reads; and alias ->
    name, to put the names back."""
    unread = [name for name in names if not GEMMA4_CALL_NAME.fullmatch(name)]
    if not unread or "call:" not in text:
        return text, {}
    parts, aliases = text.split(GEMMA4_STRING), {}
    for i, name in enumerate(unread):
        alias = f"dflash_tool_{i}"
        while alias in text:
            alias += "_"
        aliases[alias] = name
        # (even parts lie outside strings: a string that mentions the call stays as written)
        parts = [part.replace(f"call:{name}{{", f"call:{alias}{{") if j % 2 == 0 else part for j, part in enumerate(parts)]
    return GEMMA4_STRING.join(parts), aliases


def parse_gemma4_calls(text: str, names: Sequence[str] = ()) -> list[dict[str, Any]]:
    """mlx-lm's Gemma 4 parse (`mlx_lm.tool_parsers.gemma4`: its call pattern, within
    `GEMMA4_PATTERN_SECONDS`), the arguments converted by `gemma4_arguments_json`. `names`: the
    request's tool names, so that those with a . or : are read too (`_alias_gemma4_names`)."""
    text, aliases = _alias_gemma4_names(text, names)
    try:
        matches = list(_mlx_lm_parser(GEMMA4)._tool_call_regex.finditer(text, timeout=GEMMA4_PATTERN_SECONDS))
    except TimeoutError as e:
        raise ValueError(f"no call found within {GEMMA4_PATTERN_SECONDS} s") from e
    if not matches:
        raise ValueError("no function call")
    return [dict(name=aliases.get(m.group(1), m.group(1)), arguments=json.loads(gemma4_arguments_json(m.group(2))))
            for m in matches]


def parse_tool_body(fmt: str, body: str, tools: Optional[Sequence[Any]] = None) -> list[ToolCall]:
    """Parse the text between one start and end marker into one or more calls.

    Raises ValueError (or another exception from the underlying parser) when the body is
    not a well-formed call; the caller falls back to plain content.
    """
    stripped = body.strip()
    if fmt == GEMMA4:
        names = [tool["function"]["name"] for tool in plain_tools(tools)]
        items = parse_gemma4_calls(stripped, names)  # (one region may hold several call:NAME{...})
    elif fmt in (QWEN_XML, QWEN_JSON):
        # Qwen checkpoints are trained on one form, but fine-tunes drift between the two;
        # the body's first character tells them apart unambiguously.
        if stripped.startswith("{"):
            items = [_mlx_lm_parser(QWEN_JSON).parse_tool_call(stripped)]
        else:
            items = [_parse_qwen_xml(stripped, plain_tools(tools))]
    else:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not items:
        raise ValueError("no tool call found")
    return [_to_tool_call(item) for item in items]


def tools_enabled(tools: Optional[Sequence[Any]], tool_choice: Any) -> bool:
    """Whether tool-call regions should be parsed: tools were given and not switched off."""
    return bool(tools) and tool_choice != "none"


# ---------------------------------------------------------------------------- markers


@dataclass(frozen=True)
class Markers:
    """The literal strings a chat template uses around reasoning and tool calls."""

    family: str = "plain"  # "qwen", "gemma4" or "plain"; informational
    reasoning_start: Optional[str] = None
    reasoning_end: Optional[str] = None
    tool_start: Optional[str] = None
    tool_end: Optional[str] = None
    tool_format: Optional[str] = None  # server.tool_calls.QWEN_XML / QWEN_JSON / GEMMA4

    @property
    def has_reasoning(self) -> bool:
        return bool(self.reasoning_start and self.reasoning_end)

    @property
    def has_tools(self) -> bool:
        return bool(self.tool_start and self.tool_end and self.tool_format)


PLAIN = Markers()
QWEN_XML_MARKERS = Markers("qwen", "<think>", "</think>", "<tool_call>", "</tool_call>", QWEN_XML)
QWEN_JSON_MARKERS = Markers("qwen", "<think>", "</think>", "<tool_call>", "</tool_call>", QWEN_JSON)
# Gemma 4 opens reasoning with the special token <|channel> followed by the word "thought";
# the pair is matched as one marker (as mlx-lm's _infer_thinking does).
GEMMA4_MARKERS = Markers(
    "gemma4", "<|channel>thought", "<channel|>", "<|tool_call>", "<tool_call|>", GEMMA4
)


def markers_for_tokenizer(
    chat_template: Optional[str], vocab: Optional[Mapping[str, int]] = None
) -> Markers:
    """Infer the markers from the chat template (preferred) or, lacking one, the vocab.

    Mirrors mlx-lm's `_infer_tool_parser` / `_infer_thinking` for the families the server
    supports. A template that never mentions a marker gets none, even when the vocab has
    the token: some instruct checkpoints keep <think> in the vocab but never emit it.
    """
    template = chat_template or ""
    vocab = vocab or {}

    def known(*tokens: str) -> bool:
        if template:
            return all(t in template for t in tokens)
        return all(t in vocab for t in tokens)

    tool_start = tool_end = tool_format = None
    if known("<|tool_call>", "<tool_call|>"):
        tool_start, tool_end, tool_format = "<|tool_call>", "<tool_call|>", GEMMA4
    elif "<tool_call>\\n<function=" in template or "<tool_call>\n<function=" in template:
        tool_start, tool_end, tool_format = "<tool_call>", "</tool_call>", QWEN_XML
    elif (template and "<tool_call>" in template and "tool_call.name" in template) or (
        not template and known("<tool_call>", "</tool_call>")
    ):
        # Without a template the vocab cannot tell XML from JSON; the body parser
        # detects the form per call anyway.
        tool_start, tool_end, tool_format = "<tool_call>", "</tool_call>", QWEN_JSON

    reasoning_start = reasoning_end = None
    if known("<think>", "</think>"):
        reasoning_start, reasoning_end = "<think>", "</think>"
    elif known("<|channel>", "<channel|>"):
        reasoning_start, reasoning_end = "<|channel>thought", "<channel|>"

    if tool_format == GEMMA4 or reasoning_end == "<channel|>":
        family = "gemma4"
    elif tool_format or reasoning_start:
        family = "qwen"
    else:
        family = "plain"
    return Markers(family, reasoning_start, reasoning_end, tool_start, tool_end, tool_format)


def prompt_starts_in_reasoning(prompt: str, markers: Markers) -> bool:
    """True when the rendered prompt ends inside an open reasoning block.

    Qwen3.5/3.6 with thinking on end the generation prompt with "<think>\\n"; with thinking
    off they end with an empty closed block, and Gemma 4 lets the model open its own.
    Only the prompt's tail counts, so a "<think>" quoted in a user message does not.
    """
    return bool(markers.reasoning_start) and prompt.rstrip().endswith(markers.reasoning_start)
