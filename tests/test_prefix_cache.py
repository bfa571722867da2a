"""Prefix reuse across requests: exact, with the drafter's context, within a byte budget."""

from __future__ import annotations

import concurrent.futures
import gc
import random

import httpx
import mlx.core as mx
import numpy as np
import openai
import pytest
from live_server import LiveServer

from dflash_core.cache import cache_arrays, frozen_arrays
from dflash_core.engine import Engine
from dflash_core.kernels import KernelOptions
from dflash_core.loading import load_model
from dflash_core.prefix_cache import PrefixCache, SnapshotBudget
from dflash_core.settings import ModelSettings, Settings

FAMILIES = ["qwen3", "qwen3_5", "qwen3_5_moe", "gemma4", "gemma3"]


def _engines(pair, budget=10**8):
    target, drafter = pair
    cold = load_model(str(target), str(drafter), prefill_chunk=32).engine
    cached = Engine(cold.target, cold.tokenizer, cold.drafter, prefill_chunk=32, prefix_cache=PrefixCache(budget))
    return cold, cached


def _render(engine, messages):
    return engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)


def _run(engine, prompt, n=24):
    chunks = list(engine.generate(prompt, max_tokens=n, stop_token_ids=set()))
    return [t for c in chunks for t in c.token_ids], "".join(c.text for c in chunks), chunks[-1].stats


@pytest.mark.parametrize("family,draft_ahead", [(family, False) for family in FAMILIES] + [("qwen3", True), ("gemma3", True)])
def test_multi_turn_conversation_is_identical_to_cold(request, family, draft_ahead):
    """An agent loop: each turn resends the conversation with the model's answer and a new message.
    Every snapshot's drafter context holds exactly its tokens; with drafts ahead too, where a
    finished generation ends with a cycle queued and its next block drafted (all of that cycle's
    taps in the drafter's context)."""
    cold, cached = _engines(request.getfixturevalue(f"{family}_pair"))
    if draft_ahead:
        cold.drafter = cached.drafter = cold.drafter.with_kernels(KernelOptions(draft_ahead=True))
    messages = [{"role": "system", "content": "You are a terse assistant. " * 4},
                {"role": "user", "content": "Tell me a story about a fox."}]
    for turn in range(4):
        prompt = _render(cold, messages)
        tokens_cold, text, stats_cold = _run(cold, prompt)
        tokens_hit, _, stats_hit = _run(cached, prompt)
        assert tokens_hit == tokens_cold, f"turn {turn}"
        assert (stats_hit.cycles, stats_hit.draft_tokens_accepted) == (stats_cold.cycles, stats_cold.draft_tokens_accepted)
        assert stats_cold.prefill_tokens == len(prompt)
        if turn > 0:
            # Reused at least everything up to the end of the previous user message.
            assert stats_hit.prefill_tokens < len(prompt) - 20, f"turn {turn}: no reuse"
        for snapshot in cached.prefix_cache.snapshots:
            if snapshot.context is not None:
                assert all(c.offset == len(snapshot.tokens) for c in snapshot.restore()[1])
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And then? ({turn})"}]


def test_qwen_thinking_history_still_reuses(qwen3_5_pair):
    """Qwen's template keeps the thinking block only on the last assistant turn: the next turn's
    prompt diverges inside the previous answer, and the message-boundary snapshot still hits."""
    cold, cached = _engines(qwen3_5_pair)
    first = [{"role": "user", "content": "Solve 2+2."}]
    prompt1 = _render(cold, first)
    assert cold.tokenizer.decode(prompt1).endswith("<think>\n")
    _, _, _ = _run(cached, prompt1)
    follow = first + [{"role": "assistant", "content": "4", "reasoning_content": "Simple sum."},
                      {"role": "user", "content": "And 3+3?"}]
    prompt2 = _render(cold, follow)
    assert prompt2[: len(prompt1)] != prompt1  # the trap: not a plain extension
    tokens_hit, _, stats = _run(cached, prompt2)
    boundary = max(i + 1 for i, t in enumerate(prompt1) if t in cold.eos_token_ids)
    assert len(prompt2) - stats.prefill_tokens >= boundary
    assert tokens_hit == _run(cold, prompt2)[0]


