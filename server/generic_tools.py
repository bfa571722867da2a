"""Tools for a model whose chat template cannot render them (Gemma 3, base models).

Instead of refusing the request, the server writes the tools into the system prompt in the
widespread Hermes/Qwen2.5 form and asks for calls as JSON between <tool_call> tags; earlier calls
and their results are written into the conversation the same way, so the template only ever sees
plain user, assistant and system text. The output is parsed with the JSON tool-call parser
(`GENERIC_MARKERS`). Documented in README.md ("Tools on any model").
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any, Optional

from .tool_calls import QWEN_JSON, Markers

TOOL_START, TOOL_END = "<tool_call>", "</tool_call>"


def generic_markers(markers: Markers) -> Markers:
    """The model's own reasoning markers, with the generic tool-call form."""
    return replace(markers, tool_start=TOOL_START, tool_end=TOOL_END, tool_format=QWEN_JSON)


def tools_prompt(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n"
        '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


def _call_text(call: dict) -> str:
    function = call["function"]
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass  # shown as the string it is; the template check happens elsewhere
    body = json.dumps({"name": function["name"], "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_START}\n{body}\n{TOOL_END}"


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def render_messages(messages: list[dict], tools: Optional[list[dict]]) -> list[dict]:
    """Messages with tool calls and results written as text, the tools prompt in the system
    message (a new one when there is none)."""
    out: list[dict] = []
    for m in messages:
        role = m.get("role")
        if role == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"})
        elif role == "assistant" and m.get("tool_calls"):
            parts = [_text(m.get("content")).strip()] + [_call_text(c) for c in m["tool_calls"]]
            rest = {k: v for k, v in m.items() if k not in ("tool_calls", "content")}
            out.append({**rest, "content": "\n".join(p for p in parts if p)})
        else:
            out.append(m)
    if tools:
        prompt = tools_prompt(tools)
        if out and out[0].get("role") in ("system", "developer"):
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
