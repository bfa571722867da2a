"""Continuous batching: generations that step together (one drafter forward and one target forward
for all of them per step) each give exactly what they give alone, for every family.

Rows differ in prompt length (Gemma's past their sliding window of 8), sampling (greedy and
seeded), speculation (always on, auto, off, and a policy that switches between plain steps and
cycles of every width at every point), acceptance (a forced drafter with every length 0..15), and
in when they join and leave (different budgets, one cancelled mid-flight), and in their grammars
(rows constrained by a JSON schema, a regex or any JSON object beside free ones).
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field
from types import SimpleNamespace

import mlx.core as mx
import pytest
from cost_clock import CostClock, CostedTarget
from families import ENGINE_FAMILIES
from test_adaptive import Scheduled

from dflash_core.batching import step_together
from dflash_core.engine import Engine
from dflash_core.sampling import SamplingParams

SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=7)
BIASED = SamplingParams(logit_bias={3: 0.5, 11: 0.5, 17: -1.0})


@dataclass
class Row:
    prompt: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    speculation: object = "on"
    join_at: int = 0  # the step at which it joins the batch
    cancel_at: int = -1  # the step at which it is closed, -1: never
    grammar: object = None  # a GrammarSpec the output must match


def _prompt(engine, n: int, seed: int) -> list[int]:
    text = " ".join(f"word{(seed * 31 + i * 7) % 97}" for i in range(n))
    return engine.tokenizer.encode(text)[:n]


def _alone(engine, row: Row) -> list[int]:
    steps = engine.generate(row.prompt, max_tokens=row.max_tokens, sampling=row.sampling,
                            speculation=_policy(row.speculation), stop_token_ids=set(), grammar=row.grammar)
    return [t for c in steps for t in c.token_ids]


def _assert_each_as_alone(engine, rows: list[Row], together: list[list[int]]) -> None:
    """Each row's tokens batched are its tokens alone (a cancelled row's, up to its cancel)."""
    for i, row in enumerate(rows):
        alone = _alone(engine, row)
        if row.cancel_at >= 0:
            assert together[i] == alone[: len(together[i])] and 0 < len(together[i]) < len(alone)
        else:
            assert together[i] == alone, f"row {i}"


def _policy(speculation):
    return Scheduled(speculation.plans) if isinstance(speculation, Scheduled) else speculation


def _together(engine, rows: list[Row]) -> list[list[int]]:
    """Run the rows' streams with step_together; each joins at its step, leaves at its end or its
    cancel. Returns each row's tokens (a cancelled row's up to its cancel)."""
    streams, outputs, live = {}, [[] for _ in rows], set()
    step = 0
    while step == 0 or live or any(r.join_at >= step for r in rows):
        for i, r in enumerate(rows):
            if r.join_at == step:
                streams[i] = engine.generate(r.prompt, max_tokens=r.max_tokens, sampling=r.sampling,
                                             speculation=_policy(r.speculation), stop_token_ids=set(), batched=True,
                                             grammar=r.grammar)
                live.add(i)
            if r.cancel_at == step and i in live:
                streams[i].close()
                live.discard(i)
        order = sorted(live)
        for i, stepped in zip(order, step_together(engine, [streams[i] for i in order])):
            assert stepped.error is None, stepped.error
            if stepped.done:
                live.discard(i)
            else:
                outputs[i] += stepped.chunk.token_ids
                if stepped.chunk.finish_reason:
                    live.discard(i)
        step += 1
        assert step < 2000
    return outputs


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_random_drafter_rows_are_each_exactly_alone(engines, family, monkeypatch):
    engine = engines[family]
    sizes = []  # rows per target forward: the batch really forms
    forward_rows = engine.target.forward_rows
    monkeypatch.setattr(engine.target, "forward_rows", lambda rows, taps=(): sizes.append(len(rows)) or
                        forward_rows(rows, taps))
    rows = [
        Row(_prompt(engine, 5, 1), 30),
        Row(_prompt(engine, 23, 2), 41, SEEDED),
        Row(_prompt(engine, 12, 3), 26, speculation="off"),
        Row(_prompt(engine, 17, 4), 35, SamplingParams(temperature=0.7, seed=3), speculation="auto", join_at=4),
        Row(_prompt(engine, 9, 5), 50, join_at=2, cancel_at=9),
        # Greedy rows with a logit bias take the batch's one argmax, taken after their bias.
        Row(_prompt(engine, 14, 6), 33, BIASED, join_at=1),
        Row(_prompt(engine, 8, 7), 20, BIASED, speculation="off"),
    ]
    together = _together(engine, rows)
    assert max(sizes) >= 4
    monkeypatch.undo()
    _assert_each_as_alone(engine, rows, together)


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_grammar_rows_in_a_batch_are_each_exactly_alone(engines, family):
    """Rows under a grammar (a JSON schema, a regex, any JSON object; greedy and seeded; always on,
    auto and off) beside free rows: each row's mask follows its own drafts, and every row gives
    what it gives alone; the constrained ones end where their grammar is complete."""
    from test_grammar import GRAMMARS

    engine = engines[family]
    rows = [
        Row(_prompt(engine, 11, 1), 120, grammar=GRAMMARS["json_schema"]),
        Row(_prompt(engine, 19, 2), 40),
        Row(_prompt(engine, 7, 3), 120, SEEDED, grammar=GRAMMARS["regex"], join_at=2),
        Row(_prompt(engine, 15, 4), 48, SamplingParams(temperature=0.8, seed=5), speculation="auto",
            grammar=GRAMMARS["json_object"], join_at=1),
        Row(_prompt(engine, 13, 5), 120, speculation="off", grammar=GRAMMARS["json_schema"], join_at=3),
        Row(_prompt(engine, 9, 6), 60, SEEDED, cancel_at=6),
    ]
    together = _together(engine, rows)
    _assert_each_as_alone(engine, rows, together)
    # The schema and regex rows completed their grammar (they have no stop token to end on).
    assert all(len(together[i]) < rows[i].max_tokens for i in (0, 2, 4))


@dataclass
class _Context:
    offset: int = 0
    cycles: int = 0
    first: int = 0
    reference: list = field(default_factory=list)


class RowForcedDrafter:
    """The tests' forced drafter (tests/forced.py) for several generations at once: each context
    finds its row's reference by its prompt length (distinct per row) at its first block, and
    plants one error so that `schedule[cycle]` drafts are accepted."""

    def __init__(self, references: dict[int, list[int]], schedules: dict[int, list[int]], vocab_size: int,
                 target_layer_ids, block_size: int = 16):
        self.references, self.schedules, self.vocab_size = references, schedules, vocab_size
        self.block_size = block_size
        self.config = SimpleNamespace(target_layer_ids=list(target_layer_ids), block_size=block_size)

    def make_cache(self):
        return [_Context()]

    def add_context(self, taps, cache):
        if cache[0].offset == 0:
            cache[0].first = taps.shape[1]
        cache[0].offset += taps.shape[1]

    def propose(self, bonus, target, cache, width=None):
        context = cache[0]
        if not context.reference:
            # The row's prompt length: where its first block starts when it cycles from the start,
            # else its first context block's length (a prompt prefilled in one chunk).
            key = context.offset if context.offset in self.references else context.first
            context.reference = self.references[key]
            context.schedule = self.schedules[key]
        accept = context.schedule[context.cycles % len(context.schedule)]
        context.cycles += 1
        drafts = []
        for j in range(1, width or self.block_size):
            position = context.offset + j
            token = context.reference[position] if position < len(context.reference) else 0
            drafts.append((token + 1) % self.vocab_size if j == accept + 1 else token)
        return mx.array(drafts, dtype=mx.int32)


SCHEDULE = [15, 0, 7, 1, 14, 2, 13, 3, 12, 4, 11, 5, 10, 6, 9, 8, 15, 15, 0, 0]


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_every_acceptance_length_in_a_batch(engines, family):
    """Rows accepting different lengths side by side, one of them also switching between plain
    steps and cycles of every width: each row's greedy output is the target's."""
    _check_every_acceptance_length_in_a_batch(engines[family])


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rows_roll_back_together_from_step_states(engines, family, monkeypatch, step_states):
    """Verifies keeping every step's GatedDeltaNet state: the rows of one batch roll back in one
    gather per layer, and every row's output is still the target's, at every acceptance length."""
    base = engines[family]
    target = step_states(base.target)
    gathered, one_by_one = [], []
    rollback_rows, rollback = target.rollback_rows, target.rollback
    monkeypatch.setattr(target, "rollback_rows", lambda undos: gathered.append(len(undos)) or rollback_rows(undos))
    monkeypatch.setattr(target, "rollback", lambda *a: one_by_one.append(a) or rollback(*a))
    _check_every_acceptance_length_in_a_batch(Engine(target, base.tokenizer, base.drafter, prefill_chunk=16))
    assert max(gathered) >= 2 and len(one_by_one) < sum(gathered)


@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_rows_roll_back_together_from_step_deltas(engines, family, monkeypatch, step_deltas):
    """Verifies keeping each step's GatedDeltaNet delta (`KernelOptions.step_deltas`, for CUDA; here
    the uncompiled pure-MLX steps whose roundings a replay repeats): the rows of one batch roll back
    in one replay per layer, and every row's output is still the target's, at every acceptance
    length."""
    from dflash_core.adapters import qwen3_5

    replayed_rows, replay = [], qwen3_5.replay
    monkeypatch.setattr(qwen3_5, "replay", lambda *a: replayed_rows.append(len(a[-1])) or replay(*a))
    base = engines[family]
    target = step_deltas(base.target)
    _check_every_acceptance_length_in_a_batch(Engine(target, base.tokenizer, base.drafter, prefill_chunk=16))
    assert max(replayed_rows) >= 2  # rows replayed together


def _check_every_acceptance_length_in_a_batch(base):
    prompts = [_prompt(base, n, seed) for n, seed in ((6, 1), (14, 2), (21, 3))]
    assert len({len(p) for p in prompts}) == 3
    n_tokens = 90
    references = {len(p): p + _alone(base, Row(p, n_tokens + 16, speculation="off")) for p in prompts}
    # Rotated so that within 90 tokens rows 0 and 1 between them accept every length 0..15.
    schedules = {len(p): SCHEDULE[r:] + SCHEDULE[:r] for r, p in zip((0, 7, 13), prompts)}
    forced = RowForcedDrafter(references, schedules, base.target.vocab_size, base.drafter.config.target_layer_ids)
    engine = Engine(base.target, base.tokenizer, forced, prefill_chunk=16)
    plans = Scheduled([16, 0, 0, 2, 16, 0, 5, 0, 3, 16, 9, 0, 15, 4, 16, 6, 0, 7, 8, 10, 0, 11, 12, 13, 14])
    rows = [Row(prompts[0], n_tokens), Row(prompts[1], n_tokens - 7, join_at=3),
            Row(prompts[2], n_tokens, speculation=plans, join_at=1)]
    together = _together(engine, rows)
    for i, row in enumerate(rows):
        assert together[i] == references[len(row.prompt)][len(row.prompt):][: row.max_tokens], f"row {i}"


def test_a_failing_row_fails_alone(engines):
    engine = engines["qwen3"]
    good = engine.generate(_prompt(engine, 8, 1), max_tokens=12, stop_token_ids=set(), batched=True)

    def broken():
        raise RuntimeError("this generation's step failed")
        yield  # a generator, as an engine's stream is

    first = step_together(engine, [good, broken()])
    assert isinstance(first[1].error, RuntimeError) and first[0].error is None
    tokens = list(first[0].chunk.token_ids)
    while True:
        (stepped,) = step_together(engine, [good])
        if stepped.done:
            break
        tokens += stepped.chunk.token_ids
        if stepped.chunk.finish_reason:
            break
    assert tokens == _alone(engine, Row(_prompt(engine, 8, 1), 12))


def _serve_jobs(engine, scheduler, prompts, max_tokens: int) -> list[list[int]]:
    """Submit one job per prompt to a running scheduler at once; each job's tokens."""
    from dflash_server.scheduler import Job

    async def scenario():
        loop = asyncio.get_running_loop()
        jobs = [Job(start=lambda p=p: engine.generate(p, max_tokens=max_tokens, stop_token_ids=set(), batched=True),
                    loop=loop, engine=engine, together=True, tokens=len(p) + max_tokens) for p in prompts]
        for job in jobs:
            scheduler.submit(job)
        out = []
        for job in jobs:
            tokens = []
            while (item := await asyncio.wait_for(job.outputs.get(), 120)) is not None:
                assert not isinstance(item, BaseException), item
                tokens += item.token_ids
            out.append(tokens)
        return out

    scheduler.start()
    try:
        return asyncio.run(scenario())
    finally:
        scheduler.stop()


