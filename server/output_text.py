"""Generated text -> OpenAI chat deltas: stop strings, reasoning split, tool calls.

Pure text processing (no HTTP, no MLX). The engine hands over the decoded text of each
commit (1..16 tokens, any of which may cut a marker or a stop string in two); this module
classifies it into `content`, `reasoning_content` and `tool_calls` deltas.

Pipeline, in this order:
1. `StopMatcher` on the raw generated text. Like vLLM, stop strings apply to everything the
   model generates, reasoning and markup included; the text is cut before the earliest
   occurrence and the stop string itself never appears. Completions use it alone.
2. `ChatOutputParser` splits what survives into reasoning, content and tool-call regions.

Conventions (identical for streaming and `parse_chat_output`, whatever the chunking):
- A reasoning block is recognised only at the very start of the output (after optional
  whitespace), or from the first character when the prompt already opened it
  (`starts_in_reasoning`). Markers later in the answer are ordinary text, so a model that
  writes about "<think>" tags is not misread.
- Whitespace directly touching a marker is template formatting, not text: it is dropped
  (the "\\n" after "<think>", the "\\n\\n" after "</think>", the "\\n\\n" before and the "\\n"
  between "<tool_call>" blocks). All other whitespace is kept.
- A tool-call region that does not parse, or is still open at the end, is emitted verbatim
  as content, markers and surrounding whitespace included. Model output never raises.
- Decode without skipping special tokens: Gemma 4's markers are special tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Sequence, Union

from .tool_calls import (
    GEMMA4_MARKERS,
    PLAIN,
    QWEN_JSON_MARKERS,
    QWEN_XML_MARKERS,
    Markers,
    ToolCall,
    markers_for_tokenizer,
    parse_tool_body,
    plain_tools,
    prompt_starts_in_reasoning,
    tools_enabled,
)

__all__ = [
    "Markers", "PLAIN", "QWEN_XML_MARKERS", "QWEN_JSON_MARKERS", "GEMMA4_MARKERS",
    "markers_for_tokenizer", "prompt_starts_in_reasoning", "StopMatcher", "Delta",
    "ToolCallDelta", "ChatOutputParser", "ParsedOutput", "parse_chat_output",
    "collect_deltas", "delta_to_openai", "ToolCall",
]


# ---------------------------------------------------------------------- stop strings


def _partial_len(text: str, pattern: str) -> int:
    """Length of the longest proper prefix of `pattern` that `text` ends with."""
    for k in range(min(len(pattern) - 1, len(text)), 0, -1):
        if text.endswith(pattern[:k]):
            return k
    return 0


class StopMatcher:
    """Cuts a text stream before the earliest occurrence of any stop string.

    `feed` returns the text that is safe to show; a tail that could still become a stop
    string is held back until disambiguated, and `finish` releases it. Once `matched` is
    set, the generation should end and all further text is discarded.
    """

    def __init__(self, stop: Union[str, Sequence[str], None] = None) -> None:
        if isinstance(stop, str):
            stop = [stop]
        # Empty strings would match everywhere; duplicates only cost time.
        self.stops: tuple[str, ...] = tuple(s for s in dict.fromkeys(stop or ()) if s)
        self.matched: Optional[str] = None
        self.matched_end: Optional[int] = None  # characters fed, through the end of the match
        self._released = 0  # characters returned by feed/finish so far
        self._buf = ""

    def feed(self, text: str) -> str:
        if self.matched is not None:
            return ""
        if not self.stops:
            return text
        self._buf += text
        return self._drain(final=False)

    def finish(self) -> str:
        if self.matched is not None:
            return ""
        return self._drain(final=True)

    def _drain(self, final: bool) -> str:
        buf = self._buf
        hit, hit_at = None, len(buf)
        for stop in self.stops:
            i = buf.find(stop)
            if 0 <= i < hit_at:
                hit, hit_at = stop, i
        # Earliest position where a stop string may still be completing.
        open_at = len(buf) if final else len(buf) - max(_partial_len(buf, s) for s in self.stops)
        if hit is not None and hit_at <= open_at:
            # No longer stop string can still complete at an earlier position, so this is
            # the earliest occurrence whatever text follows: the cut is chunking-independent.
            self.matched, self.matched_end = hit, self._released + hit_at + len(hit)
            self._buf = ""
            return buf[:hit_at]
        cut = min(open_at, hit_at)
        self._buf = buf[cut:]
        self._released += cut
        return buf[:cut]


# ---------------------------------------------------------------------------- deltas


@dataclass
class ToolCallDelta:
    """One `delta.tool_calls[]` entry: the first for a call carries id and name."""

    index: int
    id: Optional[str] = None
    name: Optional[str] = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"index": self.index}
        function: dict[str, Any] = {"arguments": self.arguments}
        if self.id is not None:
            entry["id"] = self.id
            entry["type"] = "function"
        if self.name is not None:
            function["name"] = self.name
        entry["function"] = function
        return entry


@dataclass
class Delta:
    """One piece of output; exactly one field is set."""

    content: Optional[str] = None
    reasoning: Optional[str] = None
    tool_call: Optional[ToolCallDelta] = None


def delta_to_openai(delta: Delta) -> dict[str, Any]:
    """The `choices[0].delta` object of a chat.completion.chunk."""
    if delta.tool_call is not None:
        return {"tool_calls": [delta.tool_call.to_openai()]}
    if delta.reasoning is not None:
        return {"reasoning_content": delta.reasoning}
    return {"content": delta.content or ""}


class _Out:
    """Collects deltas, merging adjacent text of one kind so a commit makes few chunks."""

    def __init__(self) -> None:
        self.deltas: list[Delta] = []

    def text(self, reasoning: bool, text: str) -> None:
        if not text:
            return
        last = self.deltas[-1] if self.deltas else None
        if last is not None and reasoning and last.reasoning is not None:
            last.reasoning += text
        elif last is not None and not reasoning and last.content is not None:
            last.content += text
        elif reasoning:
            self.deltas.append(Delta(reasoning=text))
        else:
            self.deltas.append(Delta(content=text))

    def tool(self, delta: ToolCallDelta) -> None:
        self.deltas.append(Delta(tool_call=delta))


# ---------------------------------------------------------------------------- parser

_CONTENT, _REASONING, _TOOL = "content", "reasoning", "tool"


class ChatOutputParser:
    """Streaming classifier for one chat choice.

    feed(text) -> deltas for newly decided text; finish() -> the rest. After `stop_matched`
    is set (feed already flushed everything), the caller ends the generation.
    """

    def __init__(
        self,
        markers: Markers = PLAIN,
        tools: Optional[Sequence[Any]] = None,
        tool_choice: Any = None,
        stop: Union[str, Sequence[str], None] = None,
        starts_in_reasoning: bool = False,
        single_call: bool = False,
    ) -> None:
        self.markers = markers
        self._stop = StopMatcher(stop)
        self._single_call = single_call  # parallel_tool_calls false: the output ends with its first call
        self._model_chars = 0  # model text past the stop strings, into _buf
        self.call_end: Optional[int] = None  # single_call: characters of model text through that call
        self._tools = plain_tools(tools)
        self._tools_on = markers.has_tools and tools_enabled(self._tools, tool_choice)
        in_reasoning = starts_in_reasoning and markers.has_reasoning
        self._state = _REASONING if in_reasoning else _CONTENT
        # A reasoning block may still open: nothing but whitespace has been generated.
        self._at_start = markers.has_reasoning and not in_reasoning
        # The prompt ended with the opening marker, so leading whitespace is its formatting.
        self._strip_leading = in_reasoning
        self._pending_ws = ""  # trailing whitespace held until we know if a marker follows
        self._tool_ws = ""  # whitespace dropped before the open tool call, for the fallback
        self._tool_scanned = 0  # how far the open tool body was searched for the end marker
        self._buf = ""  # undecided text (after stop-string processing)
        self._done = False
        self.tool_calls: list[ToolCall] = []

    @property
    def stop_matched(self) -> Optional[str]:
        """The stop string that ended the output, if any."""
        return self._stop.matched

    @property
    def stop_end(self) -> Optional[int]:
        """Characters of model text through the end of the matched stop string."""
        return self._stop.matched_end

    @property
    def end(self) -> Optional[int]:
        """Where the output was cut (a stop string, or the only call allowed), in characters of
        model text; None when the model ended it."""
        return self.stop_end if self.stop_end is not None else self.call_end

    def finish_reason(self, engine_reason: str) -> str:
        """OpenAI finish_reason: "tool_calls" if a call was parsed, "stop" after a stop string."""
        if self.tool_calls:
            return "tool_calls"
        if self.stop_matched is not None:
            return "stop"
        return engine_reason

    def feed_forced(self, text: str) -> list[Delta]:
        """Text the server wrote for the model (a forced tool-call opening): parsed as output,
        but not model text, so stop strings do not apply to it."""
        if self._done or not text:
            return []
        out = _Out()
        self._buf += text
        self._process(out, final=False)
        return out.deltas

    def feed(self, text: str) -> list[Delta]:
        if self._done:
            return []
        out = _Out()
        released = self._stop.feed(text)
        self._model_chars += len(released)
        self._buf += released
        if self._stop.matched is not None:
            self._end(out)
        else:
            self._process(out, final=False)
        return out.deltas

    def finish(self) -> list[Delta]:
        if self._done:
            return []
        out = _Out()
        released = self._stop.finish()
        self._model_chars += len(released)
        self._buf += released
        self._end(out)
        return out.deltas

    # -- internals

    def _end(self, out: _Out) -> None:
        self._process(out, final=True)
        # No marker can follow any more, so held whitespace is real text.
        out.text(self._state == _REASONING, self._pending_ws)
        self._pending_ws = ""
        self._done = True

    def _process(self, out: _Out, final: bool) -> None:
        m = self.markers
        while True:
            if self._state == _TOOL:
                if not self._close_tool(out, final):
                    return
            elif self._state == _REASONING:
                text, found = self._split_at(m.reasoning_end or "", final)
                self._emit(out, text)
                if not found:
                    return
                self._pending_ws = ""  # whitespace before the end marker
                self._state = _CONTENT
                self._strip_leading = True  # and after it
            elif self._at_start:
                if not self._open_reasoning(final):
                    return
            elif self._tools_on:
                text, found = self._split_at(m.tool_start or "", final)
                self._emit(out, text)
                if not found:
                    return
                self._tool_ws, self._pending_ws = self._pending_ws, ""
                self._state = _TOOL
                self._tool_scanned = 0
            else:
                self._emit(out, self._buf)
                self._buf = ""
                return

    def _split_at(self, marker: str, final: bool) -> tuple[str, bool]:
        """Take the buffer up to `marker` (consumed). Without a full marker, take what
        cannot be the marker's beginning and keep the possible partial marker."""
        i = self._buf.find(marker)
        if i >= 0:
            text, self._buf = self._buf[:i], self._buf[i + len(marker):]
            return text, True
        keep = 0 if final else _partial_len(self._buf, marker)
        cut = len(self._buf) - keep
        text, self._buf = self._buf[:cut], self._buf[cut:]
        return text, False

    def _open_reasoning(self, final: bool) -> bool:
        """At the start of the output: enter reasoning if the opening marker comes first.
        Returns False to wait for more text."""
        start = self.markers.reasoning_start or ""
        rest = self._buf.lstrip()
        if not rest and not final:
            return False
        if rest.startswith(start):
            self._buf = rest[len(start):]
            self._state = _REASONING
            self._strip_leading = True
            self._at_start = False
            return True
        if rest and start.startswith(rest) and not final:
            return False
        self._at_start = False
        return True

    def _close_tool(self, out: _Out, final: bool) -> bool:
        """Inside a tool-call region: parse it once its end marker arrived.
        Returns False to wait for more text."""
        m = self.markers
        end = m.tool_end or ""
        i = self._buf.find(end, max(0, self._tool_scanned - len(end) + 1))
        if i < 0:
            self._tool_scanned = len(self._buf)
            if not final:
                return False
            # Still open at the end (length limit or stop string): show it as it was.
            raw, self._buf = self._tool_ws + (m.tool_start or "") + self._buf, ""
            self._state = _CONTENT
            self._emit(out, raw)
            return True
        body, self._buf = self._buf[:i], self._buf[i + len(end):]
        self._state = _CONTENT
        try:
            calls = parse_tool_body(m.tool_format or "", body, self._tools)
        except Exception:
            # Deliberately broad: whatever the model wrote, and whatever the reused parser
            # raises for it, the response must go on; the text becomes content.
            calls = []
        if not calls:
            self._emit(out, self._tool_ws + (m.tool_start or "") + body + end)
            return True
        for call in calls[:1] if self._single_call else calls:
            index = len(self.tool_calls)
            self.tool_calls.append(call)
            out.tool(ToolCallDelta(index=index, id=call.id, name=call.name, arguments=""))
            out.tool(ToolCallDelta(index=index, arguments=call.arguments))
        if self._single_call:  # nothing after the call is output
            self.call_end = self._model_chars - len(self._buf)
            self._buf, self._pending_ws, self._done = "", "", True
            return False
        self._strip_leading = True  # the "\n" between or after calls
        return True

    def _emit(self, out: _Out, text: str) -> None:
        """Emit decided text in the current state, applying the whitespace conventions."""
        if not text:
            return
        if self._strip_leading:
            text = text.lstrip()
            if not text:
                return
            self._strip_leading = False
        reasoning = self._state == _REASONING
        if not (reasoning or self._tools_on):
            # No marker can follow plain content: nothing to hold back.
            out.text(False, self._pending_ws + text)
            self._pending_ws = ""
            return
        text = self._pending_ws + text
        body = text.rstrip()
        self._pending_ws = text[len(body):]
        out.text(reasoning, body)


