"""When a draft-verify cycle pays: `speculation: auto`.

A cycle costs a drafter forward plus a verify of `width` tokens and yields the accepted drafts
plus one token; a plain target step costs one forward and yields one token. On a GPU a 16-token
verify costs about one step, so cycles win at almost any acceptance; on MLX's CPU backend a
verify's cost grows with its width, and a drafter that is rarely accepted makes cycles several
times slower than plain steps. `AutoSpeculation` decides before every step, from what this
machine measured:

- `Timings` (one per model, shared by its generations): the wall time of a plain step and of a
  cycle of each width, per context-length bucket (powers of two), the lower median of recent
  samples. A cycle is timed only after a cycle of its width (a first one, after plain steps or
  another width, is run again to be timed), so that its price is what a run of cycles pays; a
  width timed only once or twice is tried again now and then while another one runs. A plain
  step is timed only inside a run of them (the engine queues each before reading the one ahead,
  so at a run's edges read to read is not one step's time).
- the acceptance by block position, from this generation's own cycles (its last ten or so
  weigh most, so a generation whose text turns easy or hard is followed) on top of the model's
  pooled history (`AcceptanceCounts` that decay), giving the expected tokens of a cycle of width w.

It runs cycles at the width with the best expected tokens per second (the widest within
`width_tie` of it: noisy timings must not narrow cycles that cost the same at any width) while that
beats plain steps by `margin` (with a few plain steps now and then to keep that time current, costing at most
2 % of the cycles' time); otherwise plain steps, whose taps (from the same target forward) go into
the drafter's context in one block before the next cycle, so switching back costs nothing, and a
probe cycle every so often. After a losing probe the next one waits as long as keeps probing
within 2 % of the plain steps, and no longer (a probe that lost 8 steps' worth, as on a CPU, waits
400; one that lost 0.8, as on a GPU, 40); until a probe has been judged, the wait doubles from 4.
Widths are explored from the block size down. Output never depends on any of this: a plain step
and a cycle both commit exactly the target's tokens.

Timings are wall times between this generation's reads: with other generations interleaved on
the worker, both kinds of step include their share of the others' time. In a batch, where every
row waits for the whole round, the prices are instead each row's share of a round and what a
cycle adds to it (`rounds.RoundCosts`), and probes count rounds, not rows' steps, so that a batch
probes no more often than one generation.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Protocol

from .rounds import RoundCosts

MODES = ("auto", "on", "off")


class SpeculationPolicy(Protocol):
    """Chooses each step of a speculating generation: 0 for a plain target step, else the width
    of a cycle (the bonus token plus width-1 drafts, 2..block size)."""

    def plan(self, context: int) -> int: ...

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        """The step planned was run: `seconds` its wall time (None: not timed), `accepted` the
        drafts a cycle got accepted."""

    def note(self) -> Optional[str]: ...

    # Optional, read by the engine: True while the next step is likely a cycle of the width just
    # planned, so that its drafts are worth queueing before the host reads this one (absent: never).
    # speculating: bool
    # Optional, read by the engine before `speculating`: `cycles_next(width)`, the same for the
    # cycle of `width` just planned, where a policy knows better (`AutoSpeculation`'s probes).


def _bucket(context: int) -> int:
    return max(0, int(math.log2(max(context, 1))))


class Timings:
    """Step (width 0) and cycle (width w) wall times, per context bucket: the lower median of the
    last `window` samples, so that a sample that paid a one-off cost (a kernel compiled on its first
    use, about 2 s on an H100; a CUDA graph instantiated; another process's burst) is outvoted
    instead of moving the estimate."""

    def __init__(self, window: int = 5):
        self.window = window
        self.samples: dict[int, dict[int, deque]] = {}  # width -> context bucket -> recent seconds

    def record(self, width: int, context: int, seconds: float) -> None:
        buckets = self.samples.setdefault(width, {})
        buckets.setdefault(_bucket(context), deque(maxlen=self.window)).append(seconds)

    def _nearest(self, width: int, context: int) -> Optional[deque]:
        """This bucket's samples, else the nearest bucket's (contexts grow slowly)."""
        buckets = self.samples.get(width)
        if not buckets:
            return None
        bucket = _bucket(context)
        if bucket not in buckets:
            bucket = min(buckets, key=lambda b: (abs(b - bucket), b))
        return buckets[bucket]

    def estimate(self, width: int, context: int) -> Optional[float]:
        """The lower median: noise only adds time, so of two samples the faster one."""
        samples = self._nearest(width, context)
        return sorted(samples)[(len(samples) - 1) // 2] if samples else None

    def count(self, width: int) -> int:
        """How many samples of `width` are kept, over every context bucket."""
        return sum(len(samples) for samples in self.samples.get(width, {}).values())


class AcceptanceCounts:
    """Per block position, the cycles that verified it and those that accepted its draft: one
    generation's (decay 1), or a model's over its recent generations (older cycles fading)."""

    def __init__(self, positions: int, decay: float = 1.0):
        self.accepted = [0.0] * positions
        self.verified = [0.0] * positions
        self.decay = decay

    @classmethod
    def expecting(cls, positions: int, through, cycles: float) -> "AcceptanceCounts":
        """Counts as if `cycles` full-width cycles had been accepted through position j in a share
        `through[j]` of them (positions past `through`: never verified)."""
        counts = cls(positions)
        for j, share in enumerate(list(through)[:positions]):
            counts.verified[j], counts.accepted[j] = float(cycles), cycles * float(share)
        return counts

    def fade(self, factor: float) -> None:
        """Every count `factor` as large (what they say stays; how much it weighs against others fades)."""
        for j in range(len(self.verified)):
            self.accepted[j] *= factor
            self.verified[j] *= factor

    def add(self, width: int, accepted: int) -> None:
        if self.decay != 1.0:
            self.fade(self.decay)
        for j in range(width - 1):
            self.verified[j] += 1
            self.accepted[j] += j < accepted


def auto_widths(block_size: int) -> list[int]:
    """The cycle widths `auto` chooses among, widest first: the block and 8, 4, 2 below it."""
    return sorted({w for w in (block_size, 8, 4, 2) if 2 <= w <= block_size}, reverse=True)


def _extrapolated(width: int, measured: dict[int, float]) -> float:
    """A cycle's time at `width` from other widths' (`AutoSpeculation.cycle_seconds`)."""
    below = [w for w in measured if w < width]
    above = [w for w in measured if w > width]
    if not below:
        return measured[min(above)] * width / min(above)
    if not above:
        return measured[max(below)]
    lo, hi = max(below), min(above)
    return measured[lo] + (measured[hi] - measured[lo]) * (width - lo) / (hi - lo)


@dataclass
class ProbeSchedule:
    """When a model that is not speculating tries a cycle again: after `interval` plain steps of
    any of its generations, the interval doubling after each probe up to `longest`, back to
    `shortest` once cycles win. Kept per model so that short generations do not each probe anew."""

    shortest: int = 4
    longest: int = 256
    interval: int = 4
    countdown: float = 0
    overhead: float = 0.02  # the share of the plain steps that losing probes may cost
    longest_wait: int = 4096

    def due(self, share: float = 1.0) -> bool:
        """Asked before each plain step; `share` is the step's part of its round (1/N in a round of
        N rows, each of which asks), so the interval counts rounds."""
        if self.countdown > 0:
            self.countdown -= share
            return False
        self.countdown = self.interval
        # (never shorter: a losing probe may have set a wait past `longest`)
        self.interval = max(self.interval, min(2 * self.interval, self.longest))
        return True

    def winning(self) -> None:
        self.interval = self.shortest

    def streak_ended(self) -> None:
        """A generation's cycles stopped winning: its next probe comes after the shortest wait
        (`winning` set it), not after what was left of a wait from before the streak."""
        self.countdown = min(self.countdown, self.interval)

    def lost(self, steps: float) -> None:
        """The last probe cost `steps` plain steps' worth more than it gave (0 or less: it gained,
        only not by the margin): the next one waits long enough that probing costs at most
        `overhead` of the steps between, and no longer. So a probe that costs little (a GPU, where a
        cycle is about two steps) comes again soon, whatever came before, and catches a generation
        whose acceptance has risen; one that costs a lot (a CPU) waits long."""
        self.interval = int(min(self.longest_wait, max(self.shortest, steps / self.overhead)))
        self.countdown = self.interval


@dataclass
class RefreshSchedule:
    """While a model speculates, when its generations run plain steps to keep a step's price
    current: once the cycles since a step was last priced took long enough that a refresh costs at
    most `overhead` of their time (as losing probes may cost of the plain steps, `ProbeSchedule`),
    from every `shortest` cycles to every `longest`. Kept per model, so that short generations do
    not each refresh anew, and one generation's refresh serves the others taking turns with it (taken
    up by another if it ends first; in a batch every row refreshes in the same round: the round is
    what gets priced). The step priced is
    the refreshing generation's context's; one that refreshes at another length re-prices its own
    only at its next refresh."""

    shortest: int = 32
    longest: int = 256
    overhead: float = 0.02
    cycles: float = 0.0  # cycles since a step was last priced (rounds, in a batch)
    claimed: Optional[float] = None  # `cycles` when a generation alone started the refresh under way
    _round: int = -1  # in a batch: the last round whose rows were told whether to refresh
    _round_due: bool = False  # what they were told

    def claim(self) -> None:
        """A generation alone starts a refresh: the others taking turns with it need not."""
        self.claimed = self.cycles

    def priced(self) -> None:
        """A step was priced (or a refresh gave up): the next refresh waits its turn."""
        self.cycles, self.claimed = 0.0, None

    def due(self, cost: float, round_number: Optional[int] = None) -> bool:
        """`cost`: what a refresh costs, in cycles' time. `round_number`: in a batch, the round this
        row plans; its rows all get the answer the first to ask got (rows plan one after the other
        while the count moves), and a refresh due starts the count again."""
        if round_number is not None and round_number == self._round:
            return self._round_due
        if self.claimed is not None and round_number is None:
            # Another generation is refreshing: the others need not, unless it has not priced a
            # step while they ran twice the shortest wait of cycles (it ended first: closed, or a
            # stop). Its plain steps add no cycles; the others' turns meanwhile add a few.
            return self.cycles - self.claimed >= 2 * self.shortest
        due = self.cycles >= min(self.longest, max(self.shortest, cost / self.overhead))
        if round_number is not None:
            self._round, self._round_due = round_number, due
            if due:
                self.priced()  # (the round's rows all refresh: its plain rows price the step)
        return due


@dataclass
class AutoSpeculation:
    """One generation's choices (see the module docstring)."""

    timings: Timings
    prior: AcceptanceCounts  # the model's, decaying
    block_size: int
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    rounds: Optional[RoundCosts] = None  # the model's batched rounds (None: never batched)
    refreshes: RefreshSchedule = field(default_factory=RefreshSchedule)
    # The drafter's held-out acceptance as counts beside `prior` (`ModelSpeculation.held_out`), fading
    # with every step the model runs, plain or cycle: it speaks for the drafter until the model has
    # run enough steps to say for itself (where cycles win, it has run cycles; where they do not,
    # plain steps, whose history of few cycles it then believes). None: no report (all zeros).
    held_out: Optional[AcceptanceCounts] = None
    held_out_fade: float = 0.98
    margin: float = 1.1
    # A narrower width runs only where its rate beats every wider one's by this: enough that +-10 %
    # noise per sample does not narrow cycles that cost the same at any width (a GPU), little
    # enough that a batch's narrower verify, 7-9 % cheaper a round, is still taken.
    width_tie: float = 1.05
    settled: int = 3  # samples of a width after which it is not explored again while another one runs
    refresh_steps: int = 4  # plain steps observed untimed after which a refresh gives up (one more
    # may be queued already)
    recheck_every: int = 16  # while off, plain steps between two full looks at the rates
    prior_weight: float = 8.0  # the model's history counts as this many of this generation's cycles
    recent: float = 0.9  # each cycle, this generation's older cycles count this much less
    speculating: bool = False
    widths: list[int] = field(init=False)  # the widths tried, widest first
    _counts: AcceptanceCounts = field(init=False)  # this generation's
    _note: Optional[str] = None
    _refreshing: int = 0  # plain steps run so far by a refresh under way (0: none is)
    _steps_since_check: int = 0
    _probe_width: Optional[int] = None
    _last: Optional[int] = None  # the width of the last step observed (0: a plain step)
    _untimed_cycle: bool = False  # it was a cycle whose time was not taken
    _probed: bool = False  # a cycle was run while off, not yet judged
    _first_seconds: Optional[float] = None  # a probe's first (untimed) cycle's wall time
    _first_ratio: float = 1.0  # what a probe's first cycle cost against its second (1 to 4)
    _explore: bool = False  # a refresh step just ran: look at the widths timed too few times
    # Cycles narrower than the block verify none of the drafts past their width, so what they say
    # of those drafts is the prior's (the drafter's report, the model's earlier cycles) and nothing
    # would change it. Now and then the whole block runs instead (two cycles: the second timed),
    # at most `wide_overhead` of the narrow cycles' time: on a GPU, where it costs about what a
    # narrow one does, every few cycles; on a CPU, where it costs several, rarely.
    wide_overhead: float = 0.03
    wide_cost: float = 0.25  # ... and at once after a narrow cycle accepted all it verified, where a
    # block cycle costs at most this much more than a narrow one
    _narrow_cycles: int = 0  # cycles run narrower than the block since the block last ran
    _narrow_full: bool = False  # the last cycle was narrower than the block and accepted all it verified

    def __post_init__(self):
        self.widths = auto_widths(self.block_size)
        self._counts = AcceptanceCounts(self.block_size - 1, decay=self.recent)
        if self.held_out is None:
            self.held_out = AcceptanceCounts(self.block_size - 1)

    def expected_tokens(self, width: int) -> float:
        """1 + the expected accepted drafts of a cycle of `width`: P(accepted through j), each
        from this generation's counts and the prior, the latter weighted as `prior_weight` cycles."""
        total, through = 1.0, 1.0
        held = self.held_out
        weight = self.prior_weight / ((self.prior.verified[0] + held.verified[0]) or 1.0)
        for j in range(width - 1):
            accepted = self._counts.accepted[j] + weight * (self.prior.accepted[j] + held.accepted[j])
            verified = self._counts.verified[j] + weight * (self.prior.verified[j] + held.verified[j])
            if verified <= 0:  # never verified this far: counted as never accepted
                break
            through = min(through, accepted / verified)  # P(every draft through j accepted)
            total += through
        return total

    def cycle_seconds(self, width: int, context: int) -> Optional[float]:
        """A cycle's measured time, else one extrapolated from the measured widths: linear between
        two, proportional to the width below the narrowest (as on a CPU), flat above the widest (as
        on a GPU). Optimistic on purpose: an unmeasured width that looks best gets tried."""
        measured = {w: t for w in self.widths if (t := self.timings.estimate(w, context)) is not None}
        if width in measured or not measured:
            return measured.get(width)
        return _extrapolated(width, measured)

    def _batch_rows(self) -> int:
        """The rows of this model's latest round when it was a batch (else 1: this one alone)."""
        rows = self.rounds.rows if self.rounds is not None else 0
        return max(rows, 1)

    def prices(self, context: int) -> tuple[Optional[float], dict[int, float], str]:
        """A plain step's price, each width's cycle's (those known) and what they are, as seen by
        this generation now: alone, their measured times; in a batch, the shares of a round."""
        rows = self._batch_rows()
        if rows > 1:
            priced = self.rounds.prices(rows, self.widths)  # (None until rounds were timed: plain steps until then)
            if priced is None:
                return None, {}, ""
            return *priced, f" (shares of a round of {rows})"
        cycles = {w: t for w in self.widths if (t := self.cycle_seconds(w, context)) is not None}
        return self.timings.estimate(0, context), cycles, ""

    def plan(self, context: int) -> int:
        share = 1.0 / self._batch_rows()
        if self._untimed_cycle and share == 1.0:
            return self._last  # a cycle not timed (after another step): run it again, timed
        if not self.speculating and self._probe_width is not None and self._steps_since_check < self.recheck_every:
            # Off, and nothing but the step's time has changed since the last look: decide again
            # only now and then (a step can take a millisecond; this runs before each one).
            self._steps_since_check += 1
            return self._probe_width if self.probes.due(share) else 0
        step, cycles, basis = self.prices(context)
        if step is None:
            return 0
        self._steps_since_check = 0
        rates = {w: self.expected_tokens(w) / t for w, t in cycles.items()}
        top = max(rates, key=rates.get) if rates else self.widths[0]
        # The width run: the widest whose rate is within `width_tie` of the best. Where widths cost
        # about the same (a GPU), the lower medians of noisy samples rank them by luck, a width timed
        # less often looking cheaper; a narrower width then gives up the drafts past it for nothing.
        best = max((w for w in rates if rates[w] * self.width_tie >= rates[top]), default=top)
        if not self.speculating and not (self._counts.verified[-1] or self.prior.verified[-1]
                                         or self.held_out.verified[-1]):
            top = best = self.widths[0]  # the block's last positions never verified: probe the whole block
        # Cycles go on while they beat steps at all; starting them, or going on where the expected
        # tokens rest mostly on the drafter's report rather than this model's own cycles, takes the
        # margin (where cycles are about even, as on a CPU, a report does not keep them going).
        keep = self.speculating and not self._mostly_reported()
        if rates and rates[top] > (1.0 if keep else self.margin) / step:
            self.speculating, self._note = True, None
            # A refresh's cost, in cycles: alone, three plain steps make their tokens where cycles
            # would have made them, and cost about two steps more at their edges (on an H100 three
            # cost about six: docs/performance.md); the cycle after them writes their taps (about a
            # cycle more). While cycles win (step > cycle / tokens) that is over 1 + 2/16 cycles.
            cost = (5 * step - 3 / rates[best]) / cycles[best] + 1  # (a cycle's time per token: 1 / rate)
            if self._refreshing or self.refreshes.due(cost, self.rounds.ended if share < 1.0 else None):
                # A step measured long ago (or under other load) would keep cycles on. Plain steps
                # until one is timed: the engine times a step only inside a run of them (engine.py).
                if not self._refreshing and share == 1.0:  # claimed: the model's other generations,
                    self.refreshes.claim()  # taking turns with this one, need not refresh too
                self._explore, self._refreshing = True, max(self._refreshing, 1)
                return 0
            if self._explore:  # after the refresh, a width timed 1 to `settled`-1 times (in all): one
                self._explore = False  # slow sample (a burst) must not keep it off for good
                unsettled = [w for w in self.widths if w != best and 0 < self.timings.count(w) < self.settled]
                if unsettled and share == 1.0:
                    return unsettled[0]
            if self._wide_due(best, cycles, share):
                return self.widths[0]
            return best
        if self.speculating:
            self.probes.streak_ended()
        self.speculating, self._refreshing = False, 0
        if rates and self._probed:  # what the probe just measured says cycles lose: wait accordingly
            # The next probe's loss: alone, two cycles, the first as dear as the last probe's was.
            cycle, made = cycles[best] / step, self.expected_tokens(best)
            self.probes.lost(cycle * (1 + self._first_ratio) - 2 * made if share == 1.0 else cycle - made)
        self._probed = False
        if rates:
            self._note = (f"cycle {1e3 * cycles[best]:.1f} ms for {self.expected_tokens(best):.2f} tokens "
                          f"(width {best}) against a step of {1e3 * step:.1f} ms{basis}")
        # A probe of the most promising width (the block, before anything is measured).
        self._probe_width = best if rates else None
        return best if self.probes.due(share) else 0

    def _wide_due(self, best: int, cycles: dict[int, float], share: float) -> bool:
        """Whether a cycle planned at `best` runs the whole block instead, to verify the drafts past
        `best` (`wide_overhead`). Alone only: a batch's rows are priced by rounds."""
        block = self.widths[0]
        if best == block or share < 1.0:
            self._narrow_cycles = 0
            return False
        self._narrow_cycles += 1
        narrow, wide = cycles.get(best), cycles.get(block)
        # Two block cycles against two narrow ones, as a share of the narrow cycles between them.
        extra = 2 * max(0.0, wide - narrow) / narrow if narrow and wide else 0.0
        # A narrow cycle that accepted every draft it verified is the one sign that the drafts past
        # it may be accepted too: the block runs next where it costs little more (a GPU).
        full, self._narrow_full = self._narrow_full, False
        due = (full and extra <= 2 * self.wide_cost) or self._narrow_cycles > max(4.0, extra / self.wide_overhead)
        if due:
            self._narrow_cycles = 0
        return due

    def _mostly_reported(self) -> bool:
        """Whether the drafter's held-out acceptance weighs more than this model's own cycles."""
        return self.held_out.verified[0] > self.prior.verified[0]

    def cycles_next(self, width: int) -> bool:
        """Whether the cycle of `width` just planned queues the next one's drafts ahead of its read
        (engine.py): while cycles win, and in a probe alone, both of its cycles. The first (after
        another step, not timed) queues the drafts of the second, which runs next; the second, the
        timed one, queues drafts too, dropped where the plan goes back to plain steps. So the timed
        cycle does the host's work a streak's cycle does, no less (drafting nothing, it would price
        cycles about a draft's build and launch cheaper) and no more (drafting after its read, that
        much dearer, where the device also waits)."""
        return self.speculating or self._batch_rows() == 1

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        # A cycle is timed only right after a cycle of its width: as a run of them repeats it, not
        # with what a first one pays (a compile; with CUDA graphs, a new op sequence's graphs; after
        # plain steps, the write of their taps into the drafter's context). In a batch the wall is
        # the round's, not this step's: the rounds price it (rounds.py).
        alone = self._batch_rows() == 1
        if self.held_out.verified[0]:  # (none without a report)
            self.held_out.fade(self.held_out_fade)
        # (0 s: a clock too coarse for the step, no time)
        timed = seconds is not None and seconds > 0 and alone and (width == 0 or width == self._last)
        if timed:
            self.timings.record(width, context, seconds)
        self._untimed_cycle = bool(width) and alone and not timed
        self._last, kept = width, timed or not alone
        if width:
            self.refreshes.cycles += 1.0 / self._batch_rows()
        else:
            ended = kept or self._refreshing >= self.refresh_steps  # priced, or a refresh gave up
            if ended:
                self.refreshes.priced()
            if self._refreshing:
                self._refreshing = 0 if ended else self._refreshing + 1
        if width:
            self._probe_width = None  # a cycle measured: look again at the next plan
            self._probed = kept and not self.speculating
            if not self.speculating and alone and seconds:
                if not timed:
                    self._first_seconds = seconds
                elif self._first_seconds:  # (a one-off, such as a compile, counts as 4 at most)
                    self._first_ratio = min(4.0, max(1.0, self._first_seconds / seconds))
                    self._first_seconds = None
            self._counts.add(width, accepted)
            self.prior.add(width, accepted)
            self._narrow_full = width < self.block_size and accepted == width - 1
            if self.speculating:
                self.probes.winning()  # probe quickly again if this streak ends

    def note(self) -> Optional[str]:
        return self._note


