"""Request bodies of OpenAI's Responses API (`POST /v1/responses`), as Codex and the SDK send them.

As everywhere in this server, an unknown field is a 400. Fields accepted without changing what
is generated say why next to them (README.md, "Responses API", lists them too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator

from .schemas import Sampling, StrictModel, ToolName, by_type, text_only

ITEM_STATUS = Optional[Literal["in_progress", "completed", "incomplete"]]  # as we reported it: asks nothing
_text_parts_only = text_only({"input_image": "images", "input_file": "files", "input_audio": "audio"}, "parts")


class InputText(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    annotations: Optional[list[Any]] = None  # output_text handed back: citations we never make
    logprobs: Optional[list[Any]] = None  # output_text handed back: what we reported, not input
    # Marks where a reusable prefix ends: the prefix cache finds every shared prefix by itself.
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None


class MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Union[str, list[InputText]]
    id: Optional[str] = None  # an id of ours or the client's: identifies, asks nothing
    status: ITEM_STATUS = None
    # OpenAI's label of an assistant message as commentary or final answer, which their models
    # want back; the chat templates of open models have no place for it (we never send one).
    phase: Optional[Literal["commentary", "final_answer"]] = None

    _parts = field_validator("content", mode="before")(_text_parts_only)

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class DirectCaller(StrictModel):
    """Who made a tool call: the model itself (the only caller here; calls from a program are
    OpenAI's programmatic tool calling, which this server does not run)."""

    type: Literal["direct"]


class ToolCall(StrictModel):
    call_id: str
    name: str
    namespace: Optional[str] = None
    id: Optional[str] = None
    status: ITEM_STATUS = None
    caller: Optional[DirectCaller] = None
    # OpenAI's asynchronous tool calls are not offered: only "not asynchronous" is meaningful.
    asynchronous: Optional[Literal[False]] = Field(default=None, alias="async")


class FunctionCallItem(ToolCall):
    type: Literal["function_call"]
    arguments: str


class CustomToolCallItem(ToolCall):
    type: Literal["custom_tool_call"]
    input: str


class OutputPart(StrictModel):
    type: Literal["input_text", "output_text"]
    text: str
    prompt_cache_breakpoint: Optional[dict[str, Any]] = None  # as on InputText


class FunctionCallOutputItem(StrictModel):
    type: Literal["function_call_output", "custom_tool_call_output"]
    call_id: str
    output: Union[str, list[OutputPart]]
    id: Optional[str] = None
    status: ITEM_STATUS = None
    name: Optional[str] = None  # the call's, which `call_id` already names
    namespace: Optional[str] = None
    caller: Optional[DirectCaller] = None

    _parts = field_validator("output", mode="before")(_text_parts_only)

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


class ReasoningText(StrictModel):
    type: Literal["summary_text", "reasoning_text"]
    text: str


class ReasoningItem(StrictModel):
    type: Literal["reasoning"]
    id: Optional[str] = None
    summary: list[ReasoningText] = Field(default_factory=list)
    content: Optional[list[ReasoningText]] = None
    # Handed back by clients that asked for include=["reasoning.encrypted_content"]: we never
    # encrypt (the reasoning text itself is in `content`, null here). Another provider's encrypted
    # reasoning is dropped, as no model here can read it (a reasoning item of only that, whole),
    # as the Messages API drops redacted_thinking.
    encrypted_content: Optional[str] = None
    status: ITEM_STATUS = None

    def text(self) -> str:
        parts = self.content if self.content else self.summary
        return "\n\n".join(p.text for p in parts)


InputItem = by_type(
    {"message": MessageItem, "function_call": FunctionCallItem, "custom_tool_call": CustomToolCallItem,
     "function_call_output": FunctionCallOutputItem, "custom_tool_call_output": FunctionCallOutputItem,
     "reasoning": ReasoningItem},
    "an input item must have a type: message, function_call, custom_tool_call, function_call_output, "
    "custom_tool_call_output or reasoning (other item types are not supported)",
    implied=lambda item: "message" if "role" in item else None)  # a message may leave its type out


class FunctionTool(StrictModel):
    type: Literal["function"]
    name: ToolName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None
    defer_loading: Optional[bool] = None  # tool search is not offered: every tool is shown anyway



class CustomToolFormat(StrictModel):
    type: Literal["text", "grammar"]
    syntax: Optional[Literal["lark", "regex"]] = None
    definition: Optional[str] = None


class CustomTool(StrictModel):
    """A free-form tool: the model writes its input as text (shown to the model as a function
    with one string parameter, `input`)."""

    type: Literal["custom"]
    name: ToolName
    description: Optional[str] = None
    format: Optional[CustomToolFormat] = None
    defer_loading: Optional[bool] = None  # as on FunctionTool


NamespacedTool = by_type({"function": FunctionTool, "custom": CustomTool}, "a namespace's tools must be function or custom tools")


class NamespaceTool(StrictModel):
    """A group of tools under one name (Codex's sub-agent tools): shown as its functions."""

    type: Literal["namespace"]
    name: ToolName
    description: Optional[str] = None
    tools: list[NamespacedTool]


TOOL_TYPES = {"function": FunctionTool, "custom": CustomTool, "namespace": NamespaceTool}
Tool = by_type(TOOL_TYPES, "a tool's type must be function, custom or namespace")


class NamedTool(StrictModel):
    type: Literal["function", "custom"]
    name: str


class ReasoningConfig(StrictModel):
    # none/minimal: thinking off; low..max: on (open models have one thinking mode, not levels).
    effort: Optional[Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]] = None
    # The reasoning comes back whole as reasoning_text, which is more than any summary.
    summary: Optional[Literal["auto", "concise", "detailed"]] = None
    generate_summary: Optional[Literal["auto", "concise", "detailed"]] = None


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    description: Optional[str] = None
    strict: Optional[bool] = None


