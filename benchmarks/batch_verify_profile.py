"""Where the host's time goes in a batched round's target work: a loop to profile, and the profile read.

    python benchmarks/batch_verify_profile.py --rows 8 --iterations 50
    python benchmarks/batch_verify_profile.py --rows 8 --seconds 60 --ready /tmp/ready &
    py-spy record --native -r 40 -d 25 --pid $! -f raw -o verify.txt   # once /tmp/ready exists
    python benchmarks/batch_verify_profile.py --summarize verify.txt

N generations of a random-weight target (`random_models`, --shape, bf16) hold --context tokens each;
each iteration is what the engine's round asks of the target: the rows' batched rollback of the
last verify to 6 tokens (`rollback_rows`), then a batched verify of N blocks of 16
(`forward_rows`), then its evaluation. It prints the median build (host: Python and MLX's graph, up
to the forward's return, with the layers it queued on the way) and total milliseconds. With
--seconds it loops that long after touching --ready, for a sampling profiler to attach (py-spy
with --native samples too slowly on the device machines to start with the process: its model's
set-up would fill the run). --summarize reads py-spy's raw output and prints the share of the
loop's samples under each frame (inclusive), native frames included.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def loop(shape: str, rows: int, context: int, iterations: int, seconds: float, ready, tiny: bool) -> None:
    import mlx.core as mx

    from dflash_core.adapters import ForwardRow
    from dflash_core.cache import cache_arrays
    from dflash_core.random_models import RELEASED_DRAFTERS, random_target

    target = random_target(shape, "bf16", tiny=tiny)
    taps = [t for t in RELEASED_DRAFTERS[shape]["taps"] if t < target.num_layers]
    caches = []
    for r in range(rows):
        prompt = mx.random.randint(0, target.vocab_size, (1, context), key=mx.random.key(r))
        cache = target.make_cache(max_rollback=16)
        for s in range(0, context, 512):
            target.forward(prompt[:, s:s + 512], cache, taps, last_logits_only=True)
            mx.eval(cache_arrays(cache))
        caches.append(cache)
    blocks = [mx.random.randint(0, target.vocab_size, (1, 16), key=mx.random.key(100 + r)) for r in range(rows)]
    mx.eval(blocks)
    last: list = []

    def iteration() -> tuple[float, float]:
        start = time.perf_counter()
        if last:
            target.rollback_rows([(c, o.rollback, 6) for c, o in zip(caches, last)])
        outs = target.forward_rows([ForwardRow(t, c, record=True) for t, c in zip(blocks, caches)], taps)
        built = time.perf_counter()
        # The batch arrays the rows hold (not each row's slice: the engine never reads those).
        held = [e.arrays for e in target.stacked_rows._entries.values()] if rows > 1 else cache_arrays(caches[0])
        mx.eval([(o.logits, o.tapped_hidden) for o in outs], held)
        last[:] = outs
        return built - start, time.perf_counter() - start

    for _ in range(5):
        iteration()
    if seconds:
        Path(ready).touch()
        end = time.time() + seconds
        while time.time() < end:
            iteration()
        return
    times = [iteration() for _ in range(iterations)]
    print(f"rows {rows}: build {statistics.median(b for b, _ in times) * 1e3:.2f} ms, "
          f"total {statistics.median(t for _, t in times) * 1e3:.2f} ms", flush=True)


def summarize(path: Path, top: int) -> None:
    """Inclusive share of each frame over the samples taken inside the loop's iterations."""
    inclusive: collections.Counter = collections.Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, count = line.rsplit(" ", 1)
        frames = stack.split(";")
        if not any(f.startswith("iteration ") for f in frames):
            continue
        total += int(count)
        for frame in set(frames):
            inclusive[frame] += int(count)
    print(f"{total} samples in the loop's iterations")
    for frame, count in inclusive.most_common(top):
        print(f"{100 * count / total:5.1f}%  {frame[:140]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--iterations", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=0, help="loop this long (for a profiler) instead of timing")
    parser.add_argument("--ready", default="/tmp/batch_verify_profile.ready", help="touched when --seconds starts")
    parser.add_argument("--summarize", type=Path, help="py-spy's raw output (-f raw) of a --seconds run")
    parser.add_argument("--top", type=int, default=60)
    parser.add_argument("--tiny", action="store_true", help="the shape's family's tiny shape (checks the script on a CPU)")
    args = parser.parse_args()
    if args.summarize:
        summarize(args.summarize, args.top)
    else:
        loop(args.shape, args.rows, args.context, args.iterations, args.seconds, args.ready, args.tiny)


if __name__ == "__main__":
    main()
