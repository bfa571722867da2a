"""The engine's per-token logprobs in the shapes of the APIs: chat completions' and the Responses
API's `{"token", "logprob", "bytes", "top_logprobs"}` entries, completions' parallel lists.

They cover every generated token, reasoning and tool-call markup included (as vLLM reports them),
and are the target's own distribution before sampling settings and grammars (dflash_core/engine.py,
`Engine.generate`). A token's `bytes` are its exact bytes, also when it holds part of a character
(byte-level BPE); its `token` is those bytes decoded, U+FFFD where they are not whole characters.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Optional, Sequence

from dflash_core.engine import TokenLogprob
from dflash_core.prompts import hf_tokenizer


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable characters a byte-level BPE writes to the bytes they stand for."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


class TokenText:
    """Token id -> (text, bytes) for one tokenizer."""

    def __init__(self, tokenizer):
        self.hf = hf_tokenizer(tokenizer)
        self.added = set(self.hf.get_added_vocab())
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            self._cache[token] = self._text(token)
        return self._cache[token]

    def _text(self, token: int) -> tuple[str, list[int]]:
        piece = self.hf.convert_ids_to_tokens(token)
        alphabet = _byte_level_alphabet()
        if isinstance(piece, str) and piece not in self.added and piece and all(c in alphabet for c in piece):
            raw = bytes(alphabet[c] for c in piece)
        else:  # added tokens, SentencePiece pieces: their decoded text is their bytes
            raw = self.hf.decode([token], skip_special_tokens=False).encode("utf-8")
        return raw.decode("utf-8", errors="replace"), list(raw)


def entry(text: TokenText, lp: TokenLogprob) -> dict:
    token, raw = text(lp.token)
    return {"token": token, "logprob": lp.logprob, "bytes": raw,
            "top_logprobs": [{"token": text(t)[0], "logprob": v, "bytes": text(t)[1]} for t, v in lp.top]}


def chat_logprobs(text: TokenText, entries: Optional[Sequence[TokenLogprob]]) -> Optional[dict]:
    if entries is None:
        return None
    return {"content": [entry(text, lp) for lp in entries], "refusal": None}


def completion_logprobs(text: TokenText, entries: Optional[Sequence[TokenLogprob]], offset: int = 0) -> Optional[dict]:
    """Completions' legacy shape; `offset`: characters of the completion before these tokens."""
    if entries is None:
        return None
    tokens, offsets = [], []
    for lp in entries:
        offsets.append(offset)
        tokens.append(text(lp.token)[0])
        offset += len(tokens[-1])
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in entries],
            "top_logprobs": [{text(t)[0]: v for t, v in lp.top} for lp in entries], "text_offset": offsets}