def test_the_scheduler_batches_within_memory_and_queues_beyond(engines, monkeypatch):
    """Through the server's scheduler: jobs of one model step together (up to max_active) when
    their caches fit; with no memory to spare beyond the first, they run one at a time. Either way
    every job's output is what it gives alone."""
    from dflash_server.scheduler import Scheduler

    engine = engines["qwen3"]
    prompts = [_prompt(engine, 6 + 3 * i, i) for i in range(4)]
    alone = [_alone(engine, Row(p, 20)) for p in prompts]
    assert engine.cache_bytes_per_token  # measured by the generations that finished
    sizes = []
    forward_rows = engine.target.forward_rows
    monkeypatch.setattr(engine.target, "forward_rows", lambda rows, taps=(): sizes.append(len(rows)) or
                        forward_rows(rows, taps))
    roomy = Scheduler(max_active=8, memory_fraction=1.0, memory_size=1 << 40)
    assert _serve_jobs(engine, roomy, prompts, 20) == alone
    assert max(sizes) == 4
    sizes.clear()
    full = Scheduler(max_active=8, memory_fraction=1.0, memory_size=1)  # room for the first job only
    assert _serve_jobs(engine, full, prompts, 20) == alone
    assert max(sizes) == 1


def test_generate_together_runs_many_with_rows_joining_as_others_end(engines):
    """What `dflash train` makes its data with: six requests, three rows at a time, each request's
    chunks giving exactly its tokens alone (greedy and seeded, different budgets)."""
    from dflash_core.batching import generate_together

    engine = engines["qwen3_5"]
    requests = [{"prompt_tokens": _prompt(engine, 4 + 3 * i, i), "max_tokens": 6 + 5 * i, "stop_token_ids": set(),
                 "sampling": SEEDED if i % 2 else SamplingParams(), "speculative": i % 3 != 0} for i in range(6)]
    ended = []
    results = generate_together(engine, requests, max_rows=3, progress=ended.append)
    assert len(ended) == 6
    for request, chunks in zip(requests, results):
        alone = [t for c in engine.generate(**request) for t in c.token_ids]
        assert [t for c in chunks for t in c.token_ids] == alone
        assert chunks[-1].finish_reason == "length"


