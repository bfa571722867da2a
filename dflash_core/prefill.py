"""Where a prompt's prefill is cut into chunks.

Between chunks the engine yields, so the scheduler can run other generations and notice a
cancelled request; a chunk is the unit a cancel waits for. A fixed chunk of 2048 tokens takes
milliseconds on a GPU but many seconds on a CPU, so `ChunkPacer` sizes each chunk from the time
the last one took: the largest power of two (few distinct shapes for MLX's kernels) whose
expected time fits `seconds`, between `smallest` and the configured chunk.

Chunk boundaries can change the last bits of the prompt's cache (a different attention split),
so paced prefill is exact across runs only as far as the timings agree; a fixed chunk
(`prefill_chunk_seconds: null`) cuts every prompt in the same places.
"""

from __future__ import annotations

from typing import Iterator, Optional, Sequence


class ChunkPacer:
    def __init__(self, seconds: float, largest: int, smallest: int = 32):
        self.seconds = seconds
        self.largest = largest
        self.smallest = min(smallest, largest)
        self.tokens_per_second: Optional[float] = None  # measured on the last chunk

    def size(self) -> int:
        if self.tokens_per_second is None:  # nothing measured yet: a small first chunk measures
            return min(self.largest, 4 * self.smallest)
        fits = int(self.tokens_per_second * self.seconds)
        size = self.smallest
        while size * 2 <= min(fits, self.largest):
            size *= 2
        return size

    def record(self, tokens: int, seconds: float) -> None:
        if seconds > 0:
            self.tokens_per_second = tokens / seconds


def chunk_ends(start: int, length: int, boundaries: Sequence[int], chunk: int,
               pacer: Optional[ChunkPacer]) -> Iterator[int]:
    """The end of each prefill chunk from `start` to `length`, stopping at every boundary (where
    snapshots are taken). Fixed chunks lie on a grid from `start`; paced ones follow `pacer`,
    asked again before each chunk (record each chunk's time there)."""
    if pacer is None:
        yield from sorted(set(range(start + chunk, length, chunk)) | set(boundaries)) + [length]
        return
    begin = start
    while begin < length:
        end = min([begin + pacer.size(), length] + [b for b in boundaries if b > begin])
        yield end
        begin = end
