"""speculation: auto — switching between cycles of any width and plain target steps at every
point keeps the output exactly the target's; the controller picks what is faster here."""

from __future__ import annotations

import statistics
from dataclasses import replace

import pytest
from cost_clock import CostClock, CostedTarget
from families import ENGINE_FAMILIES
from families import sample_prompt as _prompt
from forced import ForcedDrafter

from dflash_core.engine import Engine
from dflash_core.grammar import GrammarSpec
from dflash_core.sampling import SamplingParams
from dflash_core.speculation import AcceptanceCounts, AutoSpeculation, ModelSpeculation, RefreshSchedule, Timings

N_TOKENS = 200
# Every plan in turn next to every other: plain steps alone and in runs, every width 2..16.
PLANS = [0, 16, 0, 0, 2, 16, 5, 0, 3, 16, 9, 0, 0, 0, 15, 4, 16, 16, 6, 0, 7, 8, 10, 0, 11, 12, 13, 14, 0, 2]


def _accept_schedule(plans):
    """Drafts the forced drafter gets accepted in each cycle of `plans`: all of them at a width's
    first cycle (so every length 1..15 occurs), else fewer, none every third cycle."""
    out, seen = [], set()
    for k, width in enumerate(w for w in plans if w):
        out.append(width - 1 if width not in seen else (0 if k % 3 == 0 else k % width))
        seen.add(width)
    return out


ACCEPT = _accept_schedule(PLANS)


class Scheduled:
    """A SpeculationPolicy that follows a fixed list of plans, recording what it saw."""

    def __init__(self, plans):
        self.plans, self.i, self.seen = plans, 0, []

    def plan(self, context):
        width = self.plans[self.i % len(self.plans)]
        self.i += 1
        return width

    def observe(self, width, context, seconds, accepted):
        self.seen.append((width, accepted))

    def note(self):
        return None


SAMPLINGS = {"greedy": SamplingParams(), "seeded": SamplingParams(temperature=0.9, top_p=0.95, seed=7)}


def _tokens(engine, prompt, sampling, **kwargs):
    chunks = list(engine.generate(prompt, max_tokens=N_TOKENS, stop_token_ids=set(), sampling=sampling, **kwargs))
    return [t for c in chunks for t in c.token_ids], chunks[-1].stats


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_switching_at_every_point_is_lossless(engines, family, sampling):
    engine = engines[family]
    prompt = _prompt(engine)
    params = SAMPLINGS[sampling]
    reference, _ = _tokens(engine, prompt, params, speculative=False)
    # The real (random) drafter: mostly rejected drafts, every width and plain steps in between.
    policy = Scheduled(PLANS)
    tokens, stats = _tokens(engine, prompt, params, speculation=policy)
    assert tokens == reference
    assert stats.plain_steps > 0 and set(stats.cycle_widths) == set(PLANS) - {0}
    assert stats.tokens_from_cycles + stats.tokens_from_steps + 1 == stats.generated_tokens
    # A forced drafter: long acceptances too, at every width, with plain steps between cycles.
    forced = ForcedDrafter(list(prompt) + reference + [0] * 16, len(prompt), ACCEPT, engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    forced_engine = Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)
    policy = Scheduled(PLANS)
    tokens, stats = _tokens(forced_engine, prompt, params, speculation=policy)
    assert tokens == reference
    assert {a for w, a in policy.seen if w} == set(range(16))


class Ahead(Scheduled):
    """`Scheduled`, saying it keeps to cycles: each cycle drafts the next block at its own width
    before its read, and the next plan uses those drafts or drops them."""

    speculating = True


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=str)
@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_switching_with_drafts_ahead_is_lossless(engines, family, sampling):
    """Drafts queued ahead of each read, used where the next plan is a cycle of their width and
    dropped where it is a plain step or another width: the drafter's context is the same either
    way, and so are the tokens."""
    engine = engines[family]
    prompt = _prompt(engine)
    params = SAMPLINGS[sampling]
    reference, _ = _tokens(engine, prompt, params, speculative=False)
    drafting_ahead = engine.drafter.with_kernels(replace(engine.drafter.kernels, draft_ahead=True))  # (off on a CPU)
    for drafter in (drafting_ahead, ForcedDrafter(list(prompt) + reference + [0] * 16, len(prompt), ACCEPT,
                                                  engine.target.vocab_size, engine.drafter.config.target_layer_ids)):
        calls = []
        real = drafter.propose
        ahead_engine = Engine(engine.target, engine.tokenizer, drafter, prefill_chunk=16)
        drafter.propose = lambda *args, **kwargs: calls.append("start" in kwargs) or real(*args, **kwargs)
        policy = Ahead(PLANS)
        try:
            tokens, stats = _tokens(ahead_engine, prompt, params, speculation=policy)
        finally:
            del drafter.propose
        assert tokens == reference
        assert set(stats.cycle_widths) == set(PLANS) - {0}
        # Every cycle drafted the next block ahead; a cycle right after a cycle of its width took
        # those drafts, the others drafted after their read (the drafts ahead dropped). The output's
        # end leaves one cycle queued, not read.
        widths = [w for w, _ in policy.seen]
        cycles = sum(1 for w in widths if w)
        took = sum(1 for a, b in zip(widths, widths[1:]) if b and a == b)
        assert took > 0
        assert calls.count(True) in (cycles, cycles + 1)
        assert calls.count(False) in (cycles - took, cycles - took + 1)