def test_a_batched_round_starts_its_rows_evaluations_in_one_call_per_forward(engines, monkeypatch):
    """Plain steps and cycles together: a round evaluates what its rows queued (next tokens,
    drafts, taps) in one `mx.async_eval` per forward, not one per row, and the tokens its rows
    read on the host are joined into one array, read once. So a round of 8 rows makes as many
    calls as one of 2; and the rows still give exactly their tokens alone."""
    from dflash_core.host_reads import RoundQueue

    engine = engines["qwen3"]
    real = mx.async_eval
    joined = []  # rows' reads per joined read
    join = RoundQueue.join_reads
    monkeypatch.setattr(RoundQueue, "join_reads", lambda self: joined.append(len(self.reads)) or join(self))

    def rounds(n: int) -> tuple[int, list]:
        joined.clear()
        rows = [Row(_prompt(engine, 5 + i, i), 12, SEEDED if i % 2 else SamplingParams(), "on" if i % 2 else "off")
                for i in range(n)]
        streams = [engine.generate(r.prompt, max_tokens=r.max_tokens, sampling=r.sampling,
                                   speculation=r.speculation, stop_token_ids=set(), batched=True) for r in rows]
        outputs = [[] for _ in rows]
        calls = []
        for round_ in range(7):  # a prefill round, then decode rounds: plain steps, drafts and verifies
            if round_ == 4:
                monkeypatch.setattr(mx, "async_eval", lambda *a: calls.append(len(a)) or real(*a))
            for out, stepped in zip(outputs, step_together(engine, streams)):
                out += stepped.chunk.token_ids
        monkeypatch.setattr(mx, "async_eval", real)
        assert not engine.batch_queue  # every queued array went out with its round
        for stream in streams:
            stream.close()
        for row, out in zip(rows, outputs):
            assert out == _alone(engine, row)[: len(out)]
        return len(calls), calls

    two, _ = rounds(2)
    eight, calls = rounds(8)
    assert eight == two, calls
    assert max(calls) >= 4  # one call held the arrays of several rows
    assert set(joined[1:]) == {8}  # each decode round: every row's tokens, read in one transfer


