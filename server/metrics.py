"""Prometheus metrics (prometheus-client), one registry per app."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from dflash_core.stats import GenerationStats

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
THROUGHPUT_BUCKETS = (1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 25000)


class Metrics:
    def __init__(self, scheduler):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "HTTP responses by path and status", ["endpoint", "status"], registry=r)
        self.cancelled = Counter("dflash_cancelled_requests", "Requests whose client went away", ["endpoint"], registry=r)
        queue = Gauge("dflash_queue_depth", "Requests waiting for the worker", registry=r)
        queue.set_function(lambda: scheduler.waiting)
        active = Gauge("dflash_active_requests", "Generations being interleaved", registry=r)
        active.set_function(lambda: scheduler.active)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens received", registry=r)
        self.prefill_tokens = Counter("dflash_prefill_tokens", "Prompt tokens actually computed", registry=r)
        self.generated_tokens = Counter("dflash_generated_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds", "Request arrival to first token",
            buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("dflash_inter_token_latency_seconds", "Time per generated token after the first",
            buckets=LATENCY_BUCKETS, registry=r)
        self.prefill_tps = Histogram("dflash_prefill_tokens_per_second", "Prefill throughput per request",
            buckets=THROUGHPUT_BUCKETS, registry=r)
        self.decode_tps = Histogram("dflash_decode_tokens_per_second", "Decode throughput per request",
            buckets=THROUGHPUT_BUCKETS, registry=r)
        self.cycles = Counter("dflash_spec_cycles", "Draft-verify cycles", registry=r)
        self.proposed = Counter("dflash_spec_draft_tokens_proposed", "Draft tokens proposed", registry=r)
        self.accepted = Counter("dflash_spec_draft_tokens_accepted", "Draft tokens accepted", registry=r)
        self.accepted_at = Counter("dflash_spec_accepted_by_position", "Accepted drafts by block position",
            ["position"], registry=r)
        self.prefix_hits = Counter("dflash_prefix_cache_hits", "Requests that reused a cached prompt prefix", registry=r)
        self.prefix_misses = Counter("dflash_prefix_cache_misses", "Requests that computed their whole prompt", registry=r)
        self.prefix_cached_tokens = Counter("dflash_prefix_cache_tokens", "Prompt tokens reused from the cache", registry=r)
        self.verified_at = Counter("dflash_spec_verified_by_position", "Cycles whose width reached each block position",
                                   ["position"], registry=r)
        self.cycle_widths = Counter("dflash_spec_cycles_by_width", "Draft-verify cycles by verify width", ["width"], registry=r)
        self.plain_steps = Counter("dflash_spec_plain_steps", "Plain target steps within speculating generations", registry=r)
        self.tokens_by_source = Counter("dflash_spec_tokens", "Tokens of speculating generations, by what made them",
                                        ["source"], registry=r)
        self.spec_off = Counter("dflash_spec_off_requests", "Requests decoded without speculation", ["reason"], registry=r)

    def record_generation(self, stats: GenerationStats) -> None:
        cached = stats.prompt_tokens - stats.prefill_tokens
        (self.prefix_hits if cached else self.prefix_misses).inc()
        self.prefix_cached_tokens.inc(cached)
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.prefill_tokens.inc(stats.prefill_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        if stats.prefill_seconds > 0:
            self.prefill_tps.observe(stats.prefill_tokens / stats.prefill_seconds)
        if stats.decode_seconds > 0 and stats.generated_tokens > 1:
            self.decode_tps.observe(stats.decode_tokens_per_second)
            self.itl.observe(stats.decode_seconds / (stats.generated_tokens - 1))
        if stats.speculative:
            self.cycles.inc(stats.cycles)
            self.proposed.inc(stats.draft_tokens_proposed)
            self.accepted.inc(stats.draft_tokens_accepted)
            for position, n in enumerate(stats.accepted_by_position, start=1):
                if n:
                    self.accepted_at.labels(position=str(position)).inc(n)
            for position, n in enumerate(stats.verified_by_position, start=1):
                if n:
                    self.verified_at.labels(position=str(position)).inc(n)
            for width, n in stats.cycle_widths.items():
                self.cycle_widths.labels(width=str(width)).inc(n)
            self.plain_steps.inc(stats.plain_steps)
            self.tokens_by_source.labels(source="cycles").inc(stats.tokens_from_cycles)
            self.tokens_by_source.labels(source="plain_steps").inc(stats.tokens_from_steps)
        else:
            self.spec_off.labels(reason=stats.speculative_off_reason or "unknown").inc()