def test_a_probe_drafts_its_timed_cycle_ahead(engines):
    """Mostly off (its cycles never accepted), auto probes with two cycles of one width, the first
    not timed; each queues the next block's drafts ahead of its read, as a streak's cycles do, so
    the timed one does a streak cycle's host work (not a draft after its read, dearer; not none,
    cheaper). So a block drafted after a read (a probe's first cycle) is followed by two drafted
    ahead, but at the output's end; and the output is the target's."""
    engine = engines["qwen3"]
    prompt = _prompt(engine)
    reference, _ = _tokens(engine, prompt, SAMPLINGS["greedy"], speculative=False)
    forced = ForcedDrafter(list(prompt) + reference + [0] * 16, len(prompt), [0], engine.target.vocab_size,
                           engine.drafter.config.target_layer_ids)
    ahead = []  # for each block drafted: whether ahead of the read
    real = forced.propose
    forced.propose = lambda *args, **kwargs: ahead.append(kwargs.get("start") is not None) or real(*args, **kwargs)
    clock = CostClock()  # auto judges by modeled costs: a cycle dearer than a step, as anywhere
    probing = Engine(CostedTarget(engine.target, clock), engine.tokenizer, forced, prefill_chunk=16, clock=clock)
    tokens, stats = _tokens(probing, prompt, SAMPLINGS["greedy"], speculation="auto")
    assert tokens == reference
    assert 0 < stats.cycles < N_TOKENS / 2  # it probed, and was mostly off
    assert ahead[:3] == [False, True, True]
    assert all(ahead[i + 1 : i + 3] == [True, True] for i, now in enumerate(ahead[:-2]) if not now), ahead


def _controller(block=16):
    return AutoSpeculation(Timings(), AcceptanceCounts(block - 1, decay=0.98), block)


def _feed(policy, context, step, cycle, accepted, n):
    """Run n planned steps against a machine whose plain step takes `step` s and a cycle of
    width w `cycle(w)` s, accepting `accepted(w)` drafts; return the plans."""
    plans = []
    for _ in range(n):
        width = policy.plan(context)
        plans.append(width)
        a = accepted(width) if width else 0
        policy.observe(width, context, step if width == 0 else cycle(width), a)
        context += a + 1
    return plans


def test_auto_turns_cycles_off_when_they_lose_and_keeps_probing():
    """A CPU-like machine: a cycle costs its width in steps and drafts are never accepted."""
    policy = _controller()
    plans = _feed(policy, 100, 0.01, lambda w: 0.01 * w + 0.005, lambda w: 0, 600)
    tail = plans[100:]
    assert tail.count(0) / len(tail) > 0.95  # plain steps, nearly always
    assert any(plans[100:])  # still probing now and then
    probes = [i for i, w in enumerate(plans) if w]
    # Probes back off (each probe is two cycles: the first, after plain steps, is not timed).
    gaps = [j - i for i, j in zip(probes, probes[1:]) if j - i > 1]
    assert gaps == sorted(gaps) and gaps[-1] >= 64, gaps
    assert "against a step of 10.0 ms" in policy.note()


def test_a_losing_probe_waits_until_probing_has_cost_a_fiftieth():
    """This project's CPU with the demo pair: a cycle costs about 9 plain steps and (here) yields
    one token, at any width. After a probe has measured that, the next waits until probing has
    cost at most 2 % of the steps, not just twice the last interval: over six short generations of
    one model (its probe schedule shared, as in a server), the first one's exploration included,
    cycles cost 11 % more time than plain steps alone would, against 25 % with the doubling alone."""
    from dflash_core.speculation import ModelSpeculation

    model = ModelSpeculation(16)
    step, cycle = 0.035, 0.315
    plans = [w for _ in range(6) for w in _feed(model.policy("auto"), 64, step, lambda w: cycle, lambda w: 0, 48)]
    seconds = sum(cycle if w else step for w in plans)
    assert seconds <= 1.12 * len(plans) * step, seconds / (len(plans) * step)
    probes = [i for i, w in enumerate(plans) if w]
    after_first_look = [j - i for i, j in zip(probes, probes[1:]) if j - i > 1][1:]  # (each probe is two cycles)
    assert all(gap >= 0.02 ** -1 * 8 for gap in after_first_look), probes


def test_a_probe_comes_soon_after_a_winning_streak_ends():
    """Cycles lost long enough for the probe wait to grow long, then won for a while, then stopped:
    the next probe comes after the shortest wait, not after what was left of the wait before."""
    policy = _controller()
    accepting = [False]
    machine = dict(step=0.01, cycle=lambda w: 0.03, accepted=lambda w: w - 1 if accepting[0] else 0)
    _feed(policy, 100, n=400, **machine)  # losing: the wait grows to some hundreds of steps
    assert policy.probes.interval >= 100, policy.probes
    accepting[0] = True
    won = [w for w in _feed(policy, 100, n=1000, **machine)]
    assert won[-100:].count(0) < 5  # speculating (a refresh now and then)
    accepting[0] = False
    after = _feed(policy, 100, n=300, **machine)
    stopped = next(i for i in range(len(after)) if not any(after[i:i + 8]))  # (not a refresh's steps)
    probe = next(i for i in range(stopped, len(after)) if after[i])
    assert probe - stopped <= 2 * policy.probes.shortest, after