@pytest.mark.parametrize("family", ["qwen3_5", "gemma3"])
def test_rows_restore_and_leave_prefix_cache_snapshots(engines, family):
    """A batch whose rows start from snapshots that other rows of the batch left (a conversation's
    next turn, a shared system prompt) gives what the engine without any cache gives alone."""
    from dflash_core.prefix_cache import PrefixCache

    cold = engines[family]
    cached = Engine(cold.target, cold.tokenizer, cold.drafter, prefill_chunk=16, prefix_cache=PrefixCache(10**8))
    eos = sorted(cold.eos_token_ids)[0]
    system = _prompt(cold, 18, 9) + [eos]  # a message boundary: snapshotted at prefill
    first = [Row(system + _prompt(cold, 5, i), 12) for i in range(3)]
    answers = _together(cached, first)
    # Next turns extend the first conversations (their finished rows were snapshotted).
    second = [Row(r.prompt + a + [eos] + _prompt(cold, 4, 10 + i), 10, SEEDED if i else SamplingParams(),
                  join_at=i) for i, (r, a) in enumerate(zip(first, answers))]
    assert _together(cached, second) == [_alone(cold, r) for r in second]
    assert answers == [_alone(cold, r) for r in first]
    assert cached.prefix_cache.stats.hits >= 3


