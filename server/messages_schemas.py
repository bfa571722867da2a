"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`),
as Claude Code and the `anthropic` SDK send them.

Unknown fields are a 400 in Anthropic's error shape. Fields accepted without changing what is
generated say why next to them (README.md, "Messages API", lists them too).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, field_validator, model_validator

from .schemas import MAX_STOP_LENGTH, DflashOptions, StrictModel, ToolName, by_type, text_only


class CacheControl(StrictModel):
    """Prompt caching is automatic and exact here (every prefix is a candidate): a breakpoint
    asks for nothing more."""

    type: Literal["ephemeral"]
    ttl: Optional[Literal["5m", "1h"]] = None
    scope: Optional[str] = None


class TextBlock(StrictModel):
    type: Literal["text"]
    text: str
    cache_control: Optional[CacheControl] = None
    citations: Optional[list[Any]] = None  # handed back from an earlier answer: we never cite

    @field_validator("citations")
    @classmethod
    def _no_citations(cls, value):
        if value:
            raise ValueError("citations are not supported")
        return value


_text_blocks_only = text_only({"image": "images", "document": "documents", "search_result": "search results",
                               "container_upload": "files"}, "blocks")


class ToolUseBlock(StrictModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: Optional[CacheControl] = None
    caller: Optional[Any] = None  # who made the call (Claude Code hands back "direct"): the model did
    toolset_name: None = None  # MCP toolsets run on Anthropic's side: only "none" is meaningful


class ToolReferenceBlock(StrictModel):
    """In a tool search's result: loads the definition of a deferred tool (`Tool.defer_loading`),
    which the result then shows (server/messages.py, `tool_result_text`)."""

    type: Literal["tool_reference"]
    tool_name: str
    cache_control: Optional[CacheControl] = None


ResultBlock = by_type({"text": TextBlock, "tool_reference": ToolReferenceBlock},
                      "a tool result's blocks must be text or tool_reference blocks")


class ToolResultBlock(StrictModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[ResultBlock], None] = None
    is_error: Optional[bool] = None
    cache_control: Optional[CacheControl] = None
    toolset_name: None = None  # as on ToolUseBlock

    _blocks = field_validator("content", mode="before")(_text_blocks_only)


class ThinkingBlock(StrictModel):
    type: Literal["thinking"]
    thinking: str
    signature: Optional[str] = None  # we sign nothing; what we sent back is handed back


class RedactedThinkingBlock(StrictModel):
    """Encrypted reasoning from Anthropic's own models: no model here can read it, so it is
    dropped from the prompt (as a model that does not think would ignore it)."""

    type: Literal["redacted_thinking"]
    data: str


ContentBlock = by_type(
    {"text": TextBlock, "tool_use": ToolUseBlock, "tool_result": ToolResultBlock, "thinking": ThinkingBlock,
     "redacted_thinking": RedactedThinkingBlock},
    "a content block's type must be text, tool_use, tool_result, thinking or redacted_thinking (other block types "
    "are not supported)")


class Message(StrictModel):
    # "system" mid-conversation: Claude Code's mid-conversation-system beta.
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[ContentBlock]]

    _blocks = field_validator("content", mode="before")(_text_blocks_only)


class Tool(StrictModel):
    type: Optional[Literal["custom"]] = None
    name: ToolName
    description: Optional[str] = None
    input_schema: dict[str, Any]
    cache_control: Optional[CacheControl] = None
    strict: Optional[bool] = None
    # true: left out of the prompt's tool list; a tool_reference block in a tool result (a tool
    # search's, Claude Code's ToolSearch) shows its definition there, and the model may call it.
    defer_loading: Optional[bool] = None
    eager_input_streaming: Optional[bool] = None  # a call's input streams as it is written here anyway
    allowed_callers: Optional[list[Literal["direct"]]] = None  # the model calls tools; programs do not here


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None  # true: the output ends with its first call

    @field_validator("name")
    @classmethod
    def _name_only_for_a_tool(cls, value, info):
        if value is not None and info.data.get("type") != "tool":
            raise ValueError(f"a name is for tool_choice of type tool, not {info.data.get('type')!r}")
        return value


class Thinking(StrictModel):
    type: Literal["enabled", "disabled", "adaptive"]
    # The thinking ends within this many tokens (its end marker forced then). Required with enabled,
    # as Anthropic requires it; its least is 1 here, not Anthropic's 1024 (a small model's budget).
    budget_tokens: Optional[int] = Field(default=None, ge=1)
    display: Optional[Literal["summarized", "omitted"]] = None

    @model_validator(mode="after")
    def _budget_with_enabled(self):
        if self.type == "enabled" and self.budget_tokens is None:
            raise ValueError("budget_tokens is required when thinking.type is enabled")
        return self


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    # With adaptive thinking, "low" turns thinking off; otherwise one thinking mode serves all.
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class ContextEdit(StrictModel):
    # Which earlier thinking the model sees is the chat template's rule (Qwen shows only the
    # current turn's): "keep" is accepted as the template applies it.
    type: Literal["clear_thinking_20251015"]
    keep: Any = None


class ContextManagement(StrictModel):
    edits: list[ContextEdit] = Field(default_factory=list)


class Metadata(StrictModel):
    user_id: Optional[str] = None  # logged with the request


MAX_STOP_SEQUENCES = 256


def _contents_not_empty(messages: list[Message]) -> list[Message]:
    """As Anthropic's API: every message has content, but for a final assistant message (the
    answer's prefill, which may be empty). An empty turn would show the model a turn with nothing
    in it, which no client means to send."""
    for index, message in enumerate(messages):
        final_assistant = index == len(messages) - 1 and message.role == "assistant"
        if not message.content and not final_assistant:
            raise ValueError(f"messages.{index}: a message's content must not be empty "
                             "(only a final assistant message may be)")
    return messages


class MessagesRequest(StrictModel):
    model: str
    messages: list[Message] = Field(min_length=1)
    _contents = field_validator("messages")(_contents_not_empty)
    max_tokens: int = Field(ge=1)
    system: Union[str, list[TextBlock], None] = None
    # Anthropic's API states no limit; each one is matched against the output as it streams, on the
    # server's event loop, so a bound keeps one request from stalling the others (docs/api.md).
    stop_sequences: Optional[list[Annotated[str, Field(max_length=MAX_STOP_LENGTH)]]] = Field(
        None, max_length=MAX_STOP_SEQUENCES)
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    stream: Optional[bool] = False
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    metadata: Optional[Metadata] = None
    output_config: Optional[OutputConfig] = None
    context_management: Optional[ContextManagement] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None  # one tier here
    speed: Optional[Literal["standard"]] = None  # the one speed here (a faster mode is not offered)
    cache_control: Optional[CacheControl] = None  # automatic caching: what the prefix cache does
    dflash: Optional[DflashOptions] = None  # dflash's extension (docs/api.md)


class CountTokensRequest(StrictModel):
    model: str
    cache_control: Optional[CacheControl] = None  # as in MessagesRequest: counting is the same either way
    messages: list[Message] = Field(min_length=1)
    _contents = field_validator("messages")(_contents_not_empty)
    system: Union[str, list[TextBlock], None] = None
    tools: Optional[list[Tool]] = None
    tool_choice: Optional[ToolChoice] = None
    thinking: Optional[Thinking] = None
    output_config: Optional[OutputConfig] = None
    context_management: Optional[ContextManagement] = None
