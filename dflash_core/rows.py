"""Rows of a batched forward in two layouts, and cache buffers gathered into one batch.

The per-token work of several generations (norms, projections, MLPs, the LM head) runs on their
tokens laid one after another along the token axis, [1, sum L, ...]; attention runs on them as a
batch, [rows, longest L, ...], each row padded at its end, over the rows' cache buffers stacked
into one [rows, heads, T, D]. Padding never reaches a real row: its queries are dropped on the way
back and its keys are masked.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import mlx.core as mx

Bounds = Sequence[tuple[int, int]]  # where each row's tokens sit on the token axis


def part(x: mx.array, start: int, end: int, axis: int = 1) -> mx.array:
    """x[start:end] along `axis`; x itself where that is all of it (one row adds no op)."""
    if start == 0 and end == x.shape[axis]:
        return x
    return x[(slice(None),) * axis + (slice(start, end),)]


def batch_index(bounds: Bounds, length: int) -> mx.array:
    """Where each place of the batch layout [rows, length] takes its token from the token axis: the
    row's own tokens, then its last one again as padding. (Padding is never read as a row's own:
    its queries are dropped and its keys masked, and a finite value times a masked weight of
    exactly 0 adds 0, as the zeros it replaced did.)"""
    return mx.array([[min(s + j, e - 1) for j in range(length)] for s, e in bounds])


def unbatch_index(bounds: Bounds) -> tuple[mx.array, mx.array]:
    """The (row, position) of each real token in the batch layout, in token-axis order."""
    return (mx.array([b for b, (s, e) in enumerate(bounds) for _ in range(e - s)]),
            mx.array([j for s, e in bounds for j in range(e - s)]))


def to_batch(x: mx.array, bounds: Bounds, length: int, index: Optional[mx.array] = None) -> mx.array:
    """The rows' tokens [1, sum L, ...] as a batch [rows, length, ...], each row padded at its end:
    a reshape where every row has `length` tokens, else one gather (`index`: `batch_index`'s, where
    the caller made it once for several arrays)."""
    if all(e - s == length for s, e in bounds):
        return x.reshape(len(bounds), length, *x.shape[2:])
    index = batch_index(bounds, length) if index is None else index
    return x[:, index].reshape(len(bounds), length, *x.shape[2:])


def from_batch(y: mx.array, bounds: Bounds, index: Optional[tuple] = None) -> mx.array:
    """`to_batch` undone: [rows, length, ...] -> [1, sum L, ...] without the padding (one gather;
    `index`: `unbatch_index`'s)."""
    length = y.shape[1]
    if all(e - s == length for s, e in bounds):
        return y.reshape(1, -1, *y.shape[2:])
    rows, positions = unbatch_index(bounds) if index is None else index
    return y[rows, positions][None]


class RaggedLayout:
    """Rows laid end to end on the token axis, [1, sum L, ...], and as a batch padded to `length`,
    [rows, length, ...]: `to_batch` and `from_batch` for these rows, their gathers (rows of
    different lengths) made once and kept for every array and layer of a forward."""

    def __init__(self, bounds: Bounds, length: int):
        self.bounds, self.length = bounds, length
        self.even = all(e - s == length for s, e in bounds)
        self._gather: Optional[mx.array] = None
        self._ungather: Optional[tuple] = None

    def batched(self, x: mx.array) -> mx.array:
        if not self.even and self._gather is None:
            self._gather = batch_index(self.bounds, self.length)
        return to_batch(x, self.bounds, self.length, self._gather)

    def unbatched(self, y: mx.array) -> mx.array:
        if not self.even and self._ungather is None:
            self._ungather = unbatch_index(self.bounds)
        return from_batch(y, self.bounds, self._ungather)


def stack_buffers(buffers: Sequence[Optional[mx.array]], size: int, like: mx.array) -> mx.array:
    """Cache buffers [1, heads, T_i, D] (None: nothing yet) as one batch [rows, heads, size, D],
    each padded with zeros at its end (`like`: an array of the heads, D and dtype, for None). A
    buffer that is a batch already ([rows, ...]) is padded as a whole."""

    def padded(buffer: Optional[mx.array]) -> mx.array:
        if buffer is None:
            return mx.zeros((1, like.shape[1], size, like.shape[3]), like.dtype)
        if buffer.shape[2] < size:
            tail = mx.zeros((buffer.shape[0], buffer.shape[1], size - buffer.shape[2], buffer.shape[3]), buffer.dtype)
            return mx.concatenate([buffer, tail], axis=2)
        return buffer

    out = [padded(b) for b in buffers]
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)


