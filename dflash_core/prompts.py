"""Chat messages to prompt tokens, one way for the server, `dflash generate --chat` and the bench.

The conversation is rendered to text with the model's chat template and encoded without adding
special tokens (the template writes them), as Hugging Face's `apply_chat_template` does.
"""

from __future__ import annotations

import json
from typing import Any, Optional


class MessageError(ValueError):
    def __init__(self, param: str, message: str):
        super().__init__(f"{param}: {message}")
        self.param = param


def hf_tokenizer(tokenizer):
    """The Hugging Face tokenizer inside mlx-lm's TokenizerWrapper (or the tokenizer itself)."""
    return getattr(tokenizer, "_tokenizer", tokenizer)


def template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI messages -> what chat templates expect: `developer` as `system`, tool-call arguments
    as objects (templates iterate over them), earlier reasoning as `reasoning_content`, and the
    order every template accepts (see `_normalize_roles`)."""
    return _normalize_roles(_template_fields(messages))


def _template_fields(messages: list[dict]) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        m = {k: v for k, v in m.items() if v is not None}
        if m.get("role") == "developer":
            m["role"] = "system"
        if isinstance(m.get("content"), list):  # text parts
            m["content"] = "".join(part.get("text", "") for part in m["content"])
        m.setdefault("content", "")
        if m.get("reasoning") and not m.get("reasoning_content"):
            m["reasoning_content"] = m.pop("reasoning")
        calls = []
        for j, call in enumerate(m.get("tool_calls") or []):
            arguments = call["function"].get("arguments", "")
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError as e:
                    raise MessageError(f"messages[{i}].tool_calls[{j}].function.arguments", f"not valid JSON: {e}") from e
            calls.append({**call, "type": "function", "function": {**call["function"], "arguments": arguments}})
        if calls:
            m["tool_calls"] = calls
        out.append(m)
    return out


def _normalize_roles(messages: list[dict]) -> list[dict]:
    """Agent clients send conversations that strict templates refuse (Gemma's demands strict
    user/model alternation, Qwen's a single leading system message): Codex sends two developer
    and two user messages in a row, Claude Code system messages mid-conversation. Leading system
    messages become one; a later one becomes a user message (the only role every template shows
    anywhere); consecutive text messages of one role are joined by a blank line. Tool results and
    messages that carry tool calls or reasoning stay whole, so templates render them as before."""
    out: list[dict] = []
    for m in messages:
        m = dict(m)
        if m.get("role") == "system" and any(p.get("role") != "system" for p in out):
            m["role"] = "user"
        last = out[-1] if out else None
        if (last is not None and last["role"] == m["role"] and m["role"] in ("system", "user", "assistant")
                and _plain_text(last) and _plain_text(m)):
            last["content"] = "\n\n".join(c for c in (last["content"], m["content"]) if c)
            continue
        out.append(m)
    return out


def _plain_text(message: dict) -> bool:
    """A message that is only its text content (nothing a merge would lose)."""
    return isinstance(message.get("content"), str) and set(message) <= {"role", "content"}


def render_chat(tokenizer, messages: list[dict], tools: Optional[list[dict]] = None, **template_kwargs: Any) -> str:
    """The prompt text, ending with the template's generation prompt."""
    return hf_tokenizer(tokenizer).apply_chat_template(
        template_messages(messages), tools=tools or None, add_generation_prompt=True, tokenize=False,
        **template_kwargs,
    )


def encode_rendered(tokenizer, text: str) -> list[int]:
    return list(hf_tokenizer(tokenizer).encode(text, add_special_tokens=False))


# A prompt of more than this many characters per token of the context is counted piece by piece
# before it is tokenized whole (`tokens_past`); few texts average more than 8 characters a token.
CHARACTERS_PER_TOKEN_CHECKED = 8
COUNT_PIECE = 1 << 18  # characters counted at a time
PIECE_MARGIN = 16  # tokens a cut may add to a piece's count (a word or a special token cut in two)


def tokens_past(tokenizer, text: str, limit: Optional[int]) -> Optional[int]:
    """A lower bound on the tokens of `text` once it certainly reaches `limit`, else None, found
    without tokenizing the text whole. A fast tokenizer takes about 200 bytes of memory a
    character: a 15 MB prompt peaked at 2.7 GB and 21 s of a CPU before the context check refused
    it; counted in pieces, it stops once past the context."""
    if limit is None or len(text) <= CHARACTERS_PER_TOKEN_CHECKED * limit:
        return None
    encode = hf_tokenizer(tokenizer).encode
    counted = 0
    for start in range(0, len(text), COUNT_PIECE):
        counted += max(0, len(encode(text[start:start + COUNT_PIECE], add_special_tokens=False)) - PIECE_MARGIN)
        if counted >= limit:
            return counted
    return None