class TextConfig(StrictModel):
    format: Optional[TextFormat] = None
    # Only the default: open models have no verbosity control to map other values to.
    verbosity: Optional[Literal["medium"]] = None


class StreamOptions(StrictModel):
    include_obfuscation: Optional[bool] = None  # we never pad events; accepted with either value


# `include` values: what asks for output we give anyway, or for tools we do not have.
INCLUDABLE = {
    "reasoning.encrypted_content",  # the reasoning text is in the item's content, unencrypted
    "message.output_text.logprobs",  # logprobs on output_text (with top_logprobs)
    "message.input_image.image_url", "computer_call_output.output.image_url",
    "file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
    "code_interpreter_call.outputs",  # tools this server does not run: nothing to include
}


class ResponsesRequest(Sampling):
    model: str
    input: Union[str, list[InputItem]] = Field(default_factory=list)
    instructions: Optional[str] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedTool, None] = None
    parallel_tool_calls: Optional[bool] = None  # false: the output ends with its first call
    max_output_tokens: Optional[int] = Field(default=None, ge=1)
    reasoning: Optional[ReasoningConfig] = None
    text: Optional[TextConfig] = None
    store: Optional[bool] = None  # default true, as OpenAI's: kept in a bounded in-memory store
    previous_response_id: Optional[str] = None
    include: Optional[list[str]] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    prompt_cache_key: Optional[str] = None  # the prefix cache is automatic and exact: no key needed
    prompt_cache_retention: Optional[str] = None  # likewise; entries live while memory allows
    # Stored with the response and returned: OpenAI's limits (16 pairs, keys of 64 characters,
    # values of 512), which also bound what the response store holds per response.
    metadata: Optional[Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                                 Field(max_length=16)]] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # logged with the request
    safety_identifier: Optional[str] = None  # logged with the request
    service_tier: Optional[str] = None  # one tier here; reported back as "default"
    truncation: Optional[Literal["disabled"]] = None  # what this server does: a prompt too long is a 400
    background: Optional[Literal[False]] = None
    # Codex's thread and turn ids: correlation metadata for its own logs; asks nothing of the model.
    client_metadata: Optional[dict[str, Any]] = None

    @field_validator("tools", mode="before")
    @classmethod
    def _only_tools_the_model_calls(cls, value):
        """Hosted tools (web_search, file_search, ...) run on OpenAI's side; nothing here would
        run them, so they are refused by name rather than left to a union's error."""
        for tool in value if isinstance(value, list) else ():
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind not in TOOL_TYPES:
                hint = ' (Codex: set web_search = "disabled" in config.toml)' if kind.startswith("web_search") else ""
                raise ValueError(f"tool type {kind!r} runs on OpenAI's servers and is not available here; "
                                 f"only function, custom and namespace tools are{hint}")
        return value

    @field_validator("include")
    @classmethod
    def _known_includes(cls, value):
        for name in value or ():
            if name not in INCLUDABLE:
                raise ValueError(f"include value {name!r} is not supported")
        return value
