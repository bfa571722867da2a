"""Caches the adapters need beyond mlx-lm's own.

mlx-lm's RotatingKVCache cannot be trimmed once it has wrapped, so speculative decoding past the
sliding window silently goes wrong with it. `SlidingWindowCache` keeps `window + slack` slots in a
ring and knows the absolute position held by every slot, so it can be rolled back by up to `slack`
tokens at any context length: a slot whose data was trimmed maps to a position at least one window
behind the next query and is masked out.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import mlx.core as mx
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import ArraysCache, KVCache


def ring_mask(starts: mx.array, n: int, window: int, capacity: int) -> mx.array:
    """Boolean masks [rows, n, capacity] of rings (`SlidingWindowCache`s of one window and
    capacity) whose rows write n tokens each in place at `starts` (an array, one start per row)
    before attending: each query sees the slots that hold a position within its window."""
    end = starts[:, None] + n  # [rows, 1]: where each row's writes end
    slots = mx.arange(capacity)[None]
    key_pos = (end - 1 - ((end - 1 - slots) % capacity))[:, None, :]  # (negative: never written)
    q_pos = (starts[:, None] + mx.arange(n)[None])[:, :, None]
    return (key_pos >= 0) & (key_pos <= q_pos) & (q_pos - key_pos < window)


class _RowArray:
    """A `RowOfBatch`'s keys or values: its row sliced out of the batch when first read or replaced."""

    def __init__(self, slot: str):
        self.slot = slot

    def __get__(self, cache, owner=None):
        if cache is None:
            return self
        if cache._batch is not None:
            cache._unbatch()
        return getattr(cache, self.slot)

    def __set__(self, cache, value) -> None:
        if cache._batch is not None:
            cache._unbatch()
        cache._origin = None  # a buffer of its own now: the batch's stack is not kept alive for it
        setattr(cache, self.slot, value)


class RowOfBatch:
    """A cache whose keys and values may be one row of a batched forward's stacked buffers, sliced
    out only when something reads them. A batched step used to give every row of every layer its
    slice of the stack (two ops a row and layer: at 256 rows of an 18-layer model, 9216 ops a step,
    the host's work outgrowing the device's); the same rows' next step starts from the stack itself
    (`rows.StackedRows`), so a row's own slice is needed only when it runs alone, is snapshotted,
    compared or measured, and then made once."""

    _batch = None  # (stacked keys, stacked values, row) until sliced out
    _origin = None  # the same, kept once sliced: what `batch_row` tells while the slices stay
    _keys = None
    _values = None

    def hold_row(self, keys: mx.array, values: mx.array, row: int) -> None:
        self._batch = self._origin = (keys, values, row)
        self._keys = self._values = None  # (the old slices: their memory goes now)

    def batch_row(self) -> Optional[tuple]:
        """(stacked keys, stacked values, row) of the batch whose row this cache holds, sliced out
        or not; None once a buffer of its own replaced it or something was written into its slices
        (in place, by slice assignment: `_written`)."""
        if self._batch is not None:
            return self._batch
        if self._origin is not None and self._keys is self._sliced[0] and self._values is self._sliced[1]:
            return self._origin
        return None

    def _written(self) -> None:
        """Its slices are about to be written into in place: no longer the batch's row, which the
        same rows' next forward would otherwise start from (`rows.StackedRows`)."""
        self._origin = None

    def _unbatch(self) -> None:
        keys, values, row = self._batch
        self._batch = None
        self._keys, self._values = self._sliced = keys[row : row + 1], values[row : row + 1]

    keys = _RowArray("_keys")
    values = _RowArray("_values")

    def holds_nothing(self) -> bool:
        """No keys yet (told without slicing a batch's row out)."""
        return self._batch is None and self._keys is None


