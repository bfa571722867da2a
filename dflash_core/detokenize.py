"""Incremental detokenization that never emits a broken character, in O(n).

Decoding token by token breaks multi-byte characters (a CJK character or an emoji is often split
over byte-level BPE tokens) and SentencePiece leading spaces.

- Byte-level BPE tokenizers (Qwen's, the test fixtures'): each token is a known byte string, so
  the bytes go through Python's incremental UTF-8 decoder, which holds back only a valid but
  unfinished character and turns bytes that can never start or continue one into U+FFFD at once,
  as the tokenizer's own decode does. Work per token is constant.
- Others: decode a short window that starts a few tokens back and emit only the text beyond what
  the window decoded before, holding text back while it ends in U+FFFD. A window that keeps ending
  in U+FFFD (bytes that never form a character) is cut after `MAX_HELD` tokens, so the work stays
  bounded and the text keeps flowing.
"""

from __future__ import annotations

import codecs
import json
from typing import Optional, Sequence

from .prompts import hf_tokenizer

MAX_HELD = 8  # tokens the window path holds back before it gives up on a character


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level map: the printable character a byte-level BPE writes for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


class TokenBytes:
    """Token id -> its bytes, for tokenizers whose decode is byte-level BPE alone (None from
    `for_tokenizer` otherwise). Built once per model; filled lazily."""

    def __init__(self, hf):
        self._hf = hf
        self._alphabet = _byte_alphabet()
        self._added = {i: t.content for i, t in hf.added_tokens_decoder.items()}
        self._cache: dict[int, bytes] = {}

    @classmethod
    def for_tokenizer(cls, tokenizer) -> Optional["TokenBytes"]:
        hf = hf_tokenizer(tokenizer)
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None or getattr(hf, "clean_up_tokenization_spaces", False):
            return None  # a slow tokenizer, or one whose decode rewrites spaces: the window path
        decoder = json.loads(backend.to_str()).get("decoder") or {}
        return cls(hf) if decoder.get("type") == "ByteLevel" else None

    def __call__(self, token: int) -> bytes:
        raw = self._cache.get(token)
        if raw is None:
            if token in self._added:
                raw = self._added[token].encode("utf-8")
            else:
                piece = self._hf.convert_ids_to_tokens(token) or ""
                raw = bytes(self._alphabet[c] for c in piece if c in self._alphabet)
            self._cache[token] = raw
        return raw


class IncrementalDetokenizer:
    def __init__(self, tokenizer, token_bytes: Optional[TokenBytes] = None):
        # The wrapped Hugging Face tokenizer: special tokens such as <think> or <tool_call> must
        # stay visible to the output parsers, so nothing is skipped.
        self._tokenizer = hf_tokenizer(tokenizer)
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace") if token_bytes else None
        self.tokens: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text has been emitted

    def _decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)

    def add(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        self.tokens.extend(tokens)
        if self._utf8 is not None:
            return self._utf8.decode(b"".join(self._bytes(t) for t in tokens))
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        if full.endswith("\ufffd") and len(self.tokens) - self._read_offset > MAX_HELD:
            # Held back for many tokens: emit through the last whole character, found within the
            # last three tokens (a character has at most four bytes); if there is none, the
            # U+FFFD before them are bytes that never form one, and go out as they are.
            end = len(self.tokens)
            keep = next((k for k in (end - 1, end - 2, end - 3)
                         if not self._decode(self.tokens[self._prefix_offset : k]).endswith("\ufffd")), end - 3)
            full = self._decode(self.tokens[self._prefix_offset : keep])
            delta = full[len(prefix) :] if len(full) > len(prefix) else ""
            self._prefix_offset, self._read_offset = self._read_offset, keep
            return delta
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        # The next window starts at the tokens just emitted: enough left context for word
        # boundaries and partial characters, and bounded work per call.
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is dropped)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True).rstrip("\ufffd")
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :]).rstrip("\ufffd")
        self._read_offset = len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