def test_the_server_with_batching_on_answers_concurrent_requests_as_one_at_a_time(qwen3_pair):
    """`server.batching: true`: concurrent chat completions (streamed and not) get exactly the
    answers they get one at a time."""
    import json
    import threading

    import httpx
    from live_server import LiveServer

    from dflash_core.settings import ModelSettings, ServerSettings, Settings

    target, drafter = qwen3_pair
    settings = Settings(server=ServerSettings(batching=True), prefix_cache_gb=0, models=[
        ModelSettings(name="tiny", target=str(target), drafter=str(drafter), speculation="on")])
    eos = json.loads((target / "generation_config.json").read_text())["eos_token_id"]
    ban = {str(t): -100 for t in (eos if isinstance(eos, list) else [eos])}  # every answer runs to max_tokens
    bodies = [{"model": "tiny", "prompt": f"Tell me about item {i} " * (1 + i), "max_tokens": 24, "logit_bias": ban,
               "temperature": 0.7 if i % 2 else 0, "seed": i, "stream": i == 2} for i in range(4)]

    def ask(url, body):
        response = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert response.status_code == 200, response.text
        if not body["stream"]:
            return response.json()["choices"][0]["text"]
        lines = [line[6:] for line in response.text.splitlines() if line.startswith("data: {")]
        return "".join(c["choices"][0].get("text") or "" for c in map(json.loads, lines) if c["choices"])

    with LiveServer(settings) as server:
        alone = [ask(server.url, b) for b in bodies]
        together = [None] * len(bodies)
        threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, ask(server.url, bodies[i])))
                   for i in range(len(bodies))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert together == alone and all(alone)