@dataclass
class AlwaysSpeculate:
    """`speculation: on`: every step a cycle of the full block."""

    block_size: int
    speculating = True  # (the engine drafts the next block ahead of each read)

    def plan(self, context: int) -> int:
        return self.block_size

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        pass

    def note(self) -> Optional[str]:
        return None


@dataclass
class ModelSpeculation:
    """What a model keeps across its generations for `auto`. Where the drafter came with the
    held-out acceptance its training measured (`expected`, `drafter_config.HeldOutAcceptance`),
    that speaks for it at first, as `expected_cycles` cycles of history (`held_out`), fading with
    every step the model runs: without it a new server judged cycles by its first one or two, which
    on a GPU kept `auto` off for whole generations whose cycles won 1.3-2x; fading with plain steps
    too, it does not keep a CPU, where cycles are near even, trying cycles its own history says
    lose (docs/performance.md, "Never slower")."""

    block_size: int
    expected: Optional[tuple[float, ...]] = None  # P(accepted through block position j), j = 1..
    expected_cycles: float = 8.0
    timings: Timings = field(default_factory=Timings)
    probes: ProbeSchedule = field(default_factory=ProbeSchedule)
    refreshes: RefreshSchedule = field(default_factory=RefreshSchedule)
    rounds: RoundCosts = field(init=False)
    prior: AcceptanceCounts = field(init=False)  # the model's own cycles
    held_out: Optional[AcceptanceCounts] = field(init=False)

    def __post_init__(self):
        self.rounds = RoundCosts(self.block_size)
        self.prior = AcceptanceCounts(self.block_size - 1, decay=0.98)
        self.held_out = (AcceptanceCounts.expecting(self.block_size - 1, self.expected, self.expected_cycles)
                         if self.expected else None)

    def policy(self, mode: str, batched: bool = False) -> SpeculationPolicy:
        """`batched`: the generation's forwards run in `batching.step_together`'s rounds."""
        if mode == "on":
            return AlwaysSpeculate(self.block_size)
        return AutoSpeculation(self.timings, self.prior, self.block_size, self.probes,
                               self.rounds if batched else None, self.refreshes, self.held_out)