class SlidingWindowCache(RowOfBatch):
    # Writes into the ring so far: a batched forward gives each row a slice of one stacked ring and
    # starts the same rows' next forward from that stack only while no row wrote into its slice
    # since (`rows.StackedRows`; slice assignment changes the array in place). A class attribute
    # also for caches thawed through `from_state`, which skips __init__.
    writes = 0

    def __init__(self, window: int, slack: int):
        self.window = window
        self.slack = slack
        self.capacity = window + slack
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.offset = 0

    def _slot_positions(self, end: int) -> mx.array:
        """Absolute position of each slot after `end` tokens were written (negative: never written)."""
        slots = mx.arange(self.capacity)
        return end - 1 - ((end - 1 - slots) % self.capacity)

    def _writes_in_place(self, n: int) -> bool:
        # Writing n tokens into the ring before attending overwrites positions older than
        # start + n - capacity; the first query still needs start - window + 1 onwards.
        return n <= self.capacity - self.window + 1

    def mask(self, n: int) -> mx.array:
        """Boolean mask [n, keys] for n queries at offset.., matching update_and_fetch's keys."""
        start = self.offset
        if self._writes_in_place(n):
            key_pos = self._slot_positions(start + n)
        else:
            key_pos = mx.concatenate([self._slot_positions(start), mx.arange(start, start + n)])
        q_pos = mx.arange(start, start + n)[:, None]
        key_pos = key_pos[None]
        return (key_pos >= 0) & (key_pos <= q_pos) & (q_pos - key_pos < self.window)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        n = keys.shape[2]
        if self.keys is None:
            B, H, _, Dk = keys.shape
            self.keys = mx.zeros((B, H, self.capacity, Dk), keys.dtype)
            self.values = mx.zeros((B, H, self.capacity, values.shape[3]), values.dtype)
        if self._writes_in_place(n):
            self._write(keys, values, self.offset)
            self.offset += n
            return self.keys, self.values
        # A long chunk (prefill): attend over the old ring plus the whole chunk, then keep its tail.
        all_keys = mx.concatenate([self.keys, keys], axis=2)
        all_values = mx.concatenate([self.values, values], axis=2)
        keep = min(n, self.capacity)
        self._write(keys[..., n - keep :, :], values[..., n - keep :, :], self.offset + n - keep)
        self.offset += n
        return all_keys, all_values

    def _write(self, keys: mx.array, values: mx.array, first_position: int) -> None:
        self.writes += 1
        self._written()
        n = keys.shape[2]
        slot = first_position % self.capacity
        head = min(n, self.capacity - slot)
        self.keys[..., slot : slot + head, :] = keys[..., :head, :]
        self.values[..., slot : slot + head, :] = values[..., :head, :]
        if head < n:
            self.keys[..., : n - head, :] = keys[..., head:, :]
            self.values[..., : n - head, :] = values[..., head:, :]

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        if n > self.slack:
            raise ValueError(f"cannot roll a sliding-window cache back by {n} > slack {self.slack}")
        n = min(n, self.offset)
        self.offset -= n
        return n

    def empty(self) -> bool:
        return self.holds_nothing()

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    # mlx-lm's cache protocol: `state` is everything the cache is, `from_state` builds one from it.
    @property
    def state(self) -> tuple:
        return self.keys, self.values, self.offset, self.window, self.slack

    @state.setter
    def state(self, v: tuple) -> None:
        self.keys, self.values, self.offset, self.window, self.slack = v
        self.capacity = self.window + self.slack

    @classmethod
    def from_state(cls, state: tuple) -> "SlidingWindowCache":
        cache = cls.__new__(cls)
        cache.state = state
        return cache


class RowsKVCache(RowOfBatch, KVCache):
    """mlx-lm's KVCache, counting the writes into its buffers. A batched forward gives each row a
    slice of one stacked buffer and starts the same rows' next forward from that stack
    (`rows.StackedRows`) only while no row wrote into its slice since: `update_and_fetch` writes by
    MLX's slice assignment, which changes the array in place, so the array's identity alone would
    not show it."""

    writes = 0  # also for caches thawed through `from_state`, which skips __init__

    def update_and_fetch(self, keys, values):
        self.writes += 1
        self._written()
        return super().update_and_fetch(keys, values)


