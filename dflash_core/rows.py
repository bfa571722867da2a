"""Rows of a batched forward in two layouts, and cache buffers gathered into one batch.

The per-token work of several generations (norms, projections, MLPs, the LM head) runs on their
tokens laid one after another along the token axis, [1, sum L, ...]; attention runs on them as a
batch, [rows, longest L, ...], each row padded at its end, over the rows' cache buffers stacked
into one [rows, heads, T, D]. Padding never reaches a real row: its queries are dropped on the way
back and its keys are masked.
"""

from __future__ import annotations

from typing import Optional, Sequence

import mlx.core as mx

Bounds = Sequence[tuple[int, int]]  # where each row's tokens sit on the token axis


def part(x: mx.array, start: int, end: int, axis: int = 1) -> mx.array:
    """x[start:end] along `axis`; x itself where that is all of it (one row adds no op)."""
    if start == 0 and end == x.shape[axis]:
        return x
    return x[(slice(None),) * axis + (slice(start, end),)]


def to_batch(x: mx.array, bounds: Bounds, length: int) -> mx.array:
    """The rows' tokens [1, sum L, ...] as a batch [rows, length, ...], each row padded at its end:
    a reshape where every row has `length` tokens."""
    if all(e - s == length for s, e in bounds):
        return x.reshape(len(bounds), length, *x.shape[2:])
    pad = [(0, 0)] * (x.ndim - 2)
    return mx.concatenate([mx.pad(part(x, s, e), [(0, 0), (0, length - (e - s))] + pad) for s, e in bounds], axis=0)


def from_batch(y: mx.array, bounds: Bounds) -> mx.array:
    """`to_batch` undone: [rows, length, ...] -> [1, sum L, ...] without the padding."""
    length = y.shape[1]
    if all(e - s == length for s, e in bounds):
        return y.reshape(1, -1, *y.shape[2:])
    return mx.concatenate([y[b : b + 1, : e - s] for b, (s, e) in enumerate(bounds)], axis=1)


def stack_buffers(buffers: Sequence[Optional[mx.array]], size: int, like: mx.array) -> mx.array:
    """Cache buffers [1, heads, T_i, D] (None: nothing yet) as one batch [rows, heads, size, D],
    each padded with zeros at its end (`like`: an array of the heads, D and dtype, for None)."""

    def padded(buffer: Optional[mx.array]) -> mx.array:
        if buffer is None:
            return mx.zeros((1, like.shape[1], size, like.shape[3]), like.dtype)
        if buffer.shape[2] < size:
            tail = mx.zeros((1, buffer.shape[1], size - buffer.shape[2], buffer.shape[3]), buffer.dtype)
            return mx.concatenate([buffer, tail], axis=2)
        return buffer

    out = [padded(b) for b in buffers]
    return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)


# mlx-lm's KVCache grows its buffers by this many positions at a time.
KV_STEP = 256


def write_rows(caches: Sequence, starts: Sequence[int], lengths: Sequence[int], keys: mx.array, values: mx.array,
               positions: Optional[mx.array] = None) -> tuple[mx.array, mx.array]:
    """Write each row's new keys and values (batches [rows, heads, length, D], row b's first
    lengths[b] real, the rest padding) into its mlx-lm KVCache at its offset, for all rows at once:
    the rows' buffers are stacked into one [rows, heads, T, D] with room for the longest write
    (`stack_buffers`; a buffer shorter than another is padded, and its tail is never read: masks
    stop at each row's position) and the new positions scattered in. Returns the stacked buffers;
    each cache then holds its row of them and its new offset. `positions` [rows, 1, length, 1]:
    each row's write positions (starts + 0..length-1), where the caller has them already."""
    length = keys.shape[2]
    size = max([c.keys.shape[2] for c in caches if c.keys is not None] + [0])
    need = max(starts) + length
    if size < need:
        size = (need + KV_STEP - 1) // KV_STEP * KV_STEP
    if positions is None:
        positions = (mx.array(list(starts))[:, None] + mx.arange(length)[None]).reshape(len(caches), 1, length, 1)
    stacked_keys = mx.put_along_axis(stack_buffers([c.keys for c in caches], size, keys), positions, keys, axis=2)
    stacked_values = mx.put_along_axis(stack_buffers([c.values for c in caches], size, values), positions, values,
                                       axis=2)
    for b, (cache, start, n) in enumerate(zip(caches, starts, lengths)):
        cache.keys, cache.values, cache.offset = stacked_keys[b : b + 1], stacked_values[b : b + 1], start + n
    return stacked_keys, stacked_values
