"""Incremental detokenization that never emits a broken character.

Decoding token by token breaks multi-byte characters (a CJK character or an emoji is often split
over byte-level BPE tokens) and SentencePiece leading spaces. We decode a short window that starts a
few tokens back and emit only the text beyond what the window decoded before, holding text back
while it ends in U+FFFD (an incomplete UTF-8 sequence). Works for any number of tokens at once.
"""

from __future__ import annotations

from typing import Sequence

from .prompts import hf_tokenizer


class IncrementalDetokenizer:
    def __init__(self, tokenizer):
        # The wrapped Hugging Face tokenizer: special tokens such as <think> or <tool_call> must
        # stay visible to the output parsers, so nothing is skipped.
        self._tokenizer = hf_tokenizer(tokenizer)
        self.tokens: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens whose text has been emitted

    def _decode(self, tokens: Sequence[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=False)

    def add(self, tokens: Sequence[int]) -> str:
        if not tokens:
            return ""
        self.tokens.extend(tokens)
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        # The next window starts at the tokens just emitted: enough left context for word
        # boundaries and partial characters, and bounded work per call.
        delta = full[len(prefix) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.tokens)
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end is dropped)."""
        prefix = self._decode(self.tokens[self._prefix_offset : self._read_offset])
        full = self._decode(self.tokens[self._prefix_offset :]).rstrip("\ufffd")
        self._read_offset = len(self.tokens)
        return full[len(prefix) :] if len(full) > len(prefix) else ""
