"""A batched round's device work and host reads, started together and read with one transfer.

Every generation in a batch queues arrays to evaluate (its next token, drafts, taps) and one
array of tokens it will read on the host in its next step (a cycle's drafts and choices, a plain
step's token). Evaluating them row by row cost a call per row; reading them row by row costs a
wait and a copy per row, which on a GPU is a synchronisation each. `RoundQueue.flush` starts what
the rows of a forward queued in one `mx.async_eval`; `RoundQueue.join_reads`, at the end of the
round, joins the rows' reads into one array; the first row to read then reads it for all, and the
others take their part of it on the host.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx


class _JoinedReads:
    """One round's reads, joined on the device and read on the host once."""

    def __init__(self, arrays: list[mx.array]):
        self.sizes = [a.size for a in arrays]
        flat = [a.reshape(-1) for a in arrays]
        self.joined: Optional[mx.array] = flat[0] if len(flat) == 1 else mx.concatenate(flat)
        self.values: Optional[list[list[int]]] = None

    def read(self, i: int) -> list:
        if self.values is None:
            host, self.joined = self.joined.tolist(), None
            self.values, at = [], 0
            for n in self.sizes:
                self.values.append(host[at : at + n])
                at += n
        return self.values[i]


class PendingRead:
    """An int32 array a generation reads on the host later: `tolist()` gives its values, from its
    round's one joined read once the round was started, else from the array itself."""

    __slots__ = ("array", "_round", "_index")

    def __init__(self, array: mx.array):
        self.array: Optional[mx.array] = array
        self._round: Optional[_JoinedReads] = None
        self._index = 0

    def tolist(self) -> list:
        if self._round is not None:
            return self._round.read(self._index)
        return self.array.tolist()


class RoundQueue:
    """What a batch's generations queued: arrays to evaluate, started after each forward of a round
    (`flush`), and tokens to read on the host, joined once the round's forwards are all built
    (`join_reads`). A round runs one forward per group of tapped layers, and its rows' reads
    come from all of them."""

    def __init__(self):
        self.arrays: list[mx.array] = []
        self.reads: list[PendingRead] = []
        self._started = 0  # reads whose arrays a flush started

    def __bool__(self) -> bool:
        return bool(self.arrays or self.reads)

    def evaluate(self, *arrays: mx.array) -> None:
        self.arrays.extend(arrays)

    def read_later(self, array: mx.array) -> PendingRead:
        if array.dtype != mx.int32:  # (joined with the others: one dtype)
            raise TypeError(f"a batched host read takes int32 tokens, not {array.dtype}")
        pending = PendingRead(array)
        self.reads.append(pending)
        return pending

    def flush(self) -> None:
        """Start evaluating everything queued since the last flush, in one call."""
        arrays, self.arrays = self.arrays, []
        arrays += [p.array for p in self.reads[self._started :]]
        self._started = len(self.reads)
        if arrays:
            mx.async_eval(*arrays)

    def join_reads(self) -> None:
        """Join the round's reads into one array, read by the first row that reads."""
        self.flush()
        if self.reads:
            joined = _JoinedReads([p.array for p in self.reads])
            for i, pending in enumerate(self.reads):
                pending._round, pending._index, pending.array = joined, i, None
            mx.async_eval(joined.joined)
            self.reads, self._started = [], 0
