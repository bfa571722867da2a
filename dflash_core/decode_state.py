"""One generation's decode state: its caches, its drafter context, the tokens they hold, and what
its queued steps leave to apply or read (`Engine._speculative`, `Engine._target_only`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import mlx.core as mx

from .adapters import RollbackRecord
from .host_reads import PendingRead, RoundQueue


@dataclass
class DecodeState:
    """One generation's device state: the target's caches, the drafter's context, and the tokens
    whose state they hold (what a prefix-cache snapshot of them would be keyed by)."""

    cache: list
    context: Optional[list]
    fed: list[int]
    pending: Optional[RollbackRecord] = None  # of a step queued ahead, not yet accepted or rolled back
    # A verify's rollback (record, keep) decided when its cycle was read, applied with the next
    # forward (`ForwardRow.undo`: batched generations roll back together) or before a snapshot.
    due: Optional[tuple[RollbackRecord, int]] = None
    # Taps not yet in the drafter's context (a cycle's accepted positions, plain steps'): added in
    # one block with the next cycle's draft (or before a snapshot), not one drafter forward per
    # token while cycles are off.
    untapped: list = field(default_factory=list)
    # The last committed token: the input of the step in flight, fed when that step is read.
    last: Optional[int] = None
    # The drafter context's length before the taps of a cycle not read yet went in, all of them
    # (a cycle that drafted the next block ahead, `DraftedAhead`): what it holds for `fed`.
    context_committed: Optional[int] = None
    # A batched generation's arrays to evaluate and read go to its engine's queue
    # (`Engine.batch_queue`), which `batching.step_together` starts once for all rows; None:
    # evaluated at once, read alone.
    eval_queue: Optional[RoundQueue] = None

    def evaluate(self, *arrays: mx.array) -> None:
        """Start evaluating `arrays` on the device without waiting for them."""
        if self.eval_queue is None:
            mx.async_eval(*arrays)
        else:
            self.eval_queue.evaluate(*arrays)

    def read_later(self, tokens: mx.array, *also: mx.array) -> PendingRead:
        """Start evaluating int32 `tokens`, to be read on the host with `.tolist()` (a batch's rows
        in one read), and `also` with them (alone: in the same `mx.async_eval`)."""
        if self.eval_queue is None:
            mx.async_eval(tokens, *also)
            return PendingRead(tokens)
        self.eval_queue.evaluate(*also)
        return self.eval_queue.read_later(tokens)

    def take_due(self) -> Optional[tuple[RollbackRecord, int]]:
        due, self.due = self.due, None
        return due

    def settle(self, target) -> None:
        """Apply the rollback still due (before the caches are read other than by a forward)."""
        due = self.take_due()
        if due is not None:
            target.rollback(self.cache, *due)

    def take_untapped(self) -> Optional[mx.array]:
        """The taps not yet in the drafter's context, as one block (None: there are none)."""
        if not self.untapped:
            return None
        taps, self.untapped = self.untapped, []
        return taps[0] if len(taps) == 1 else mx.concatenate(taps, axis=1)

    def trim_context(self, length: int) -> None:
        """Keep the drafter context's first `length` positions (the taps past them are a drafted-ahead
        cycle's rejected ones, or all of an unread cycle's); their slots are written over next."""
        for layer_context in self.context:
            layer_context.offset = length
        self.context_committed = None

    def catch_up(self, drafter) -> None:
        if self.context_committed is not None:  # an unread cycle's taps: not committed
            self.trim_context(self.context_committed)
        taps = self.take_untapped()
        if taps is not None:
            drafter.add_context(taps, self.context)


@dataclass
class DraftedAhead:
    """The next cycle's drafts, queued before the host read this cycle's acceptance
    (`Engine._launch`): its `width`, and the drafter context's length before this cycle's taps
    went in, all of them (the host trims the rejected ones when it reads the cycle)."""

    drafts: mx.array
    width: int
    context_before: int


def device_acceptance(drafts: mx.array, choices: mx.array) -> tuple[mx.array, mx.array]:
    """A cycle's acceptance on the device, as `engine.accepted_length` reads it on the host: the
    drafts accepted (the longest prefix equal to the target's choices) and the target's token
    after them, the next cycle's first."""
    matches = (drafts == choices[: drafts.size]).astype(mx.int32)
    accepted = mx.cumprod(matches).sum() if drafts.size else mx.array(0, mx.int32)
    return accepted, mx.take(choices, accepted).reshape(1)


@dataclass
class Launched:
    """A queued step of a speculating generation (`Engine._launch`)."""

    read: Any
    choice: Optional[mx.array] = None  # a plain step's output token, on the device
    ahead: Optional[DraftedAhead] = None  # a cycle's: the next cycle's drafts, when drafted ahead
