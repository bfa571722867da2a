"""From an OpenAI request to what the engine needs: prompt tokens, sampling, limits.

Pure request processing on the event loop (tokenization and Jinja only, no MLX).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from pydantic_core import PydanticSerializationError

from dflash_core.grammar import GrammarSpec
from dflash_core.prompts import MessageError, encode_rendered, hf_tokenizer, render_chat, tokens_past
from dflash_core.sampling import SamplingError, SamplingParams

from . import generic_tools, structured
from .errors import APIError, bad_request
from .schemas import NEUTRAL_ONLY, ChatCompletionRequest, CompletionRequest, NamedToolChoice
from .tool_calls import GEMMA4, PLAIN, QWEN_JSON, QWEN_XML, Markers, prompt_starts_in_reasoning


@dataclass
class Prompt:
    text: Optional[str]  # what the model sees, when rendered from text
    tokens: list[int]
    starts_in_reasoning: bool = False
    forced_output: str = ""  # an opening the server wrote for the model (forced tool calls)
    markers: Markers = PLAIN  # how the output marks reasoning and tool calls (chat only)
    grammar: Optional[GrammarSpec] = None  # what the output must match (structured output)
    reasoning_budget: Optional[tuple[int, int]] = None  # (end-of-reasoning token, most tokens before it)


def _surrogate_at(value, path: str = "") -> Optional[str]:
    """The path of the first string holding a lone UTF-16 surrogate ("\\ud800" in JSON): valid
    JSON, but no text, so no tokenizer can encode it."""
    if isinstance(value, str):
        return (path or None) if _not_text(value) else None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _not_text(key):  # (a key of a free-form object, say a tool's schema)
            return f"{path}.{key!a}" if path else ascii(key)
        found = _surrogate_at(item, f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key)
        if found:
            return found
    return None


def _not_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def refuse_surrogates(body) -> None:
    """A 400 naming the field of `body` (any API's request) that holds a lone surrogate."""
    try:
        # pydantic-core's JSON writer fails on a lone surrogate, and runs on a 16 MB body in a
        # tenth of the time of a Python walk of its dump (~2 s, on the event loop): walk only to
        # name the field once there is one.
        body.model_dump_json(exclude_none=True, by_alias=True)
        return
    except PydanticSerializationError as e:
        surrogate = "surrogate" in str(e)
    where = _surrogate_at(body.model_dump(exclude_none=True, by_alias=True))
    if where is not None:
        raise bad_request(f"{where} holds a lone UTF-16 surrogate, which is not text", param=where)
    if surrogate:  # somewhere the walk does not name
        raise bad_request("the request holds a lone UTF-16 surrogate, which is not text")


def refuse_unsupported(request: Union[ChatCompletionRequest, CompletionRequest]) -> None:
    refuse_surrogates(request)
    for name, (neutral, message) in NEUTRAL_ONLY.items():
        value = getattr(request, name, None)
        # Compare types too: 0 == False, but logprobs=0 asks for something.
        if not any(value is n or (type(value) is type(n) and value == n) for n in neutral):
            raise bad_request(f"{message} (got {name}={value!r})", param=name)
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    if getattr(request, "top_logprobs", None) is not None and not getattr(request, "logprobs", None):
        raise bad_request("top_logprobs needs logprobs: true", param="top_logprobs")


def forced_tool_opening(markers: Markers, tool_choice) -> str:
    """Text that starts a tool call, so that `required` or a named function is honoured."""
    name = tool_choice.function.name if isinstance(tool_choice, NamedToolChoice) else None
    if markers.tool_format == QWEN_XML:
        return "<tool_call>\n" + (f"<function={name}>\n" if name else "")
    if markers.tool_format == QWEN_JSON:
        return "<tool_call>\n" + (f'{{"name": "{name}", "arguments": ' if name else "")
    if markers.tool_format == GEMMA4:
        return "<|tool_call>call:" + (name or "")
    raise bad_request("this model's chat template has no tool-call format", param="tool_choice")


def chat_prompt(request: ChatCompletionRequest, tokenizer, markers: Markers, template_defaults: dict,
                max_context: Optional[int] = None) -> Prompt:
    tools = [t.model_dump(exclude_none=True) for t in request.tools] if request.tools else None
    choice = request.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names an unknown function {choice.function.name!r}", param="tool_choice")
    asked = request.chat_template_kwargs.model_dump(exclude_none=True) if request.chat_template_kwargs else {}
    kwargs = {**template_defaults, **asked}
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced:
        kwargs["enable_thinking"] = False  # the answer starts with the call itself
    messages = [m.model_dump(exclude_none=True) for m in request.messages]
    shown_tools = tools if choice != "none" else None
    uses_tools = bool(tools) or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages)
    if uses_tools and not markers.has_tools:
        # The template cannot show tools: write them (and earlier calls and results) as text.
        markers = generic_tools.generic_markers(markers)
        messages, shown_tools = generic_tools.render_messages(messages, shown_tools), None
    try:
        text = render_chat(tokenizer, messages, shown_tools, **kwargs)
    except MessageError as e:
        raise bad_request(str(e), param=e.param) from e
    except Exception as e:  # the template rejects this conversation (roles, order, ...)
        raise bad_request(f"the chat template cannot render these messages: {e}", param="messages") from e
    opening = forced_tool_opening(markers, choice) if forced else ""
    text += opening  # (joined once: a prompt can be megabytes)
    check_context(tokens_past(tokenizer, text, max_context), max_context, at_least=True)
    tokens = encode_rendered(tokenizer, text)
    in_reasoning = prompt_starts_in_reasoning(text, markers)
    return Prompt(text, tokens, starts_in_reasoning=in_reasoning, forced_output=opening, markers=markers,
                  grammar=output_grammar(request, tokenizer, markers, opening, in_reasoning, shown_tools or tools),
                  reasoning_budget=reasoning_budget(request, tokenizer, markers, in_reasoning))


