"""The engine's per-token logprobs in the shapes of the APIs: chat completions' and the Responses
API's `{"token", "logprob", "bytes", "top_logprobs"}` entries, completions' parallel lists.

They cover every generated token, reasoning and tool-call markup included (as vLLM reports them),
and are the target's own distribution before sampling settings and grammars (dflash_core/engine.py,
`Engine.generate`). A token's `bytes` are its exact bytes, also when it holds part of a character
(byte-level BPE); its `token` is those bytes decoded, U+FFFD where they are not whole characters.
"""

from __future__ import annotations

from typing import Optional, Sequence

from dflash_core.logprobs import TokenLogprob
from dflash_core.prompts import hf_tokenizer


class TokenText:
    """Token id -> (text, bytes) for one model."""

    def __init__(self, engine):
        self.hf = hf_tokenizer(engine.tokenizer)
        self.token_bytes = engine.token_bytes  # None unless the tokenizer is byte-level BPE
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self._cache:
            if self.token_bytes is not None:
                raw = self.token_bytes(token)
            else:  # SentencePiece pieces and the like: their decoded text is their bytes
                raw = self.hf.decode([token], skip_special_tokens=False).encode("utf-8")
            self._cache[token] = (raw.decode("utf-8", errors="replace"), list(raw))
        return self._cache[token]


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