def _auto_batch(engine, prompts, n_tokens):
    rows = [Row(p, n_tokens, speculation="auto") for p in prompts]
    streams = [engine.generate(r.prompt, max_tokens=r.max_tokens, speculation="auto", stop_token_ids=set(),
                               batched=True) for r in rows]
    outputs, last = [[] for _ in rows], [None] * len(rows)
    live = list(range(len(rows)))
    while live:
        for i, stepped in zip(list(live), step_together(engine, [streams[i] for i in live])):
            assert stepped.error is None and not stepped.done, stepped.error
            outputs[i] += stepped.chunk.token_ids
            if stepped.chunk.finish_reason:
                last[i] = stepped.chunk.stats
                live.remove(i)
    return outputs, last


def test_auto_in_a_batch_speculates_only_where_the_batch_gains(engines):
    """`auto` prices a batched row's steps as its share of the round (rounds.py), not as the
    round's wall: rows whose drafts are all accepted cycle, rows of a drafter that is never
    accepted run plain steps with a probe now and then (a batch probing no more often than one
    generation), and every row's output is the target's."""
    base = engines["qwen3"]
    prompts = [_prompt(base, n, seed) for n, seed in ((6, 1), (11, 2), (15, 3), (19, 4), (23, 5), (27, 6))]
    n_tokens = 120
    references = {len(p): p + _alone(base, Row(p, n_tokens + 16, speculation="off")) for p in prompts}
    # Its own measurements, of modeled costs (a cycle of 16 costs 5.5 steps, as on a CPU): what
    # auto chooses does not hang on the load of the machine running the test.
    clock = CostClock(lag=1)
    fresh = Engine(CostedTarget(base.target, clock), base.tokenizer, base.drafter, prefill_chunk=16, clock=clock)
    outputs, stats = _auto_batch(fresh, prompts, n_tokens)
    for p, out in zip(prompts, outputs):
        assert out == references[len(p)][len(p):][:n_tokens]
    cycles, steps = sum(s.cycles for s in stats), sum(s.cycles + s.plain_steps for s in stats)
    # Probes once in a while, each narrower width tried once it looks cheaper than the block, and
    # short streaks where a row's drafts were accepted by chance.
    assert 0 < cycles <= 0.1 * steps, (cycles, steps, stats[0].speculation_note)
    assert all(re.search(r"shares of a round of [2-6]\)$", s.speculation_note) for s in stats)
    forced = RowForcedDrafter(references, {len(p): [15] for p in prompts}, base.target.vocab_size,
                              base.drafter.config.target_layer_ids)
    clock = CostClock(lag=1)
    engine = Engine(CostedTarget(base.target, clock), base.tokenizer, forced, prefill_chunk=64,  # (a prompt is
                    clock=clock)  # one context block)
    outputs, stats = _auto_batch(engine, prompts, n_tokens)
    for p, out in zip(prompts, outputs):
        assert out == references[len(p)][len(p):][:n_tokens]
    assert sum(s.tokens_from_cycles for s in stats) > 0.6 * len(prompts) * n_tokens, [s.speculation_note for s in stats]


@pytest.mark.parametrize("rows", [1, 3])
def test_a_row_drafting_alone_drafts_ahead_and_rows_together_do_not(engines, rows):
    """In `step_together`'s rounds a row that drafts alone queues its next block ahead of its read,
    as a generation alone does; rows drafting in the same round decline that (their blocks batch
    into one drafter forward after their reads). Either way every row's output is the target's at
    every acceptance length."""
    from forced import EVERY_LENGTH, ForcedDrafter, tokens

    from dflash_core.batching import generate_together

    engine = engines["qwen3"]
    prompt = _prompt(engine, 12, 1)
    reference = _alone(engine, Row(prompt, 176, speculation="off"))
    forced = ForcedDrafter(list(prompt) + reference, len(prompt), EVERY_LENGTH, engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    forced_engine = Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)
    requests = [dict(prompt_tokens=prompt, max_tokens=160, speculation="on", stop_token_ids=set())] * rows
    for chunks in generate_together(forced_engine, requests):
        assert tokens(chunks) == reference[:160] and chunks[-1].stats.cycles >= len(EVERY_LENGTH)
    assert (forced.drafted_ahead > 0) == (rows == 1)