def test_hit_restores_target_and_drafter_state(qwen3_5_pair):
    cold, cached = _engines(qwen3_5_pair)
    prompt = cold.tokenizer.encode("A long enough prompt about caching hidden states " * 3)
    _run(cached, prompt, n=2)
    snapshot = cached.prefix_cache.lookup(prompt + [5], need_context=True)
    assert snapshot is not None and snapshot.tokens == tuple(prompt)
    target_cache, context = snapshot.restore()
    fresh, fresh_context = cold.target.make_cache(16), cold.drafter.make_cache()
    out = cold.target.forward(mx.array(prompt)[None], fresh, cold.drafter.config.target_layer_ids)
    cold.drafter.add_context(out.tapped_hidden, fresh_context)
    def used(cache):  # what each cache holds for the prompt (KV buffers grow in steps)
        return [a[..., : c.offset, :] if hasattr(c, "offset") else a for c in cache for a in cache_arrays([c])]

    restored, computed = used(target_cache) + used(context), used(fresh) + used(fresh_context)
    assert len(restored) == len(computed) > 0
    for a, b in zip(restored, computed):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-5)
    assert context[0].offset == len(prompt)


def test_hit_miss_partial_and_exact_repeat(qwen3_pair):
    cold, cached = _engines(qwen3_pair)
    prompt = cold.tokenizer.encode("The first prompt, which will come back.")
    other = cold.tokenizer.encode("Something else entirely, no shared start.")
    assert _run(cached, prompt)[2].prefill_tokens == len(prompt)  # miss
    tokens, _, stats = _run(cached, prompt)  # exact repeat: nothing computed, same output
    assert stats.prefill_tokens == 0 and tokens == _run(cold, prompt)[0]
    longer = prompt + cold.tokenizer.encode(" And more.")
    tokens, _, stats = _run(cached, longer)  # partial hit
    assert stats.prefill_tokens == len(longer) - len(prompt) and tokens == _run(cold, longer)[0]
    assert _run(cached, other)[2].prefill_tokens == len(other)
    assert cached.prefix_cache.stats.hits == 2 and cached.prefix_cache.stats.misses == 2


def test_target_alone_snapshots_do_not_serve_speculation(qwen3_pair):
    cold, cached = _engines(qwen3_pair)
    prompt = cold.tokenizer.encode("Only the target saw this prompt.")
    list(cached.generate(prompt, max_tokens=4, speculative=False))
    chunks = list(cached.generate(prompt + [7], max_tokens=4))
    assert chunks[-1].stats.prefill_tokens == len(prompt) + 1  # no drafter context: not reused


def test_eviction_under_budget(qwen3_pair):
    cold, probe = _engines(qwen3_pair)
    prompt = cold.tokenizer.encode("Measure one snapshot of this prompt.")
    _run(probe, prompt, n=2)
    one = min(s.nbytes for s in probe.prefix_cache.snapshots)
    # A snapshot books at least the bytes of the arrays it holds (the allocator may give more).
    s = probe.prefix_cache.snapshots[0]
    assert s.nbytes >= sum(a.nbytes for a in frozen_arrays(s.target) + frozen_arrays(s.context)) + (
        s.logits.nbytes if s.logits is not None else 0)
    _, cached = _engines(qwen3_pair, budget=int(one * 2.5))
    prompts = [cold.tokenizer.encode(f"Prompt number {i} is unique.") for i in range(4)]
    for p in prompts:
        _run(cached, p, n=2)
        assert cached.prefix_cache.nbytes <= cached.prefix_cache.budget_bytes
    remaining = {s.tokens[: len(prompts[0])] for s in cached.prefix_cache.snapshots}
    assert tuple(prompts[0]) not in remaining  # the oldest went first
    assert _run(cached, prompts[-1], n=2)[2].prefill_tokens == 0  # the newest is still there


def _random_prompts(engine, n, seed=0):
    rng = random.Random(seed)
    vocab = engine.target.vocab_size
    return [[rng.randrange(10, vocab) for _ in range(rng.randrange(20, 200))] for _ in range(n)]


def _settled_memory() -> int:
    gc.collect()
    mx.synchronize()
    return mx.get_active_memory()


@pytest.mark.parametrize("family", FAMILIES)
def test_booked_bytes_are_the_memory_really_held(request, family):
    """What the cache books equals what MLX's allocator holds for it: clearing the cache frees it."""
    _, cached = _engines(request.getfixturevalue(f"{family}_pair"), budget=10**9)
    for prompt in _random_prompts(cached, 12):
        _run(cached, prompt, n=6)
    booked = cached.prefix_cache.nbytes
    held = _settled_memory()
    cached.prefix_cache.clear()
    freed = held - _settled_memory()
    assert booked > 0
    assert abs(freed - booked) <= 0.1 * booked, (family, booked, freed)


@pytest.mark.slow  # 300 requests
def test_budget_holds_under_a_soak(qwen3_5_pair):
    """300 requests of random lengths through a cache that holds a few snapshots: the memory the
    process holds stays within the budget (plus the live request's own caches)."""
    cold, probe = _engines(qwen3_5_pair)
    _run(probe, _random_prompts(probe, 1, seed=99)[0], n=4)
    budget = 6 * max(s.nbytes for s in probe.prefix_cache.snapshots)
    _, cached = _engines(qwen3_5_pair, budget=budget)
    for prompt in _random_prompts(cached, 3, seed=1):  # warm: buffers a request itself needs
        _run(cached, prompt, n=4)
    cached.prefix_cache.clear()
    baseline = _settled_memory()
    peak = 0
    prompts = _random_prompts(cached, 300, seed=2)
    for i, prompt in enumerate(prompts):
        if i % 3 == 1:  # a conversation going on: the previous prompt plus more
            prompt = prompts[i - 1] + prompt[:30]
        _run(cached, prompt, n=4)
        assert cached.prefix_cache.nbytes <= budget
        if i % 25 == 24:
            peak = max(peak, _settled_memory() - baseline)
    assert cached.prefix_cache.stats.hits > 50  # the soak did exercise reuse and eviction
    assert peak <= 1.1 * budget, (peak, budget)


def test_one_budget_for_several_caches(qwen3_pair, gemma3_pair):
    """Two models' caches on one budget: together they stay within it, least recently used first."""
    budget = SnapshotBudget(0)
    engines = []
    for pair in (qwen3_pair, gemma3_pair):
        cold, _ = _engines(pair)
        engines.append(Engine(cold.target, cold.tokenizer, cold.drafter, prefill_chunk=32,
                              prefix_cache=PrefixCache(budget)))
    first, second = engines
    _run(first, first.tokenizer.encode("Measure this one."), n=2)  # budget 0: nothing is kept
    assert first.prefix_cache.nbytes == 0
    budget.budget_bytes = 10**9
    _run(first, _random_prompts(first, 1)[0], n=2)
    one = first.prefix_cache.nbytes
    budget.budget_bytes = int(one * 2.5)
    for prompt in _random_prompts(second, 6, seed=3):
        _run(second, prompt, n=2)
        assert budget.nbytes <= budget.budget_bytes
    assert first.prefix_cache.nbytes == 0  # the oldest snapshots, the first model's, went first
    assert second.prefix_cache.nbytes > 0
    second.prefix_cache.close()
    assert budget.caches == [first.prefix_cache]


def test_server_reports_cached_tokens_and_shared_prefix_is_safe_concurrently(qwen3_5_pair):
    target, drafter = qwen3_5_pair
    settings = Settings(models=[ModelSettings(name="m", target=str(target), drafter=str(drafter))])
    system = {"role": "system", "content": "Shared instructions for every conversation. " * 6}
    with LiveServer(settings) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)

        def ask(question, n=16):
            out = client.chat.completions.create(model="m", temperature=0, max_tokens=n,
                                                 messages=[system, {"role": "user", "content": question}])
            return out.choices[0].message.model_extra.get("reasoning_content"), out.usage

        solo = [ask(q)[0] for q in ("first question", "second question")]
        server.state.pool.served()[0].engine.prefix_cache.clear()
        ask("warm the shared system prompt")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(ask, ("first question", "second question")))
        assert [r[0] for r in results] == solo
        assert all(r[1].prompt_tokens_details.cached_tokens > 0 for r in results)
        metrics = httpx.get(server.url + "/metrics").text
        hits = float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("dflash_prefix_cache_hits_total")))
        assert hits >= 2  # the two concurrent requests (earlier ones may have hit each other's prefixes too)


def test_a_servers_models_share_one_budget(qwen3_pair, gemma3_pair):
    from dflash_server.models import ModelPool
    from dflash_server.scheduler import Scheduler

    settings = Settings(prefix_cache_gb=0.5, prefill_chunk_seconds=None, models=[
        ModelSettings(name=name, target=str(pair[0]), drafter=str(pair[1]))
        for name, pair in (("a", qwen3_pair), ("b", gemma3_pair))])

    async def scenario():
        scheduler = Scheduler()
        scheduler.start()
        try:
            pool = ModelPool(settings, scheduler)
            served = [await pool.get(name) for name in ("a", "b")]
            return pool, served
        finally:
            scheduler.stop()

    import asyncio
    pool, (a, b) = asyncio.run(scenario())
    assert a.engine.prefix_cache.budget is b.engine.prefix_cache.budget is pool.snapshots
    assert pool.snapshots.budget_bytes == int(0.5e9)
