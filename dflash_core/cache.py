"""Caches the adapters need beyond mlx-lm's own.

mlx-lm's RotatingKVCache cannot be trimmed once it has wrapped, so speculative decoding past the
sliding window silently goes wrong with it. `SlidingWindowCache` keeps `window + slack` slots in a
ring and knows the absolute position held by every slot, so it can be rolled back by up to `slack`
tokens at any context length: a slot whose data was trimmed maps to a position at least one window
behind the next query and is masked out.
"""

from __future__ import annotations

import mlx.core as mx


class SlidingWindowCache:
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
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes
