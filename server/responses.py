"""OpenAI's Responses API: `POST /v1/responses` (streamed and not), `GET` and `DELETE
/v1/responses/{id}`. What Codex CLI speaks.

A request is translated into a chat completion request (`to_chat`) and generated through the same
path as chat completions (`serving.start_chat`); `ResponseBuilder` turns the parsed deltas into
output items and, when streamed, into the documented events in order, each with its
`sequence_number`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from fastapi import APIRouter, Request

from . import chat
from .errors import APIError, bad_request
from .generation import HEARTBEAT, ChatOutput, Run, named_sse
from .logprobs import TokenText, entry
from .output_text import Delta
from .responses_schemas import (
    CustomTool,
    CustomToolCallItem,
    FunctionCallItem,
    FunctionCallOutputItem,
    MessageItem,
    NamedTool,
    NamespaceTool,
    ReasoningItem,
    ResponsesRequest,
)
from .schemas import ChatCompletionRequest, Sampling, unanswered_result
from .serving import ServerState, respond, start_chat

log = logging.getLogger(__name__)


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ tools


@dataclass
class ToolNames:
    """How the request's tools are shown to the model (all as functions) and mapped back."""

    functions: list[dict] = field(default_factory=list)  # chat-completions tool entries
    custom: set[str] = field(default_factory=set)  # shown names of free-form tools
    namespace: dict[str, tuple[str, str]] = field(default_factory=dict)  # shown -> (namespace, name)

    def shown(self, name: str, namespace: Optional[str]) -> str:
        # "__" as MCP's tool names join a server's and a tool's: every family's call form reads it
        # as part of a name, where Gemma 4's call:NAME stops at a "." (the call came back as text).
        return f"{namespace}__{name}" if namespace else name


def _function_entry(name: str, tool) -> dict:
    if isinstance(tool, CustomTool):
        fmt = tool.format
        hint = ""
        if fmt is not None and fmt.type == "grammar" and fmt.definition:
            hint = f" The input must follow this {fmt.syntax or 'lark'} grammar:\n{fmt.definition}"
        parameters = {"type": "object", "required": ["input"],
                      "properties": {"input": {"type": "string", "description": "The tool's raw input." + hint}}}
        return {"type": "function", "function": {"name": name, "description": tool.description or "",
                                                 "parameters": parameters}}
    entry = {"name": name, "parameters": tool.parameters or {"type": "object", "properties": {}}}
    if tool.description:
        entry["description"] = tool.description
    if tool.strict:
        entry["strict"] = True
    return {"type": "function", "function": entry}


def tool_names(tools) -> ToolNames:
    names = ToolNames()
    for tool in tools or ():
        members = tool.tools if isinstance(tool, NamespaceTool) else [tool]
        for member in members:
            namespace = tool.name if isinstance(tool, NamespaceTool) else None
            shown = names.shown(member.name, namespace)
            names.functions.append(_function_entry(shown, member))
            if isinstance(member, CustomTool):
                names.custom.add(shown)
            if namespace:
                names.namespace[shown] = (namespace, member.name)
    return names


# ------------------------------------------------------------------------------ input


def input_messages(items, names: ToolNames) -> list[dict]:
    """Input items -> chat messages: a reasoning item opens (or joins) the assistant message that
    the output items after it fill; function calls join the assistant message before them."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict] = []
    # An assistant message's text and reasoning as parts, joined at the end (adding to a string item
    # by item is quadratic: 250,000 items held the event loop for 44 s).
    said: dict[int, list[str]] = {}
    thought: dict[int, list[str]] = {}

    def assistant() -> dict:
        if not messages or messages[-1]["role"] != "assistant":
            messages.append({"role": "assistant", "content": ""})
        return messages[-1]

    for item in items:
        if isinstance(item, MessageItem):
            if item.role == "assistant":
                assistant()
                said.setdefault(len(messages) - 1, []).append(item.text())
            else:
                messages.append({"role": item.role, "content": item.text()})
        elif isinstance(item, (FunctionCallItem, CustomToolCallItem)):
            arguments = item.arguments if isinstance(item, FunctionCallItem) else json.dumps({"input": item.input})
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": names.shown(item.name, item.namespace), "arguments": arguments}}
            assistant().setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
        elif isinstance(item, ReasoningItem) and item.text():
            assistant()
            thought.setdefault(len(messages) - 1, []).append(item.text())
    for i, parts in said.items():
        messages[i]["content"] = "".join(parts)
    for i, parts in thought.items():
        messages[i]["reasoning_content"] = "\n\n".join(parts)
    return messages


def _response_format(body: ResponsesRequest) -> Optional[dict]:
    fmt = body.text.format if body.text else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None:
        raise bad_request("text.format json_schema needs a schema", param="text.format.schema")
    return {"type": "json_schema", "json_schema": {"name": fmt.name or "response", "schema": fmt.schema_,
                                                  "strict": fmt.strict}}


def to_chat(body: ResponsesRequest, history: list[dict], names: ToolNames) -> tuple[ChatCompletionRequest, list[dict]]:
    """The chat request to generate, and the conversation (without instructions) to store."""
    conversation = history + input_messages(body.input, names)
    if not conversation:
        raise bad_request("input is empty", param="input")
    unanswered = unanswered_result(conversation)
    if unanswered is not None:
        raise bad_request(f"no tool call found for the output with call_id {unanswered[1]!r}: a function call with "
                          "that call_id must come before it (in input, or in the previous response)", param="input")
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conversation
    choice = body.tool_choice
    if isinstance(choice, NamedTool):
        choice = {"type": "function", "function": {"name": choice.name}}
    template: dict[str, Any] = {}
    effort = body.reasoning.effort if body.reasoning else None
    if effort is not None:
        template["enable_thinking"] = effort not in ("none", "minimal")
    logprobs = bool(body.include and "message.output_text.logprobs" in body.include)
    request = {
        "model": body.model, "messages": messages, "tools": names.functions or None, "tool_choice": choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        **{name: getattr(body, name) for name in Sampling.model_fields},
        "max_tokens": body.max_output_tokens, "chat_template_kwargs": template or None,
        "response_format": _response_format(body), "user": body.user or body.safety_identifier,
        "logprobs": logprobs or None, "top_logprobs": body.top_logprobs if logprobs else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in request.items() if v is not None}), conversation
    except ValueError as e:  # a value that passed our schema but not the chat one (say, a bad tool choice)
        raise bad_request(f"invalid request: {e}") from e


# ------------------------------------------------------------------------------ output


class ResponseBuilder:
    """Parsed deltas -> output items, and the stream events that build them."""

    def __init__(self, names: ToolNames):
        self.names = names
        self.output: list[dict] = []
        self.sequence = 0
        self._open: Optional[dict] = None  # the item being written

    def event(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _where(self) -> dict:
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}

    def feed(self, delta: Delta, logprobs: Sequence[dict] = ()) -> list[dict]:
        """Events for one delta; `logprobs`: output_text entries of the tokens behind it."""
        if delta.tool_call is not None:
            if delta.tool_call.id is not None:  # a new call: name and id come first
                return self.close() + self._open_call(delta.tool_call.id, delta.tool_call.name)
            return self._call_arguments(delta.tool_call.arguments)
        kind = "reasoning" if delta.reasoning is not None else "message"
        text = delta.reasoning if delta.reasoning is not None else delta.content
        if not text:
            return []
        events = [] if self._open is not None and self._open["type"] == kind else self.close() + self._open_text(kind)
        part = self._open["content"][0]
        part["text"] += text
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        extra = {}
        if kind == "message":
            part["logprobs"] += logprobs
            extra = {"logprobs": list(logprobs)}
        return events + [self.event(name, **self._where(), content_index=0, delta=text, **extra)]

    def _open_text(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "status": "in_progress", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        events = self._add(item)
        item["content"].append(part)
        return events + [self.event("response.content_part.added", **self._where(), content_index=0, part=dict(part))]

    def _open_call(self, call_id: str, shown: str) -> list[dict]:
        namespace, name = self.names.namespace.get(shown, (None, shown))
        if shown in self.names.custom:
            item = {"id": _id("ctc"), "type": "custom_tool_call", "call_id": call_id, "name": name, "input": "",
                    "status": "in_progress"}
        else:
            item = {"id": _id("fc"), "type": "function_call", "call_id": call_id, "name": name, "arguments": "",
                    "status": "in_progress"}
        if namespace:
            item["namespace"] = namespace
        return self._add(item)

    def _call_arguments(self, arguments: str) -> list[dict]:
        item = self._open
        if item["type"] == "custom_tool_call":
            try:  # the model wrote {"input": "..."}: the tool gets the string itself
                value = json.loads(arguments).get("input", arguments)
            except (ValueError, AttributeError):
                value = arguments
            added = value if isinstance(value, str) else json.dumps(value)
            item["input"] += added
            return [self.event("response.custom_tool_call_input.delta", **self._where(), delta=added)]
        item["arguments"] += arguments
        return [self.event("response.function_call_arguments.delta", **self._where(), delta=arguments)]

    def _add(self, item: dict) -> list[dict]:
        self._open = item
        self.output.append(item)
        return [self.event("response.output_item.added", output_index=len(self.output) - 1, item=_copy(item))]

    def close(self, status: str = "completed") -> list[dict]:
        """Finish the open item: its .done events; `status` "incomplete" where the output was cut
        (by max_output_tokens, or a failure) while the item was being written."""
        item, events = self._open, []
        if item is None:
            return []
        where = self._where()
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": part["logprobs"]}
            events += [self.event(done, **where, content_index=0, text=part["text"], **extra),
                       self.event("response.content_part.done", **where, content_index=0, part=dict(part))]
        elif item["type"] == "function_call":
            events.append(self.event("response.function_call_arguments.done", **where, name=item["name"],
                                     arguments=item["arguments"]))
        else:
            events.append(self.event("response.custom_tool_call_input.done", **where, input=item["input"]))
        item["status"] = status
        events.append(self.event("response.output_item.done", output_index=where["output_index"], item=_copy(item)))
        self._open = None
        return events

    @property
    def reasoning_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.output if i["type"] == "reasoning")

    def conversation_messages(self) -> list[dict]:
        """The output as chat messages, for a later previous_response_id."""
        items = []
        for item in self.output:
            if item["type"] == "message":
                items.append(MessageItem(role="assistant", content=item["content"][0]["text"]))
            elif item["type"] == "reasoning":
                text = item["content"][0]["text"]
                items.append(ReasoningItem(type="reasoning", content=[{"type": "reasoning_text", "text": text}]))
            elif item["type"] == "function_call":
                items.append(FunctionCallItem(type="function_call", call_id=item["call_id"], name=item["name"],
                                              arguments=item["arguments"], namespace=item.get("namespace")))
            else:
                items.append(CustomToolCallItem(type="custom_tool_call", call_id=item["call_id"], name=item["name"],
                                                input=item["input"], namespace=item.get("namespace")))
        return input_messages(items, self.names)


def _tool_echo(tool) -> dict:
    """A request's tool as the response lists it (a namespace's `description` is required there)."""
    out = tool.model_dump(exclude_none=True)
    if out["type"] == "namespace":
        out.setdefault("description", "")
    return out


def _failure_code(error: APIError) -> str:
    """A failed response's `error.code`, one of the Responses API's codes (clients validate it);
    the message keeps the detail (a timeout, a shutdown)."""
    if error.status == 429:
        return "rate_limit_exceeded"
    return "invalid_prompt" if error.status < 500 else "server_error"


def _copy(item: dict) -> dict:
    return json.loads(json.dumps(item))


class ResponsesResponder:
    def __init__(self, state: ServerState, body: ResponsesRequest, run: Run, output: ChatOutput,
                 names: ToolNames, conversation: list[dict]):
        self.state, self.body, self.run, self.output = state, body, run, output
        self.conversation = conversation
        self.builder = ResponseBuilder(names)
        self.id, self.created = _id("resp"), int(time.time())
        self.token_text = TokenText(run.served.engine)

    def _feed(self, delta: Delta) -> list[dict]:
        # Logprobs go with the answer's text: those of the tokens before it (reasoning, markup)
        # wait for the first text, as they are part of what produced it.
        taken = self.run.take_logprobs() if delta.content else None
        return self.builder.feed(delta, [entry(self.token_text, lp) for lp in taken or ()])

    def response(self, status: str, error: Optional[APIError] = None) -> dict:
        body = self.body
        incomplete = None
        if status == "completed" and self.output.finish_reason == "length":
            status, incomplete = "incomplete", {"reason": "max_output_tokens"}
        out = {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.run.served.name,
            "output": _copy(self.builder.output), "error": None, "incomplete_details": incomplete,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id,
            "reasoning": {"effort": body.reasoning.effort if body.reasoning else None,
                          "summary": body.reasoning.summary if body.reasoning else None},
            "store": body.store is not False, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)
                     if body.text and body.text.format else {"type": "text"}},
            "tool_choice": body.tool_choice.model_dump() if isinstance(body.tool_choice, NamedTool)
            else (body.tool_choice or "auto"),
            "tools": [_tool_echo(t) for t in body.tools or []],
            "top_logprobs": body.top_logprobs, "truncation": "disabled", "service_tier": "default",
            "user": body.user, "prompt_cache_key": body.prompt_cache_key, "safety_identifier": body.safety_identifier,
            "usage": None, "dflash": self.run.report(),
        }
        if status in ("completed", "incomplete"):
            out["completed_at"] = int(time.time())
            out["usage"] = self.usage()
        if error is not None:
            out["error"] = {"code": _failure_code(error), "message": error.message}
        return out

    def usage(self) -> dict:
        usage = self.output.usage()
        tokenizer = self.run.served.engine.tokenizer
        reasoning = self.builder.reasoning_text
        return {
            "input_tokens": usage["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "cache_write_tokens": 0},
            "output_tokens": usage["completion_tokens"],
            # The reasoning text re-encoded: the engine counts tokens, the parser splits text.
            "output_tokens_details": {"reasoning_tokens": min(len(tokenizer.encode(reasoning)), usage["completion_tokens"])
                                      if reasoning else 0},
            "total_tokens": usage["total_tokens"],
        }

    def _finish(self, status: str, error: Optional[APIError] = None) -> dict:
        response = self.response(status, error)
        if self.body.store is not False:
            self.state.responses.put(response, self.conversation + self.builder.conversation_messages())
        return response

    async def stream(self, include_usage: bool) -> AsyncIterator[dict]:
        b = self.builder
        yield named_sse(b.event("response.created", response=self.response("in_progress")))
        yield named_sse(b.event("response.in_progress", response=self.response("in_progress")))
        try:
            async for delta in self.output.deltas():
                if delta is not HEARTBEAT:
                    for event in self._feed(delta):
                        yield named_sse(event)
        except APIError as e:
            for event in b.close("incomplete"):
                yield named_sse(event)
            yield named_sse(b.event("response.failed", response=self._finish("failed", e)))
            return
        for event in b.close(self._last_item_status()):
            yield named_sse(event)
        response = self._finish("completed")
        kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
        yield named_sse(b.event(kind, response=response))

    async def complete(self) -> dict:
        async for delta in self.output.deltas():
            if delta is not HEARTBEAT:
                self._feed(delta)
        self.builder.close(self._last_item_status())
        return self._finish("completed")

    def _last_item_status(self) -> str:
        """The last item was cut short where the output was (a length stop)."""
        return "incomplete" if self.output.finish_reason == "length" else "completed"


# ------------------------------------------------------------------------------ routes


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        arrival = time.perf_counter()
        chat.refuse_surrogates(body)
        history = []
        if body.previous_response_id:
            history = state.responses.get(body.previous_response_id, param="previous_response_id")["conversation"]
        names = tool_names(body.tools)
        chat_body, conversation = to_chat(body, history, names)
        started = await start_chat(state, chat_body, arrival)
        responder = ResponsesResponder(state, body, started.run, started.output, names, conversation)
        return await respond(state, "responses", request, started.run, responder, stream=bool(body.stream))

    @routes.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str, request: Request):
        # Streaming a stored response again (`stream`, `starting_after`) and `include` are not
        # offered: a 400 rather than the response whole, which the client would not expect.
        unsupported = [name for name in request.query_params if name in ("stream", "starting_after", "include",
                                                                         "include[]", "include_obfuscation")]
        if unsupported:
            raise bad_request(f"retrieving a response takes no {unsupported[0]}: stored responses are returned whole",
                              param=unsupported[0])
        return state.responses.get(response_id)["response"]

    # The Responses API's other endpoints, named rather than left to a 404 or 405 of the route above.
    @routes.post("/v1/responses/compact", include_in_schema=False)
    @routes.post("/v1/responses/input_tokens", include_in_schema=False)
    @routes.post("/v1/responses/{response_id}/cancel", include_in_schema=False)
    @routes.get("/v1/responses/{response_id}/input_items", include_in_schema=False)
    async def not_offered(request: Request):
        raise APIError(404, f"{request.method} {request.url.path} is not offered by this server: it serves "
                       "POST /v1/responses and GET/DELETE /v1/responses/{id}", type="not_found_error")

    @routes.delete("/v1/responses/{response_id}")
    async def delete(response_id: str):
        state.responses.delete(response_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    return routes