class RowsArraysCache(ArraysCache):
    """mlx-lm's ArraysCache (a GatedDeltaNet layer's conv window and recurrent state) whose arrays
    may be one row of a batched forward's or rollback's stacks, sliced out only when something
    reads them, as `RowOfBatch` does for KV buffers. Slicing every row of every GatedDeltaNet layer
    out of the batch after each verify and rollback was most of the host's work in a batched round
    at 8 rows (docs/performance.md); the same rows' next forward starts from the stacks themselves
    (`rows.StackedRows`)."""

    _batch = None  # (stacked arrays, row) until sliced out; class attributes also for `from_state`
    _origin = None  # the same, kept once sliced: what `batch_row` tells while the slices stay
    _sliced = ()
    _arrays = None

    @property
    def cache(self) -> list:
        if self._batch is not None:
            arrays, row = self._batch
            self._batch = None
            self._arrays = [None if a is None else a[row : row + 1] for a in arrays]
            self._sliced = tuple(self._arrays)
        return self._arrays

    @cache.setter
    def cache(self, value: list) -> None:
        self._batch = self._origin = None
        self._arrays = value

    def hold_row(self, arrays: tuple, row: int) -> None:
        """Hold row `row` of the stacked `arrays` (one per slot), sliced out when first read."""
        self._batch = self._origin = (tuple(arrays), row)
        self._arrays, self._sliced = None, ()

    def unsliced(self) -> bool:
        """Holds a batch's row not sliced out yet (tests and benchmarks tell the host work saved)."""
        return self._batch is not None

    def batch_row(self) -> Optional[tuple]:
        """(stacked arrays, row) of the batch whose row this cache holds, sliced out or not; None once
        a slot holds an array of its own."""
        if self._batch is not None:
            return self._batch
        if self._origin is not None and len(self._arrays) == len(self._sliced) and all(
                a is b for a, b in zip(self._arrays, self._sliced)):
            return self._origin
        return None


def cache_arrays(cache: list) -> list[mx.array]:
    """Every array a list of layer caches holds (for eval and for memory accounting)."""
    arrays = []
    for c in cache:
        if c is None:
            continue
        if hasattr(c, "cache"):  # mlx-lm ArraysCache (GatedDeltaNet conv and recurrent state)
            arrays.extend(a for a in c.cache if a is not None)
        elif getattr(c, "keys", None) is not None:
            arrays.extend([c.keys, c.values])
    return arrays


# ------------------------------------------------------------------ snapshots for prefix reuse
#
# A frozen cache holds copies nobody writes to, each in a buffer of its own (so that what it
# holds is what it counts): KV buffers cut to their used length, GatedDeltaNet states, rings.
# Thawing builds new cache objects around new array objects, so requests sharing a snapshot
# never write into each other's, or the snapshot's, arrays (MLX's slice updates copy a buffer
# that something else still references). Both go through mlx-lm's own protocol, which every
# cache here follows (SlidingWindowCache too): `state` (arrays and numbers) and `from_state`.


class FrozenCache(NamedTuple):
    cls: type  # the cache's class, whose `from_state` thaws it
    state: Any  # its `state`, every array an owned copy


def freeze(cache: list) -> list[Optional[FrozenCache]]:
    frozen = []
    for c in cache:
        if c is None:
            frozen.append(None)
        elif not hasattr(type(c), "from_state"):
            raise TypeError(f"cannot snapshot a {type(c).__name__}")
        else:
            frozen.append(FrozenCache(type(c), tree_map(_owned_leaf, held_state(c))))
    return frozen


def held_state(c) -> Any:
    """`c.state`, with a KV cache's buffers cut to the tokens written: the rest is room for more
    (it grows in steps of 256), which a snapshot need not keep."""
    state = c.state
    if isinstance(c, KVCache) and c.keys is not None:
        keys, values, offset = state
        state = (keys[..., :offset, :], values[..., :offset, :], offset)
    return state


def owned(array: Optional[mx.array]) -> Optional[mx.array]:
    """A copy of `array` in a buffer of its own (lazy, so the caller can measure it). A slice (a
    KV buffer's used part, a GatedDeltaNet conv window cut from a whole chunk's input) is a view
    that keeps its parent buffer alive; `mx.contiguous` may return such a view as it is."""
    return None if array is None else mx.array(array)


def _owned_leaf(leaf):
    return owned(leaf) if isinstance(leaf, mx.array) else leaf


def _fresh_leaf(leaf):
    return leaf[...] if isinstance(leaf, mx.array) else leaf  # a new array object, the same buffer


def thaw(frozen: list[Optional[FrozenCache]]) -> list:
    return [None if f is None else f.cls.from_state(tree_map(_fresh_leaf, f.state)) for f in frozen]


def frozen_arrays(frozen: list[Optional[FrozenCache]]) -> list[mx.array]:
    """Every array the snapshots of `frozen` hold."""
    return [a for f in frozen if f is not None for _, a in tree_flatten(f.state) if isinstance(a, mx.array)]