def test_an_unjudged_probe_never_shortens_the_wait():
    """A probe the generation ended before judging doubles the wait up to `longest`; a wait already
    longer (set by a losing probe) stays."""
    from dflash_core.speculation import ProbeSchedule

    probes = ProbeSchedule()
    probes.lost(8.0)  # a CPU-like loss: 400 steps
    waits = []
    for _ in range(2000):
        if probes.due():
            waits.append(probes.interval)
    assert waits and min(waits) >= 400, waits


def test_a_zero_second_sample_counts_as_untimed():
    """A clock too coarse for a step gives 0 s: the sample is not a price (a price of 0 would divide
    every rate by zero) and `auto` keeps deciding."""
    policy = _controller()
    plans = _feed(policy, 100, 0.0, lambda w: 0.0, lambda w: 1, 40)
    assert policy.timings.count(0) == 0 and all(policy.timings.count(w) == 0 for w in policy.widths)
    assert len(plans) == 40


def test_a_batch_refreshes_all_its_rows_in_one_round():
    """8 rows cycling on a GPU-like machine, each observing its last step then planning the next in
    the engine's order (the model's count of cycles moving between them): when a refresh is due,
    every row runs its plain step in the same round, so that round prices a step for all of them;
    no round mixes refreshing rows with cycling ones, and none is skipped."""
    model = ModelSpeculation(16)
    policies = [model.policy("auto", batched=True) for _ in range(8)]
    plans, log, seconds = [0] * 8, [], 0.0
    for _ in range(1500):
        wall = 0.010 + 0.0002 * sum(w or 1 for w in plans) + 0.001 * sum(1 for w in plans if w)
        seconds += wall
        for i, p in enumerate(policies):
            p.observe(plans[i], 100, wall, min(6, plans[i] - 1) if plans[i] else 0)
            plans[i] = p.plan(100)
        model.rounds.end_round([w or 1 for w in plans], True, seconds)
        log.append(list(plans))
    tail = log[300:]
    refreshing = [r for r in tail if 0 in r]
    assert refreshing and all(r == [0] * 8 for r in refreshing), [r for r in refreshing if r != [0] * 8]
    assert len(refreshing) <= len(tail) / 32


