"""Log-probabilities of the tokens a generation commits: the target's raw distribution, computed
on the device with the choices and read with them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

MAX_TOP_LOGPROBS = 20


@dataclass
class TokenLogprob:
    """A generated token's log-probability and the `k` most likely tokens at its position, by
    descending log-probability (ties by token id)."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class LogprobScorer:
    """Log-probabilities of chosen tokens and their top-k alternatives, computed on the device from
    the target's raw logits and queued with the choices, so the host reads them with the choices.
    With k None it does nothing: `queue` gives () and `read` None."""

    def __init__(self, k: Optional[int], vocab_size: int):
        self.k = None if k is None else min(k, vocab_size)

    def queue(self, logits: mx.array, chosen: mx.array) -> tuple:
        """Device arrays for rows [T, V] of logits and their chosen tokens int32 [T], evaluating."""
        if self.k is None:
            return ()
        x = logits.astype(mx.float32)
        logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
        out = (mx.take_along_axis(logprobs, chosen[:, None], axis=-1)[:, 0],)
        if self.k:
            ids = mx.argpartition(-logprobs, self.k - 1, axis=-1)[:, : self.k]
            out += (ids, mx.take_along_axis(logprobs, ids, axis=-1))
        mx.async_eval(*out)
        return out

    def read(self, queued: tuple, tokens: list[int]) -> Optional[list[TokenLogprob]]:
        """One TokenLogprob per token, token j read from row j."""
        if self.k is None:
            return None
        chosen = queued[0].tolist()
        ids, values = (queued[1].tolist(), queued[2].tolist()) if self.k else ([], [])
        out = []
        for j, token in enumerate(tokens):
            top = sorted(zip(ids[j], values[j]), key=lambda p: (-p[1], p[0])) if self.k else []
            out.append(TokenLogprob(token, chosen[j], top))
        return out