# mlx-lm's KVCache grows its buffers by this many positions at a time.
KV_STEP = 256


def kv_buffers(cache) -> Optional[tuple]:
    """What a KV cache holds: for a `cache.RowOfBatch` still holding its row of a stacked batch
    (not written into since: a write ends that), the batch's (stacked keys, stacked values, row)
    tuple itself, so that telling whether it still holds it is one identity check; else its
    buffers and count of writes; None for a cache that does not count its writes (anything but
    `cache.RowsKVCache` and `cache.SlidingWindowCache`), whose stack is then never reused."""
    writes = getattr(cache, "writes", None)
    if writes is None:
        return None
    row = cache.batch_row() if hasattr(cache, "batch_row") else None  # (cache.RowOfBatch: not sliced out)
    return row if row is not None else (cache.keys, cache.values, writes)


def _same(a, b) -> bool:
    # Arrays and a RowOfBatch's batch tuple: the very objects; counts: equal.
    return a == b if type(a) is int and type(b) is int else a is b


@dataclass
class _Stacked:
    arrays: tuple  # the batch arrays, each [rows, ...]
    caches: list  # weak references to the rows' caches, in row order
    given: list  # per row, the slices of `arrays` its cache was given
    read: Callable  # what a cache holds now, to compare with what it was given
    written: int  # the StackedRows.forwards count when kept

    def current(self) -> bool:
        """Every cache is alive and still holds the slices it was given (a cache that grew, ran a
        forward alone, rolled back or was restored since holds other arrays). Runs for every row of
        every layer of a batched step, so it is kept to a loop of identity checks."""
        read = self.read
        for ref, given in zip(self.caches, self.given):
            cache = ref()
            if cache is None:
                return False
            held = read(cache)
            if held is given:  # (a row of a batch: the very tuple it was given)
                continue
            if held is None or len(held) != len(given):
                return False
            for a, b in zip(held, given):
                if not _same(a, b):
                    return False
        return True


class StackedRows:
    """The batch arrays of the rows' last batched forward (KV buffers [rows, heads, T, D], recurrent
    states), per set of caches (one layer's caches of the rows, in order), for the next forward of
    the same rows to start from. Stacking each row's arrays anew every step copied every row's whole
    KV buffer in every layer, most of what a batched step cost where the model is small
    (docs/performance.md). An entry is used only while its caches all still hold the slices they
    were given; `end_forward` drops the entries the last few forwards did not keep (rows that left),
    `clear` all of them (a generation ended: its memory goes now)."""

    KEEP_FORWARDS = 4  # a step runs a forward per group of tapped layers: a few, not more

    def __init__(self):
        self._entries: dict[tuple, _Stacked] = {}
        self.forwards = 0
        self.reused = 0  # takes that found a kept batch (tests, benchmarks)
        self.enabled = True  # False: every forward stacks anew (benchmarks measure the difference)

    def take(self, caches: Sequence, tag=None) -> Optional[tuple]:
        """The batch arrays kept for these caches (with `tag`: one of several kinds kept per set),
        if every cache still holds its slices of them; None otherwise."""
        entry = self._entries.pop((tag, *map(id, caches)), None)
        if entry is None or not self.enabled or not entry.current():
            return None
        self.reused += 1
        return entry.arrays

    def keep(self, caches: Sequence, arrays: tuple, read: Callable = kv_buffers, tag=None) -> None:
        """Remember `arrays` as the batch of these caches, each of which now holds `read(cache)`
        (None: a cache that cannot tell; then nothing is kept)."""
        given = [read(c) for c in caches]
        if not self.enabled or any(g is None for g in given):
            return
        self._entries[(tag, *map(id, caches))] = _Stacked(
            tuple(arrays), [weakref.ref(c) for c in caches], given, read, self.forwards)

    def end_forward(self) -> None:
        self.forwards += 1
        oldest = self.forwards - self.KEEP_FORWARDS
        if any(e.written < oldest for e in self._entries.values()):
            self._entries = {k: e for k, e in self._entries.items() if e.written >= oldest}

    def clear(self) -> None:
        self._entries = {}