def output_grammar(request: ChatCompletionRequest, tokenizer, markers: Markers, opening: str, in_reasoning: bool,
                   tools) -> Optional[GrammarSpec]:
    """What the output must match: the response format's JSON, strict tools' calls, or (a format
    with tools the model may call) either of the two. The format is the final answer's: where the
    server opened a call (tool_choice required or named) this turn is a call, not the answer."""
    literals = structured.Literals(hf_tokenizer(tokenizer).get_added_vocab())
    schema = structured.format_schema(request.response_format)  # (a malformed format is a 400 whatever the turn)
    if request.tool_choice == "none" or not tools:
        return structured.response_format_grammar(schema, markers, in_reasoning, literals)
    if not opening:
        both = structured.answer_or_calls_grammar(schema, tools, markers, in_reasoning, literals)
        if both is not None:
            return both
    named = request.tool_choice.function.name if isinstance(request.tool_choice, NamedToolChoice) else None
    return structured.strict_tools_grammar(tools, markers, opening, in_reasoning, literals, named)


def reasoning_budget(request: ChatCompletionRequest, tokenizer, markers: Markers,
                     in_reasoning: bool) -> Optional[tuple[int, int]]:
    """(end-of-reasoning token, max_reasoning_tokens) when the prompt opened a reasoning block
    whose end marker is one token; None otherwise (no budget asked, or nothing to bound)."""
    if request.max_reasoning_tokens is None or not in_reasoning:
        return None
    end = hf_tokenizer(tokenizer).get_added_vocab().get(markers.reasoning_end or "")
    return None if end is None else (end, request.max_reasoning_tokens)


def completion_prompt(request: CompletionRequest, tokenizer, vocab_size: int, max_context: Optional[int] = None) -> Prompt:
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        # The model's embedding, not the tokenizer, bounds the ids (an out-of-range gather is not checked).
        vocab = min(len(hf_tokenizer(tokenizer)), vocab_size)
        if any(not 0 <= p < vocab for p in prompt):
            raise bad_request("prompt token ids must be within the vocabulary", param="prompt")
        return Prompt(None, list(prompt))
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise bad_request("only one prompt per request is supported", param="prompt")
        prompt = prompt[0]
    if not prompt:
        raise bad_request("the prompt is empty", param="prompt")
    check_context(tokens_past(tokenizer, prompt, max_context), max_context, "prompt", at_least=True)
    return Prompt(prompt, tokenizer.encode(prompt))


def max_new_tokens(request, defaults: dict) -> Optional[int]:
    for value in (getattr(request, "max_completion_tokens", None), request.max_tokens, defaults.get("max_tokens")):
        if value is not None:
            return value
    return None  # until end of sequence or the context limit


def check_context(prompt_tokens: Optional[int], max_context: Optional[int], param: str = "messages",
                  at_least: bool = False) -> None:
    """Only a prompt that leaves no room for one token is an error: a larger max_tokens than the
    room left generates up to the context limit and ends with `length` (as llama-server and
    Ollama do; agent clients send their model's output limit, not what is left of ours).
    `at_least`: `prompt_tokens` is a lower bound (`prompts.tokens_past`; None: not known to be past)."""
    if max_context is None or prompt_tokens is None or prompt_tokens < max_context:
        return
    raise APIError(
        400,
        f"This model's maximum context length is {max_context} tokens. However, the prompt has "
        f"{'at least ' if at_least else ''}{prompt_tokens} tokens, leaving no room for the completion. "
        "Please reduce the length of the prompt.",
        param=param,
        code="context_length_exceeded",
        # Anthropic's words for it, which Claude Code looks for to compact its conversation.
        anthropic_message=f"prompt is too long: {prompt_tokens} tokens > {max_context - 1} maximum",
    )


SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty")


def sampling_params(request, defaults: dict, vocab_size: int) -> SamplingParams:
    """Request values, else the model's configured defaults, else OpenAI's defaults."""
    values = {}
    for name in SAMPLING_FIELDS:
        value = getattr(request, name)
        if value is None:
            value = defaults.get(name)
        if value is not None:
            values[name] = value
    values.setdefault("temperature", 1.0)
    bias = None
    if request.logit_bias:
        try:
            bias = {int(token): float(value) for token, value in request.logit_bias.items()}
        except ValueError as e:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from e
    params = SamplingParams(**values, logit_bias=bias, seed=request.seed)
    try:
        return params.validate(vocab_size)
    except SamplingError as e:
        raise bad_request(str(e), param=e.param) from e
