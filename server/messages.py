"""Anthropic's Messages API: `POST /v1/messages` (streamed and not) and `POST
/v1/messages/count_tokens`. What Claude Code speaks.

A request is translated into a chat completion request (`to_chat`) and generated through the same
path as chat completions (`serving.start_chat`); `MessageBuilder` turns the parsed deltas into
content blocks and, when streamed, into Anthropic's events. Errors use Anthropic's shape
(`errors.APIError.anthropic_body`).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from typing import Any, AsyncIterator, Optional

from fastapi import APIRouter, Request

from . import chat
from .errors import APIError, bad_request
from .generation import HEARTBEAT, ChatOutput, Run, named_sse
from .messages_schemas import (
    CountTokensRequest,
    MessagesRequest,
    RedactedThinkingBlock,
    TextBlock,
    ThinkingBlock,
    Tool,
    ToolReferenceBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from .output_text import Delta
from .schemas import ChatCompletionRequest
from .serving import ServerState, respond, start_chat

PING_EVERY = 5.0  # seconds between pings while a long prompt prefills


def _text(content) -> str:
    return content if isinstance(content, str) else "\n".join(b.text for b in content if isinstance(b, TextBlock))


def tool_result_text(block: ToolResultBlock, tools: dict[str, Tool], loaded: set[str]) -> str:
    """A tool result as the model reads it: its text, with each run of tool_reference blocks (a
    tool search's answer) written as the definitions they load, one `<function>` line per tool in a
    `<functions>` block, where they stand. The definitions go here, not into the prompt's tool list,
    so that the conversation before them (and its cached prefix) stays as it was. A tool already
    `loaded` earlier in the conversation is named, not written out again (a reference repeated
    thousands of times would otherwise make a small request a prompt of gigabytes)."""
    content = block.content if isinstance(block.content, list) else [TextBlock(type="text", text=block.content or "")]
    parts: list[str] = []
    for referencing, run in itertools.groupby(content, key=lambda part: isinstance(part, ToolReferenceBlock)):
        if referencing:
            lines = []
            for r in run:
                lines.append(_loaded_definition(r.tool_name, tools) if r.tool_name not in loaded
                             else f"<function>{json.dumps({'name': r.tool_name})}</function>")
                loaded.add(r.tool_name)
            parts.append("<functions>\n" + "\n".join(lines) + "\n</functions>")
        else:
            parts += [part.text for part in run]
    text = "\n".join(parts)
    return f"Error: {text}" if block.is_error else text


def _loaded_definition(name: str, tools: dict[str, Tool]) -> str:
    tool = tools.get(name)
    if tool is None:
        raise bad_request(f"a tool_reference names {name!r}, which is not among the request's tools", param="messages")
    definition = {"description": tool.description or "", "name": tool.name, "parameters": tool.input_schema}
    return f"<function>{json.dumps(definition, ensure_ascii=False)}</function>"


def chat_messages(body) -> list[dict]:
    """Anthropic messages -> chat messages: tool_result blocks become tool messages (before the
    user's text, as Anthropic requires them first), tool_use blocks the assistant's tool calls,
    thinking blocks its reasoning_content."""
    tools = {t.name: t for t in body.tools or ()}
    loaded: set[str] = set()  # the deferred tools whose definitions a tool_reference wrote out
    messages = [{"role": "system", "content": _text(body.system)}] if body.system else []
    called: set[str] = set()  # the ids of the tool_use blocks so far
    for i, message in enumerate(body.messages):
        blocks = [TextBlock(type="text", text=message.content)] if isinstance(message.content, str) else message.content
        if message.role == "assistant":
            out: dict[str, Any] = {"role": "assistant"}
            said, thought = [], []  # (joined once: adding to a string block by block is quadratic)
            for block in blocks:
                if isinstance(block, TextBlock):
                    said.append(block.text)
                elif isinstance(block, ThinkingBlock):
                    thought.append(block.thinking)
                elif isinstance(block, ToolUseBlock):
                    called.add(block.id)
                    out.setdefault("tool_calls", []).append(
                        {"id": block.id, "type": "function",
                         "function": {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
                elif not isinstance(block, RedactedThinkingBlock):
                    raise bad_request(f"a {block.type} block cannot be in an assistant message", param="messages")
            out["content"] = "".join(said)
            if thought:
                out["reasoning_content"] = "".join(thought)
            messages.append(out)
            continue
        text = []
        for j, block in enumerate(blocks):
            if isinstance(block, ToolResultBlock):
                if block.tool_use_id not in called:
                    raise bad_request(f"unexpected tool_use_id {block.tool_use_id!r} in a tool_result block: it must "
                                      "answer a tool_use block of an earlier assistant message",
                                      param=f"messages.{i}.content.{j}.tool_use_id")
                messages.append({"role": "tool", "tool_call_id": block.tool_use_id,
                                 "content": tool_result_text(block, tools, loaded)})
            elif isinstance(block, TextBlock):
                text.append(block.text)
            else:
                raise bad_request(f"a {block.type} block cannot be in a {message.role} message", param="messages")
        if text or not any(isinstance(b, ToolResultBlock) for b in blocks):
            messages.append({"role": message.role, "content": "".join(text)})
    return messages


def _thinking(body) -> Optional[bool]:
    thinking = body.thinking
    if thinking is None:
        return None
    if thinking.type == "adaptive":
        return not (body.output_config and body.output_config.effort == "low")
    return thinking.type == "enabled"


def _tool_choice(body):
    choice = body.tool_choice
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise bad_request("tool_choice of type tool needs a name", param="tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]


def _shown_tools(body) -> list[Tool]:
    """The tools the prompt's tool list shows: all but the deferred ones (`defer_loading`), unless
    tool_choice names one (the call is then forced, so the model needs its definition)."""
    named = body.tool_choice.name if body.tool_choice and body.tool_choice.type == "tool" else None
    for tool in body.tools or ():
        if tool.defer_loading and tool.strict:
            # Strict calls are enforced by a grammar over the listed tools, which a deferred tool is not.
            raise bad_request(f"tool {tool.name!r}: a deferred tool cannot be strict here", param="tools")
    if body.tools and all(t.defer_loading for t in body.tools):
        raise bad_request("at least one tool must not be deferred (defer_loading)", param="tools")  # as Anthropic answers
    return [t for t in body.tools or () if not t.defer_loading or t.name == named]


def _chat_tool(tool: Tool) -> dict:
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": tool.input_schema, "strict": tool.strict}}


def to_chat(body, max_tokens: int = 1) -> ChatCompletionRequest:
    forced = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
    if forced and body.thinking is not None and body.thinking.type == "enabled":
        # A forced call starts the answer, so there is no room to think first: Anthropic refuses
        # the combination, rather than turning thinking off unasked.
        raise bad_request("thinking may not be enabled when tool_choice forces tool use (type any or tool)",
                          param="thinking")
    shown = _shown_tools(body)
    tools = [_chat_tool(t) for t in shown]
    thinking = _thinking(body)
    fmt = body.output_config.format if body.output_config else None
    request = {
        "model": body.model, "messages": chat_messages(body), "tools": tools or None, "tool_choice": _tool_choice(body),
        "parallel_tool_calls": False if body.tool_choice and body.tool_choice.disable_parallel_tool_use else None,
        "max_tokens": max_tokens, "chat_template_kwargs": None if thinking is None else {"enable_thinking": thinking},
        "response_format": {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}} if fmt else None,
        "max_reasoning_tokens": body.thinking.budget_tokens if thinking else None,  # (enabled or adaptive, on)
    }
    if isinstance(body, MessagesRequest):
        request.update(temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                       user=body.metadata.user_id if body.metadata else None, dflash=body.dflash)
    try:
        chat_request = ChatCompletionRequest.model_validate({k: v for k, v in request.items() if v is not None})
    except ValueError as e:
        raise bad_request(f"invalid request: {e}") from e
    # The deferred tools the prompt does not list: a tool_reference may have loaded them, and their
    # calls are read with their schemas (a Qwen XML call's values are typed by it).
    chat_request._unlisted_tools = [_chat_tool(t) for t in body.tools or () if all(t is not s for s in shown)]
    if isinstance(body, MessagesRequest) and body.stop_sequences:
        # Set after validation: the chat request's limit of 4 is OpenAI's; Anthropic's API has none.
        chat_request.stop = list(body.stop_sequences)
    return chat_request


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


class MessageBuilder:
    """Parsed deltas -> content blocks, and the content_block_* events that build them."""

    def __init__(self, omit_thinking: bool = False):
        self.blocks: list[dict] = []
        self._open: Optional[str] = None  # the type of the block being written
        # thinking.display "omitted": the thinking blocks come without their text (as Anthropic
        # sends them then); the model still thinks, and the answer after it is the same.
        self.omit_thinking = omit_thinking

    def feed(self, delta: Delta) -> list[dict]:
        if delta.tool_call is not None:
            call = delta.tool_call
            if call.id is not None:
                block = {"type": "tool_use", "id": "toolu_" + call.id.removeprefix("call_"), "name": call.name,
                         "input": {}}
                return self.close() + self._start(block)
            self.blocks[-1]["_json"] = self.blocks[-1].get("_json", "") + call.arguments
            return [self._delta({"type": "input_json_delta", "partial_json": call.arguments})]
        kind, text = ("thinking", delta.reasoning) if delta.reasoning is not None else ("text", delta.content)
        if not text:
            return []
        events = []
        if self._open != kind:
            empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
            events = self.close() + self._start(empty)
        if kind == "thinking" and self.omit_thinking:
            return events
        self.blocks[-1][kind] += text
        name = "thinking_delta" if kind == "thinking" else "text_delta"
        return events + [self._delta({"type": name, kind: text})]

    def _start(self, block: dict) -> list[dict]:
        self.blocks.append(block)
        self._open = block["type"]
        return [{"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": dict(block)}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def close(self) -> list[dict]:
        if self._open is None:
            return []
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            block["input"] = json.loads(block.pop("_json", "") or "{}")
        self._open = None
        stop = {"type": "content_block_stop", "index": len(self.blocks) - 1}
        if block["type"] == "thinking":  # Anthropic ends a thinking block with its signature; we sign nothing
            return [self._delta({"type": "signature_delta", "signature": ""}), stop]
        return [stop]


class MessagesResponder:
    def __init__(self, body: MessagesRequest, run: Run, output: ChatOutput):
        self.body, self.run, self.output = body, run, output
        self.builder = MessageBuilder(omit_thinking=bool(body.thinking and body.thinking.display == "omitted"))
        self.id = _id("msg")

    def stop(self) -> tuple[str, Optional[str]]:
        reason = self.output.finish_reason
        if reason == "tool_calls":
            return "tool_use", None
        if reason == "length":
            # Cut by the model's context before max_tokens: a larger max_tokens would not help.
            if self.output.usage()["completion_tokens"] < self.body.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        matched = self.output.parser.stop_matched
        return ("stop_sequence", matched) if matched is not None else ("end_turn", None)

    def usage(self) -> dict:
        usage = self.output.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        # Anthropic's input_tokens are the ones not read from the cache.
        return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": 0}

    def message(self, content: list, stop_reason=None, stop_sequence=None, usage=None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.run.served.name, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": usage or {"input_tokens": len(self.run.prompt.tokens), "output_tokens": 0,
                                   "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0}}

    async def stream(self, include_usage: bool) -> AsyncIterator[dict]:
        yield named_sse({"type": "message_start", "message": self.message([])})
        yield named_sse({"type": "ping"})
        last_event = time.monotonic()
        try:
            async for delta in self.output.deltas():
                if delta is HEARTBEAT:
                    if time.monotonic() - last_event >= PING_EVERY:
                        last_event = time.monotonic()
                        yield named_sse({"type": "ping"})
                    continue
                for event in self.builder.feed(delta):
                    last_event = time.monotonic()
                    yield named_sse(event)
        except APIError as e:
            yield named_sse(e.anthropic_body())
            return
        for event in self.builder.close():
            yield named_sse(event)
        reason, sequence = self.stop()
        yield named_sse({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": self.usage(), "dflash": self.run.report()})
        yield named_sse({"type": "message_stop"})

    async def complete(self) -> dict:
        async for delta in self.output.deltas():
            if delta is not HEARTBEAT:
                self.builder.feed(delta)
        self.builder.close()
        reason, sequence = self.stop()
        return {**self.message(self.builder.blocks, reason, sequence, self.usage()), "dflash": self.run.report()}


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/messages")
    async def create(body: MessagesRequest, request: Request):
        chat.refuse_surrogates(body)
        if body.messages[-1].role == "assistant":
            # Anthropic's API continues a final assistant message (a prefill); the chat templates
            # here close it and open a new turn, so it is refused as Anthropic refuses it for
            # models without prefill, rather than answered as a fresh turn.
            raise bad_request("a final assistant message (prefill) is not supported: the conversation must end "
                              "with a user message", param=f"messages[{len(body.messages) - 1}]")
        started = await start_chat(state, to_chat(body, body.max_tokens), time.perf_counter())
        responder = MessagesResponder(body, started.run, started.output)
        return await respond(state, "messages", request, started.run, responder, stream=bool(body.stream))

    @routes.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest):
        chat.refuse_surrogates(body)
        request = to_chat(body)
        chat.refuse_unsupported(request)
        served = await state.pool.get(body.model)
        try:
            defaults = state.settings.template_defaults(served.settings)
            prompt = await asyncio.to_thread(chat.chat_prompt, request, served.engine.tokenizer, served.markers, defaults)
        finally:
            state.pool.release(served)
        return {"input_tokens": len(prompt.tokens)}

    return routes