# ---------------------------------------------------------------------- whole output


class ParsedOutput(NamedTuple):
    content: Optional[str]
    reasoning_content: Optional[str]
    tool_calls: list[ToolCall]
    stop_matched: Optional[str]


def collect_deltas(deltas: Sequence[Delta]) -> tuple[str, str, list[tuple[str, str]]]:
    """Join streamed deltas: (content, reasoning, [(name, arguments)] in index order),
    the way an OpenAI client accumulates them."""
    content: list[str] = []
    reasoning: list[str] = []
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.content is not None:
            content.append(d.content)
        if d.reasoning is not None:
            reasoning.append(d.reasoning)
        if d.tool_call is not None:
            entry = calls.setdefault(d.tool_call.index, ["", ""])
            entry[0] += d.tool_call.name or ""
            entry[1] += d.tool_call.arguments
    return "".join(content), "".join(reasoning), [(n, a) for _, (n, a) in sorted(calls.items())]


def parse_chat_output(
    text: str,
    markers: Markers = PLAIN,
    tools: Optional[Sequence[Any]] = None,
    tool_choice: Any = None,
    stop: Union[str, Sequence[str], None] = None,
    starts_in_reasoning: bool = False,
) -> ParsedOutput:
    """Non-streaming: classify a whole generated text at once.

    Runs the streaming parser over the text, so the result equals what the stream yields.
    `content` is None when empty and a tool was called (as OpenAI returns it);
    `reasoning_content` is None when there was none.
    """
    parser = ChatOutputParser(markers, tools, tool_choice, stop, starts_in_reasoning)
    deltas = parser.feed(text) + parser.finish()
    content, reasoning, _ = collect_deltas(deltas)
    return ParsedOutput(
        content=content if content or not parser.tool_calls else None,
        reasoning_content=reasoning or None,
        tool_calls=list(parser.tool_calls),
        stop_matched=parser.stop_matched,
    )