def write_rows(caches: Sequence, starts: Sequence[int], lengths: Sequence[int], keys: mx.array, values: mx.array,
               positions: Optional[mx.array] = None,
               stacked: Optional[StackedRows] = None) -> tuple[mx.array, mx.array]:
    """Write each row's new keys and values (batches [rows, heads, length, D], row b's first
    lengths[b] real, the rest padding) into its mlx-lm KVCache at its offset, for all rows at once:
    the rows' buffers are stacked into one [rows, heads, T, D] with room for the longest write
    (`stack_buffers`; a buffer shorter than another is padded, and its tail is never read: masks
    stop at each row's position) and the new positions scattered in. Returns the stacked buffers;
    each cache then holds its row of them and its new offset. `positions` [rows, 1, length, 1]:
    each row's write positions (starts + 0..length-1), where the caller has them already.
    `stacked`: where the same rows' last write is kept, to start from instead of stacking again."""
    length = keys.shape[2]
    need = max(starts) + length
    if positions is None:
        positions = (mx.array(list(starts))[:, None] + mx.arange(length)[None]).reshape(len(caches), 1, length, 1)
    # The rows' buffers: the batch their last write kept, else each row's own.
    last = stacked.take(caches) if stacked is not None else None
    if last is not None:
        key_buffers, value_buffers = [last[0]], [last[1]]
    else:
        key_buffers, value_buffers = [c.keys for c in caches], [c.values for c in caches]
    size = max([b.shape[2] for b in key_buffers if b is not None] + [0])
    if size < need:
        size = (need + KV_STEP - 1) // KV_STEP * KV_STEP
    base = (stack_buffers(key_buffers, size, keys), stack_buffers(value_buffers, size, values))
    return _scatter_rows(caches, base, positions, keys, values, starts, lengths, stacked)


def _scatter_rows(caches, base: tuple, slots: mx.array, keys: mx.array, values: mx.array, starts, lengths,
                  stacked: Optional[StackedRows], tag=None) -> tuple[mx.array, mx.array]:
    """The rows' new keys and values scattered at `slots` into their stacked buffers `base`; each
    cache then holds its row of the result and its new offset, kept for the same rows' next write."""
    stacked_keys = mx.put_along_axis(base[0], slots, keys, axis=2)
    stacked_values = mx.put_along_axis(base[1], slots, values, axis=2)
    for b, (cache, start, n) in enumerate(zip(caches, starts, lengths)):
        if hasattr(cache, "hold_row"):  # its slice made only if read (cache.RowOfBatch)
            cache.hold_row(stacked_keys, stacked_values, b)
        else:
            cache.keys, cache.values = stacked_keys[b : b + 1], stacked_values[b : b + 1]
        cache.offset = start + n
    if stacked is not None:
        stacked.keep(caches, (stacked_keys, stacked_values), tag=tag)
    return stacked_keys, stacked_values


def ring_slots(starts: mx.array, length: int, capacity: int) -> mx.array:
    """The ring slots [rows, 1, length, 1] of positions starts[b]..starts[b] + length - 1."""
    return ((starts[:, None] + mx.arange(length)[None]) % capacity).reshape(starts.shape[0], 1, length, 1)


def write_ring_rows(caches: Sequence, starts: Sequence[int], lengths: Sequence[int], keys: mx.array, values: mx.array,
                    slots: mx.array, stacked: Optional[StackedRows] = None) -> tuple[mx.array, mx.array]:
    """`write_rows` for sliding-window rings (`cache.SlidingWindowCache`, all of one capacity, each
    written before): each row's new keys and values (batches [rows, heads, length, D], row b's first
    lengths[b] real) scattered into the rows' rings stacked as one [rows, heads, capacity, D], at
    `slots` (`ring_slots`: those of positions starts[b]..starts[b] + length - 1; the same for every
    layer of a forward, so made once). A row's padding lands in slots whose positions are a window
    or more behind its next query, or ahead of it: masked until overwritten (`length` is at most
    the rings' slack, as a verify block is). Each cache then holds its row of the stack and its new
    offset."""
    last = stacked.take(caches, tag="ring") if stacked is not None else None
    base = last if last is not None else (mx.concatenate([c.keys for c in caches]), mx.concatenate([c.values for c in caches]))
    return _scatter_rows(caches, base, slots, keys, values, starts, lengths, stacked, tag="ring")
