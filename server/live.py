"""What the built-in page's live view shows (`GET /v1/dflash/live`): per model, the last minutes of
finished generations and totals since start; the same numbers `/metrics` counts, by model."""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

from dflash_core.stats import GenerationStats

WINDOW_SECONDS = 300  # the rate chart's span
BUCKET_SECONDS = 10


@dataclass
class ModelTotals:
    requests: int = 0
    generated_tokens: int = 0
    cycles: int = 0
    draft_tokens_accepted: int = 0
    plain_steps: int = 0
    tokens_from_cycles: int = 0
    tokens_from_steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    prefix_hits: int = 0
    accepted_by_position: list = field(default_factory=list)
    verified_by_position: list = field(default_factory=list)
    # (when it ended, tokens generated) of the generations that ended in the window
    recent: collections.deque = field(default_factory=collections.deque)

    def add(self, stats: GenerationStats, now: float) -> None:
        self.requests += 1
        self.generated_tokens += stats.generated_tokens
        self.prompt_tokens += stats.prompt_tokens
        cached = stats.prompt_tokens - stats.prefill_tokens
        self.cached_prompt_tokens += cached
        self.prefix_hits += cached > 0
        if stats.speculative:
            self.cycles += stats.cycles
            self.draft_tokens_accepted += stats.draft_tokens_accepted
            self.plain_steps += stats.plain_steps
            self.tokens_from_cycles += stats.tokens_from_cycles
            self.tokens_from_steps += stats.tokens_from_steps
            for mine, theirs in ((self.accepted_by_position, stats.accepted_by_position),
                                 (self.verified_by_position, stats.verified_by_position)):
                mine.extend([0] * (len(theirs) - len(mine)))
                for i, n in enumerate(theirs):
                    mine[i] += n
        self.recent.append((now, stats.generated_tokens))

    def view(self, now: float) -> dict:
        while self.recent and self.recent[0][0] < now - WINDOW_SECONDS:
            self.recent.popleft()
        buckets = [0] * (WINDOW_SECONDS // BUCKET_SECONDS)
        for at, tokens in self.recent:
            index = min(len(buckets) - 1, int((now - at) // BUCKET_SECONDS))
            buckets[len(buckets) - 1 - index] += tokens
        spec_tokens = self.tokens_from_cycles + self.tokens_from_steps
        return {
            "requests": self.requests,
            "generated_tokens": self.generated_tokens,
            # Tokens of generations that ended in each 10 s of the last 5 minutes, per second.
            "tokens_per_second": [n / BUCKET_SECONDS for n in buckets],
            "bucket_seconds": BUCKET_SECONDS,
            "tokens_per_cycle": (self.draft_tokens_accepted + self.cycles) / self.cycles if self.cycles else None,
            "acceptance_by_position": [a / v if v else None for a, v in zip(self.accepted_by_position,
                                                                           self.verified_by_position)],
            "share_from_cycles": self.tokens_from_cycles / spec_tokens if spec_tokens else None,
            "plain_steps": self.plain_steps,
            "prefix_cache_hit_rate": self.prefix_hits / self.requests if self.requests else None,
            "cached_prompt_tokens": self.cached_prompt_tokens,
        }


class LiveStats:
    """Finished generations by model (recorded from the event loop, read from it too; a lock all
    the same, as the worker may record in the future)."""

    def __init__(self):
        self._models: dict[str, ModelTotals] = {}
        self._lock = threading.Lock()

    def record(self, model: str, stats: GenerationStats, now: Optional[float] = None) -> None:
        with self._lock:
            self._models.setdefault(model, ModelTotals()).add(stats, time.monotonic() if now is None else now)

    def view(self, now: Optional[float] = None) -> dict:
        now = time.monotonic() if now is None else now
        with self._lock:
            return {name: totals.view(now) for name, totals in self._models.items()}
