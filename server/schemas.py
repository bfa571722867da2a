"""Request bodies of the OpenAI-compatible API.

Unknown fields are refused (400), never silently ignored. A few OpenAI fields are accepted only
with the value that changes nothing (`n: 1`, `echo: false`, ...): see `NEUTRAL_ONLY`.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Literal, Optional, Union

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, PrivateAttr, Tag, field_validator

# A tool's name is written into the prompt's tool list and into the call markup the output is
# parsed (and, for strict tools, constrained) by, so it is a plain identifier: OpenAI's names
# (letters, digits, _ and -, up to 64) and Anthropic's fit, and so do names with "." or ":" (MCP's,
# say). A name such as "a>b" or one with a newline made strict calls to undeclared tools.
TOOL_NAME_PATTERN = r"^[A-Za-z0-9_.:-]{1,256}$"
ToolName = Annotated[str, Field(pattern=TOOL_NAME_PATTERN)]


class StrictModel(BaseModel):
    """Unknown fields and wrong JSON types (`"10"` or `true` for a number, `"yes"` for a boolean)
    are a 400: nothing is coerced."""

    model_config = ConfigDict(extra="forbid", strict=True)


def by_type(kinds: dict[str, type], error: str, implied: Optional[Callable[[dict], Optional[str]]] = None):
    """A union of models told apart by their `type` field (`kinds`: type -> model): pydantic
    validates an item as the model its type names and no other, so an error says what is wrong
    with that item (a union left to try every member reports the first one's complaint, such as
    a plain string's). An item of another type, or none, gets `error`. Members are tagged by
    class name, which the error handler leaves out of a field's path (input[3].content).
    `implied(item)`: the type of an item that gives none."""
    tags = {kind: model.__name__ for kind, model in kinds.items()}

    def tag(item) -> Optional[str]:
        if isinstance(item, dict):
            kind = item["type"] if "type" in item else implied(item) if implied else None
        else:
            kind = getattr(item, "type", None)
        return tags.get(kind) if isinstance(kind, str) else None

    members = tuple(Annotated[model, Tag(model.__name__)] for model in dict.fromkeys(kinds.values()))
    return Annotated[Union[members], Discriminator(tag, custom_error_type="invalid_type", custom_error_message=error)]


def text_only(kinds: dict[str, str], noun: str):
    """A before-validator for a list of content parts or blocks: those of `kinds` (type -> what
    they carry) are refused by name, since the served models read text only; left to the field's
    union, the error would name its first alternative (a plain string) instead."""

    def check(value):
        for part in value if isinstance(value, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in kinds:
                raise ValueError(f"{kind} {noun} are not supported: the served models read text only, not {kinds[kind]}")
        return value

    return check


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionCall(StrictModel):
    name: str
    arguments: str


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[str] = None
    # Earlier assistant reasoning, as returned by this server (both spellings).
    reasoning_content: Optional[str] = None
    reasoning: Optional[str] = None
    # What the OpenAI SDK's `message.model_dump()` carries back into the next turn: null is
    # accepted (agent loops append the whole message); a value is refused, since the template
    # cannot show it.
    refusal: Optional[str] = None
    audio: Optional[Any] = None
    function_call: Optional[Any] = None
    annotations: Optional[list[Any]] = None

    @field_validator("refusal", "audio", "function_call", "annotations")
    @classmethod
    def _null_only(cls, value, info):
        if value:  # null (or an empty annotation list) is what a plain answer carries
            raise ValueError(f"{info.field_name} in messages is not supported; send null or leave it out")
        return value

    def text(self) -> Optional[str]:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content


class FunctionDefinition(StrictModel):
    name: ToolName
    description: Optional[str] = None
    parameters: Optional[dict[str, Any]] = None
    strict: Optional[bool] = None  # true: calls are constrained to the schema (server/structured.py)


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class StreamOptions(StrictModel):
    include_usage: bool = False


class JSONSchemaFormat(StrictModel):
    name: str
    description: Optional[str] = None
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced (a grammar), strict or not


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JSONSchemaFormat] = None


class ChatTemplateKwargs(StrictModel):
    """The chat-template arguments a request may set. Known and typed only: a template sent by a
    client, or arguments of unknown meaning, would run arbitrary Jinja on the server."""

    enable_thinking: Optional[bool] = None


MAX_STOP_LENGTH = 1024  # characters: each stop string is matched as the output streams, on the event loop


def _bounded_stops(value):
    if isinstance(value, list) and len(value) > 4:
        raise ValueError("at most 4 stop sequences")
    if any(len(stop) > MAX_STOP_LENGTH for stop in ([value] if isinstance(value, str) else value or ())):
        raise ValueError(f"a stop sequence may be at most {MAX_STOP_LENGTH} characters")
    return value


StopField = Annotated[Union[str, list[str], None], AfterValidator(_bounded_stops)]


class DflashOptions(StrictModel):
    """dflash's extension object, on every endpoint: `{"dflash": {"speculation": "off"}}`."""

    speculation: Optional[Literal["auto", "on", "off"]] = None  # None: the model's configured mode


class Sampling(StrictModel):
    """The sampling fields the OpenAI surfaces share (chat, completions, Responses), and dflash's
    extension object (copied with them)."""

    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    seed: Optional[int] = None
    stop: StopField = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    dflash: Optional[DflashOptions] = None


class SamplingFields(Sampling):
    model: str
    max_tokens: Optional[int] = Field(default=None, ge=1)
    logit_bias: Optional[dict[str, float]] = None
    stream: Optional[bool] = False  # null means false, as in OpenAI's API
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Accepted only with their neutral value (see NEUTRAL_ONLY).
    n: Optional[int] = None


def unanswered_result(messages: list[dict]) -> Optional[tuple[int, Optional[str]]]:
    """(index, id) of the first tool message (chat messages as dicts) whose tool_call_id is not the
    id of a call in an earlier assistant message, else None: a result for a call never made (a
    chat template shows results in order, without their ids, so nothing else would catch it)."""
    called: set = set()
    for i, message in enumerate(messages):
        if message.get("role") == "assistant":
            called.update(call["id"] for call in message.get("tool_calls") or ())
        elif message.get("role") == "tool" and message.get("tool_call_id") not in called:
            return i, message.get("tool_call_id")
    return None


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    max_completion_tokens: Optional[int] = Field(default=None, ge=1)
    tools: Optional[list[Tool]] = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: Optional[bool] = None  # false: the output ends with its first call
    chat_template_kwargs: Optional[ChatTemplateKwargs] = None
    # Not a request field: tools the prompt does not list that the model may still call (the
    # Messages API's deferred tools, which a tool_reference loads), as chat tools: their calls are
    # parsed with their schemas.
    _unlisted_tools: list[dict] = PrivateAttr(default_factory=list)
    # dflash's extension (Messages' thinking.budget_tokens maps to it): the reasoning block the
    # prompt opens ends within this many tokens, its end marker forced then (masked, lossless).
    max_reasoning_tokens: Optional[int] = Field(default=None, ge=1)
    response_format: Optional[ResponseFormat] = None
    store: Optional[bool] = None

    @field_validator("messages")
    @classmethod
    def _results_answer_calls(cls, messages: list[Message]) -> list[Message]:
        unanswered = unanswered_result([{"role": m.role, "tool_call_id": m.tool_call_id,
                                         "tool_calls": [{"id": c.id} for c in m.tool_calls or ()]} for m in messages])
        if unanswered is not None:
            i, call_id = unanswered
            if call_id is None:
                raise ValueError(f"messages[{i}]: a tool message needs the tool_call_id of the call it answers")
            raise ValueError(f"messages[{i}].tool_call_id {call_id!r} is not the id of a tool call in an earlier "
                             "assistant message")
        return messages


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int]]
    logprobs: Optional[int] = Field(default=None, ge=0, le=20)
    echo: Optional[bool] = None
    suffix: Optional[str] = None
    best_of: Optional[int] = None


# field -> (neutral values, what to say when another value is sent)
NEUTRAL_ONLY: dict[str, tuple[tuple, str]] = {
    "n": ((None, 1), "only n=1 is supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    "best_of": ((None, 1), "only best_of=1 is supported"),
    "store": ((None, False), "stored completions are not supported"),
}