def test_auto_follows_a_generation_whose_acceptance_changes():
    """A GPU-like machine (a cycle costs 1.8 steps at any width) and a generation whose drafts are
    rejected for 60 tokens, then accepted 5 at a time for 60, and so on: auto cycles through the
    good stretches and steps through the bad ones. A probe there costs under a step, so it comes
    again within a few dozen steps, however many came before (a schedule that kept doubling its
    wait would have gone quiet for hundreds of steps), and the counts favour the last cycles, so a
    stretch's turn is seen within a few cycles. Against always-on and plain steps, which both make
    about 100 tok/s here, auto makes over a tenth more (the rule before, 1.0x)."""
    policy = _controller()
    step, cycle, made, seconds, context, plans = 0.01, 0.018, 0, 0.0, 100, []
    while made < 2400:
        width = policy.plan(context)
        good = (made // 60) % 2 == 1
        accepted = min(5, width - 1) if width and good else 0
        policy.observe(width, context, step if width == 0 else cycle, accepted)
        plans.append((width, good, accepted + 1))
        seconds += step if width == 0 else cycle
        made += accepted + 1
        context += accepted + 1
    assert made / seconds > 1.1 * 100, made / seconds
    later = plans[len(plans) // 4:]
    good_tokens = [(w, n) for w, good, n in later if good]
    bad_tokens = [(w, n) for w, good, n in later if not good]
    assert sum(n for w, n in good_tokens if w) > 0.7 * sum(n for _, n in good_tokens)  # made by cycles
    assert sum(n for w, n in bad_tokens if w == 0) > 0.5 * sum(n for _, n in bad_tokens)  # most by plain steps


def test_a_cycle_is_timed_only_after_a_cycle_of_its_width():
    """A first cycle, after plain steps or a cycle of another width, pays what a run of cycles does
    not (a kernel compiled on first use; with CUDA graphs, a new op sequence's graphs): here 20
    steps' worth, against 2 steps for 7 tokens in a run. Priced by its first cycles, a width would
    look like a loss forever (each probe is such a first cycle); timed only after a cycle of its
    width, it is priced as a run repeats it, and auto speculates."""
    policy = _controller()
    step, last, plans, context = 0.01, None, [], 100
    for _ in range(400):
        width = policy.plan(context)
        accepted = min(6, width - 1) if width else 0
        policy.observe(width, context, step if width == 0 else (0.02 if width == last else 0.2), accepted)
        plans.append(width)
        last, context = width, context + accepted + 1
    tail = plans[100:]
    assert sum(1 for w in tail if w) > 0.9 * len(tail), plans
    # A probe is two cycles of one width: the first is not timed, the second is.
    first = plans.index(16)
    assert plans[first + 1] == 16


def test_a_plain_step_is_timed_only_inside_a_run(engines):
    """Read to read is a step's time only where it and the next step were queued alike. The
    engine queues a plain step before reading the one ahead of it, so inside a run of plain steps
    each read pays for one step; the first of a run (queued after a cycle's read) also pays for
    building the second, and the last was done before the one ahead of it was read (about 0 ms,
    which made a plain step look free). The generation's first step is not timed either: it ran
    while the first token went out. Cycles, and a plain step alone between cycles, are timed."""
    engine = engines["qwen3"]
    plans = [16, 0, 0, 0, 0, 4, 4, 0, 16, 0, 0, 2]
    policy = Scheduled(plans)
    seconds = []
    policy.observe = lambda width, context, s, accepted: seconds.append(s)
    _tokens(engine, _prompt(engine), SamplingParams(), speculation=policy)
    ran = [plans[i % len(plans)] for i in range(len(seconds) + 1)]
    expected = [i > 0 and (ran[i] != 0 or (i > 0 and ran[i - 1] == 0) == (ran[i + 1] == 0))
                for i in range(len(seconds))]
    assert [s is not None for s in seconds] == expected
    assert expected.count(True) > expected.count(False) > 2  # (each kind occurs)
    assert all(s > 0 for s in seconds if s is not None)
    # Under a grammar no step is queued early (its next mask needs this token): each is timed.
    policy = Scheduled(plans)
    seconds = []
    policy.observe = lambda width, context, s, accepted: seconds.append(s)
    list(engine.generate(_prompt(engine), max_tokens=60, stop_token_ids=set(), speculation=policy,
                         grammar=GrammarSpec("regex", "[a-z ]{0,400}")))
    assert len(seconds) > len(plans) and seconds[0] is None and all(s is not None for s in seconds[1:])


def test_a_refresh_runs_plain_steps_until_one_is_timed(engines):
    """While cycles win, auto runs plain steps now and then to keep a step's time current. As only
    a step inside a run is timed (above), a refresh runs plain steps until one is: each run of
    them is three steps, the middle one timed, and cycles go on after it."""
    engine = engines["qwen3"]
    prompt = _prompt(engine)

    def tokens_of(engine, **kwargs):
        return [t for c in engine.generate(prompt, max_tokens=480, stop_token_ids=set(), **kwargs) for t in c.token_ids]

    reference = tokens_of(engine, speculative=False)
    forced = ForcedDrafter(list(prompt) + reference + [0] * 16, len(prompt), [15] * 480,
                           engine.target.vocab_size, engine.drafter.config.target_layer_ids)
    forced_engine = Engine(engine.target, engine.tokenizer, forced, prefill_chunk=16)
    policy = AutoSpeculation(Timings(), AcceptanceCounts(15, decay=0.98), 16,
                             refreshes=RefreshSchedule(shortest=4, longest=4))
    seen, observe = [], policy.observe
    policy.observe = lambda width, context, s, accepted: (seen.append((width, s is not None)),
                                                          observe(width, context, s, accepted))
    assert tokens_of(forced_engine, speculation=policy) == reference
    runs, run = [], []
    for width, timed in seen:
        if width == 0:
            run.append(timed)
        elif run:
            runs, run = runs + [run], []
    assert len(runs) >= 3  # the opening one (no step timed yet) and refreshes
    assert all(run == [False, True, False] for run in runs), seen
    assert policy.timings.count(0) == len(runs)


def test_one_slow_sample_does_not_keep_a_width_off():
    """auto runs width 8 (timed often) and has timed the full block once, at 2 s (a burst of other
    work); the block's cycles really take what width 8's do and make 11 tokens against 8. A width
    that is not chosen is not timed again, so priced by that sample alone the block would stay off;
    after each refresh step a width timed fewer than three times is tried again, and then kept."""
    policy = _controller()
    for _ in range(5):
        policy.timings.record(8, 100, 0.018)
    policy.timings.record(16, 100, 2.0)
    for _ in range(4):
        policy.prior.add(16, 10)
    step, plans, context = 0.01, [], 100
    policy.timings.record(0, 100, step)
    for _ in range(300):
        width = policy.plan(context)
        accepted = min(10, width - 1) if width else 0
        policy.observe(width, context, step if width == 0 else 0.018, accepted)
        plans.append(width)
        context += accepted + 1
    assert plans[:5] == [8] * 5  # it started on width 8
    tail = plans[-100:]
    assert tail.count(16) > 0.9 * len(tail), plans


def test_timings_outvote_a_one_off_sample():
    """A sample that paid a one-off cost (a kernel's compile, a graph instantiated, a burst of other
    work) does not move the estimate; a lasting change does, within a few samples."""
    timings = Timings()
    timings.record(16, 1000, 2.0)
    timings.record(16, 1000, 0.010)
    assert timings.estimate(16, 1000) == 0.010  # of two, the faster: noise only adds time
    for seconds in (0.011, 0.010, 0.012):
        timings.record(16, 1000, seconds)
    assert timings.estimate(16, 1000) == 0.011
    for _ in range(3):
        timings.record(16, 1000, 0.020)
    assert timings.estimate(16, 1000) == 0.020
    assert timings.estimate(16, 5000) == 0.020  # the nearest bucket measured


def test_auto_speculates_when_cycles_win():
    """A GPU-like machine: a cycle costs about two steps whatever its width, 6 drafts accepted."""
    policy = _controller()
    plans = _feed(policy, 100, 0.01, lambda w: 0.02, lambda w: min(6, w - 1), 200)
    tail = plans[20:]
    # Full cycles, but for a few plain steps every ~130 cycles that keep the step's time current,
    # and a width timed once or twice tried again after them (two cycles each time).
    assert tail.count(0) <= len(tail) // 30 + 1
    assert len(tail) - tail.count(16) - tail.count(0) <= 2 * 3


def _cycles_between_steps(plans):
    """Cycles between consecutive plain steps, after the first cycle."""
    gaps, run = [], None
    for width in plans:
        if width and run is not None:
            run += 1
        elif not width:
            if run:
                gaps.append(run)
            run = 0
    return gaps


def test_refreshes_of_the_step_cost_at_most_two_percent():
    """Refreshing a step's price costs three plain steps in place of cycles (and about two steps and
    a cycle more): refreshes come as far apart as keeps that within 2 % of the cycles' time. Where
    cycles win narrowly (3 tokens for 2.5 steps) a refresh costs 2 cycles' time: every 100 cycles;
    where they win by far (16 tokens for a step's time) it costs 5.8, which would be every 290: the
    longest wait, 256."""
    far = _feed(_controller(), 100, 0.01, lambda w: 0.01, lambda w: w - 1, 1500)
    narrow = _feed(_controller(), 100, 0.01, lambda w: 0.025, lambda w: min(2, w - 1), 900)
    gaps = _cycles_between_steps(far)[1:]
    assert gaps and all(g == 256 for g in gaps), gaps
    gaps = _cycles_between_steps(narrow)[1:]
    assert gaps and all(100 <= g <= 104 for g in gaps), gaps


def test_refreshes_count_the_model_s_cycles_not_one_generation_s():
    """A server's generations are often shorter than the wait between refreshes: the cycles are
    counted per model, so 80 generations of 12 cycles each refresh as one long one would (every
    154 cycles here), instead of each running its plain steps anew (or never)."""
    model = ModelSpeculation(16)
    plans = []
    for _ in range(80):
        plans += _feed(model.policy("auto"), 100, 0.01, lambda w: 0.02, lambda w: min(6, w - 1), 12)
    gaps = _cycles_between_steps(plans)[1:]
    one = _cycles_between_steps(_feed(_controller(), 100, 0.01, lambda w: 0.02, lambda w: min(6, w - 1), 960))[1:]
    assert len(gaps) >= 4 and all(154 <= g <= 158 for g in gaps + one), (gaps, one)


@pytest.mark.parametrize("n", [1, 8])
def test_one_generation_s_refresh_serves_the_others_taking_turns(n):
    """n generations of one model take turns on the worker (batching off), each planning and
    observing in the engine's order (a plain step planned before the one ahead is observed; timed
    only inside a run of them). One refresh is due for the model, not one per generation: the
    share of plain steps does not grow with n."""
    model = ModelSpeculation(16)
    policies = [model.policy("auto") for _ in range(n)]
    for p in policies:
        p.timings.record(0, 100, 0.01)  # a step priced before (as the generations' opening steps do)
    state = [{"width": p.plan(100), "queued_early": False, "read": False} for p in policies]
    widths = []
    for turn in range(8000 // n):
        for p, s in zip(policies, state):
            width = s["width"]
            planned = p.plan(101) if width == 0 else None
            timed = s["read"] and s["queued_early"] == (planned == 0)
            p.observe(width, 100, (0.01 if width == 0 else 0.02) if timed else None, min(6, width - 1) if width else 0)
            widths.append(width)
            s["read"], s["queued_early"] = True, planned == 0
            s["width"] = planned if planned is not None else p.plan(100)
    tail = widths[len(widths) // 4:]
    assert tail.count(0) / len(tail) < 0.025, tail.count(0) / len(tail)


def test_a_refresh_whose_generation_ended_is_taken_up_soon():
    """A generation starts a refresh (the others need not) and ends before its plain step is timed
    (closed, a stop token): another generation refreshes within twice the shortest wait, not after a
    whole interval with the step's price left stale."""
    model = ModelSpeculation(16)
    first = model.policy("auto")
    _feed(first, 100, 0.01, lambda w: 0.02, lambda w: min(6, w - 1), 400)  # long enough to refresh
    while first.plan(100) != 0:  # up to the refresh's first plain step, then the generation ends
        first.observe(16, 100, 0.02, 6)
    second = model.policy("auto")
    plans = _feed(second, 100, 0.01, lambda w: 0.02, lambda w: min(6, w - 1), 200)
    assert 0 in plans[:2 * model.refreshes.shortest + 4], plans
    assert model.refreshes.claimed is None  # its refresh priced a step


def test_auto_finds_the_width_that_pays():
    """Cycle cost grows with width (CPU) and only the first 3 drafts are ever accepted: a narrow
    width beats both plain steps and the full block."""
    policy = _controller()
    plans = _feed(policy, 100, 0.01, lambda w: 0.004 + 0.003 * w, lambda w: min(3, w - 1), 800)
    tail = plans[-200:]
    assert max(set(tail), key=tail.count) == 4


# P(accepted through block position j) on held-out sequences, as the demo drafter's training measured
DEMO_THROUGH = (0.6, 0.45, 0.35, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02, 0.01, 0.0, 0.0, 0.0, 0.0, 0.0)


def _simulated_h100(expected, seed: int, generations: int, unlucky: int = 0, noise: float = 0.0) -> list[list[int]]:
    """The demo pair on a simulated H100, each generation's 128 plans: a plain step 4 ms, a cycle
    7.6 ms at any width and twice that right after a plain step, drafts accepted by position as
    DEMO_THROUGH says, but none in the model's first `unlucky` cycles; `expected`: the drafter's
    report the model starts from (None: none); `noise`: the sigma of a lognormal factor on every
    time (0: none drawn)."""
    import random

    rng, model, cycles, out = random.Random(seed), ModelSpeculation(16, expected), 0, []
    for _ in range(generations):
        policy, context, last, plans = model.policy("auto"), 100, 0, []
        for _ in range(128):
            width = policy.plan(context)
            accepted, seconds = 0, 0.004 * (rng.lognormvariate(0, noise) if noise else 1.0)
            if width:
                cycles, draw = cycles + 1, rng.random()
                accepted = 0 if cycles <= unlucky else min(sum(draw < t for t in DEMO_THROUGH), width - 1)
                seconds = 0.0076 * (2 if last == 0 else 1) * (rng.lognormvariate(0, noise) if noise else 1.0)
            policy.observe(width, context, seconds, accepted)
            plans.append(width)
            context, last = context + accepted + 1, width
        out.append(plans)
    return out


def test_noisy_timings_do_not_narrow_cycles_that_cost_the_same_at_any_width():
    """A GPU-like machine whose samples vary (+-10 %, as an H100's did): a cycle costs 7.6 ms at any
    width, the drafter's acceptance by position as the demo pair's. The lower medians of noisy
    samples rank the widths by luck, a width timed less often looking cheaper; a narrower width runs
    only where it beats the wider ones by `width_tie` (5 %), so over 90 % of the cycles stay 16 wide
    (without it, a quarter ran narrower, giving up the drafts past their width for nothing)."""
    widths = [w for seed in range(3) for plans in _simulated_h100(DEMO_THROUGH, seed, 8, noise=0.1)
              for w in plans if w]
    assert widths.count(16) >= 0.9 * len(widths), {w: widths.count(w) for w in set(widths)}  # (without `width_tie`: 0.75)


# P(accepted through block position j) of a code prompt's cycles on the demo pair (an H100's bench)
CODE_THROUGH = (0.84, 0.74, 0.68, 0.68, 0.58, 0.47, 0.47, 0.37, 0.32, 0.16, 0.16, 0.11, 0.05, 0.05, 0.05)


def test_narrow_cycles_do_not_keep_a_prompt_from_the_drafts_past_their_width():
    """A GPU where narrower cycles cost a little less (a step 4 ms, a cycle 4.75 ms at 16 wide, 4.35
    at 8), a drafter whose report and first two generations say its deep drafts are rare, then
    code prompts whose drafts are accepted deep (the whole block makes 5.8 tokens a cycle, 8 wide
    4.9). Width 8 looked best, and narrow cycles verify nothing past their width: without running
    the block now and then, the deep acceptance was never seen and the code prompts ran 8 wide
    (29 % of their cycles at 16 on average, none in some). Checked without noise: the same
    choices every run."""
    import random

    costs = {16: 0.00475, 8: 0.00435, 4: 0.00415, 2: 0.00405}
    whole_block = (1 + sum(CODE_THROUGH)) / costs[16]
    shares, rates = [], []
    for seed in range(5):
        rng, model = random.Random(seed), ModelSpeculation(16, DEMO_THROUGH)
        for through in (DEMO_THROUGH,) * 2 + (CODE_THROUGH,) * 3:
            policy, context, last, widths, made, seconds = model.policy("auto"), 100, 0, [], 0, 0.0
            for _ in range(128):
                width = policy.plan(context)
                accepted, took = 0, 0.004
                if width:
                    draw = rng.random()
                    accepted = min(sum(draw < t for t in through), width - 1)
                    took = costs[width] * (2 if last == 0 else 1)
                policy.observe(width, context, took, accepted)
                widths += [width] if width else []
                made, seconds, context, last = made + accepted + 1, seconds + took, context + accepted + 1, width
            if through is CODE_THROUGH:
                shares.append(widths.count(16) / len(widths))
                rates.append(made / seconds / whole_block)
    assert min(shares) >= 0.6 and statistics.mean(shares) >= 0.9, shares
    assert statistics.mean(rates) >= 0.95, rates  # (8 wide throughout: 0.84 of the whole block's rate)


def _feed_rounds(policies, rounds, wall, accepted, n, context=100):
    """Run n rounds in which every policy plans one step, on a machine where a round of T target
    tokens with k drafting rows takes `wall(T, k)` s; return each round's plans and the tokens and
    seconds of them all."""
    log, tokens_out, seconds, previous = [], 0, 0.0, None
    for _ in range(n):
        plans = [p.plan(context) for p in policies]
        tokens, drafting = sum(w or 1 for w in plans), sum(1 for w in plans if w)
        if previous is not None:
            seconds += previous  # the round before's forwards, read in this round
        rounds.end_round([w or 1 for w in plans], True, seconds)
        previous = wall(tokens, drafting)
        for p, w in zip(policies, plans):
            a = accepted(w) if w else 0
            tokens_out += a + 1
            p.observe(w, context, previous, a)
        log.append(plans)
    return log, tokens_out / (seconds + previous)


def test_auto_in_a_batch_prices_a_row_by_its_share_of_the_round():
    """8 rows on a CPU-like machine: a round costs 1 ms + 1 ms per target token + 0.5 ms per drafting
    row, and every cycle gets one draft accepted. One row's cycle among 7 plain steps lengthens
    the round 9 -> 10.5 ms for 2 tokens, which judged by the round's wall (a "step" of 9 ms) looks
    worth it; but it costs all 8 rows that time, and the batch is faster on plain steps (8 tokens
    per 9 ms against 16 per 21 ms when all cycle). Priced by shares, the rows stay plain, probing
    at most once in a while (probes count rounds, not rows' steps)."""
    from dflash_core.speculation import ModelSpeculation

    def wall(tokens, drafting):
        return 0.001 + 0.001 * tokens + 0.0005 * drafting

    model = ModelSpeculation(16)
    policies = [model.policy("auto", batched=True) for _ in range(8)]
    log, rate = _feed_rounds(policies, model.rounds, wall, lambda w: 1, 700)
    tail = log[-500:]
    assert 0 < sum(1 for plans in tail if any(plans)) < 0.1 * len(tail)  # plain rounds, a probe now and then
    seconds = sum(wall(sum(w or 1 for w in plans), sum(1 for w in plans if w)) for plans in tail)
    assert seconds <= 1.03 * len(tail) * wall(8, 0), seconds / (len(tail) * wall(8, 0))  # probes cost <= 3 %
    assert policies[0].note().endswith("against a step of 1.1 ms (shares of a round of 8)"), policies[0].note()
    # The same rows judging by the walls between their reads, as alone: they cycle, and lose.
    walls = ModelSpeculation(16)
    walls_log, walls_rate = _feed_rounds([walls.policy("auto") for _ in range(8)], walls.rounds, wall,
                                         lambda w: 1, 700)
    assert sum(w > 0 for plans in walls_log[-500:] for w in plans) > 0.5 * 8 * 500
    assert rate >= 0.97 * 8 / wall(8, 0)  # within 3 % of plain rounds
    assert rate > 1.1 * walls_rate


@pytest.mark.parametrize("rows", [8, 16])
def test_auto_in_a_batch_speculates_when_the_batch_gains(rows):
    """A GPU-like machine: a round costs 10 ms + 0.02 ms per target token + 1 ms per drafting row,
    and 6 drafts of each cycle are accepted: every row cycles, at width 8 (as many tokens as the
    full block, for fewer verified)."""
    from dflash_core.speculation import ModelSpeculation

    model = ModelSpeculation(16)
    log, _ = _feed_rounds([model.policy("auto", batched=True) for _ in range(rows)], model.rounds,
                          lambda tokens, drafting: 0.010 + 0.00002 * tokens + 0.001 * drafting,
                          lambda w: min(6, w - 1), 300)
    tail = [w for plans in log[-100:] for w in plans]
    assert tail.count(8) > 0.9 * len(tail), sorted(set(tail))
    # In a batch no step is timed alone (the rounds price it), so a refresh of the step's price is
    # one plain step, not a run waiting for a timed one.
    assert max(sum(1 for plans in log[-100:] if plans[row] == 0) for row in range(rows)) <= 2


def _text(path, out):
    if path == "/v1/chat/completions":
        return out["choices"][0]["message"]["content"]
    if path == "/v1/completions":
        return out["choices"][0]["text"]
    if path == "/v1/responses":
        return [item for item in out["output"] if item["type"] == "message"][0]["content"][0]["text"]
    return out["content"][0]["text"]


def test_every_endpoint_takes_the_speculation_mode(qwen3_pair):
    import httpx
    from live_server import LiveServer

    from dflash_core.settings import ModelSettings, Settings

    target, drafter = qwen3_pair
    settings = Settings(models=[ModelSettings(name="tiny", target=str(target), drafter=str(drafter))])
    base = {"model": "tiny", "temperature": 0}
    chat = {**base, "messages": [{"role": "user", "content": "Tell me about foxes."}], "max_tokens": 24,
            "chat_template_kwargs": {"enable_thinking": False}}
    requests = {
        "/v1/chat/completions": chat,
        "/v1/completions": {**base, "prompt": "The fox", "max_tokens": 24},
        "/v1/responses": {**base, "input": "Tell me about foxes.", "max_output_tokens": 24,
                          "reasoning": {"effort": "none"}},
        "/v1/messages": {**base, "messages": [{"role": "user", "content": "Tell me about foxes."}], "max_tokens": 24,
                         "thinking": {"type": "disabled"}},
    }
    with LiveServer(settings) as server:
        for path, body in requests.items():
            texts = {}
            for mode in ("off", "on", "auto"):
                response = httpx.post(server.url + path, json={**body, "dflash": {"speculation": mode}}, timeout=120)
                assert response.status_code == 200, (path, response.text)
                out = response.json()
                stats = out["dflash"]
                assert stats["speculation"] == mode and stats["speculative"] == (mode != "off"), (path, stats)
                if mode == "on":
                    assert stats["cycles"] > 0 and stats["plain_steps"] == 0
                texts[mode] = _text(path, out)
            assert texts["off"] == texts["on"] == texts["auto"], (path, texts)  # one output, whatever the mode
            bad = httpx.post(server.url + path, json={**body, "dflash": {"speculation": "sometimes"}}, timeout=30)
            assert bad.status_code == 400, (path, bad.text)
            assert ("type" in bad.json() and bad.json()["type"] == "error") if path == "/v1/messages" else "error" in bad.json()
        metrics = httpx.get(server.url + "/metrics").text
        assert 'dflash_spec_tokens_total{source="cycles"}' in metrics
        assert "dflash_spec_cycles_by_width_total" in metrics


@pytest.mark.parametrize("family", ENGINE_FAMILIES)
def test_a_generation_ending_on_plain_steps_leaves_an_exact_snapshot(engines, family):
    """Plain steps run one ahead of the host: the one queued when the generation ends is undone
    before the end is snapshotted, so the next turn restored from it equals a cold run."""
    from dflash_core.prefix_cache import PrefixCache

    engine = engines[family]
    cached = Engine(engine.target, engine.tokenizer, engine.drafter, prefill_chunk=16, prefix_cache=PrefixCache(10**9))
    prompt = _prompt(engine)
    first, _ = _tokens(cached, prompt, SamplingParams(), speculation=Scheduled([0, 0, 16, 0, 0, 0]))
    follow = prompt + first[:-1] + [first[-1], 7, 8, 9]
    hit, stats = _tokens(cached, follow, SamplingParams(), speculation=Scheduled([0]))
    assert stats.prefill_tokens < len(follow) - len(first)  # restored from the generation's end
    cold, _ = _tokens(engine, follow, SamplingParams(), speculative=False)
    assert hit == cold


def test_a_drafter_s_held_out_acceptance_outweighs_two_unlucky_first_cycles():
    """The H100 with the demo pair (docs/performance.md, "Never slower"): a plain step 4 ms, a cycle
    7.6 ms at any width and twice that after plain steps, acceptance by position as the drafter's
    training measured on held-out data (3.0 tokens a cycle: cycles win 1.6x), but for a server's
    first two cycles, which make one token each. A model that knows nothing of the drafter judges
    cycles by those two and waits long before it probes again: whole generations of plain steps.
    One given the drafter's held-out acceptance keeps speculating at full width."""
    unknown = [g for seed in range(4) for g in _simulated_h100(None, seed, 4, unlucky=2)]
    held_out = [g for seed in range(4) for g in _simulated_h100(DEMO_THROUGH, seed, 4, unlucky=2)]
    assert max(g.count(0) for g in unknown) > 100  # a generation of plain steps but for its probe
    assert max(g.count(0) for g in held_out) <= 32
    assert sum(g.count(16) for g in held_out) >= 0.9 * sum(map(len, held_out))


def test_acceptance_counts_expecting_a_measured_drafter():
    from dflash_core.speculation import AcceptanceCounts

    counts = AcceptanceCounts.expecting(4, (0.5, 0.25), cycles=8)
    assert counts.verified == [8.0, 8.0, 0.0, 0.0] and counts.accepted == [4.0, 2.0, 0.0, 0.0]
    policy = AutoSpeculation(Timings(), counts, 5)
    assert policy.expected_tokens(5) == 1.75  # 1 + 0.5 + 0.25, and nothing past what was measured


def test_the_held_out_acceptance_fades_with_every_step_the_model_runs():
    """A drafter's held-out acceptance speaks for it only until the model has run steps of its own:
    it fades by `held_out_fade` with every step, plain ones too, so that on a machine where cycles
    lose (a CPU) the few cycles of probes decide, not the report; the model's own history of those
    cycles does not fade with plain steps."""
    from dflash_core.speculation import ModelSpeculation

    model = ModelSpeculation(16, (0.6, 0.45, 0.35))
    assert model.held_out.verified[0] == 8.0
    policy = model.policy("auto")
    _feed(policy, 100, 0.01, lambda w: 0.01 * w + 0.005, lambda w: 0, 200)  # CPU-like: cycles lose
    probes = model.prior.verified[0]
    assert 0 < probes and model.held_out.verified[0] < 8.0 * 0.98 ** 199
    assert policy.expected_tokens(16) < 1.2  # the probes' (nothing accepted), not the report's 2.4
    held, prior = model.held_out.verified[0], list(model.prior.verified)
    for _ in range(10):
        policy.observe(0, 100, 0.01, 0)  # plain steps
    assert model.prior.verified == prior and model.held_out.verified[0] == pytest.approx(held * 0.98 ** 10)

