"""Where a real pair's end-to-end time goes, cycle by cycle (diagnostics).

Forced cycles of random weights (`cycle_profile.py`) predict a DFlash speed that real generations
do not reach: on an H100 on 2026-12-07 the demo pair's forced cycle (5.4-5.6 ms at 3 tokens, the
target alone's step 3.3-3.4 ms) predicts about 1.96x the target alone at the 3.27 tokens a cycle
`dflash bench` measured, and the bench gave 1.78x: about 1 ms a cycle more than the forced cycle,
against about 0.4 ms a token more for the target alone. This runs the real pair, always-on at full
width, with a policy that records what the engine measured of every step: each cycle's wall time
from the read before to its read (None where the engine did not time it: the first cycle, after
the prompt), its width and the drafts accepted. Per prompt it reports the decode time, the summed
timed cycles, what the untimed ones took (the decode time less the timed sum: the first cycle,
which also writes the prompt's taps into the drafter's context), the median and slowest timed
cycle, and the cycle time by drafts accepted; the target alone's time a token beside it; and the
same generation run again (`again`), so that what the first run paid once for the prompt's shapes
shows.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/cycle_trace.py --target DIR --drafter DIR --dtype bfloat16 \\
        --prompts prompts.jsonl --prompts-per-set 4 --out cycle_trace.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_pair import add_pair_arguments, load_pair  # noqa: E402
from pair_paths import held_out_prompts  # noqa: E402

from dflash_core.bench import run_once  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402
from dflash_core.speculation import AlwaysSpeculate  # noqa: E402


class TracedCycles(AlwaysSpeculate):
    """`speculation: on` (every step a full-width cycle, drafted ahead) that keeps what the engine
    tells it of each step: (width, seconds or None, drafts accepted)."""

    name = "on"

    def __init__(self, block_size: int):
        super().__init__(block_size)
        self.steps: list[tuple[int, Optional[float], int]] = []

    def observe(self, width: int, context: int, seconds: Optional[float], accepted: int) -> None:
        self.steps.append((width, seconds, accepted))


def summary(decode_seconds: float, steps: list[tuple[int, Optional[float], int]]) -> dict:
    """One generation's cycles: what was timed, what was not, and the timed ones by acceptance."""
    timed = [s for _, s, _ in steps if s is not None]
    by_accepted: dict[int, list[float]] = {}
    for _, seconds, accepted in steps:
        if seconds is not None:
            by_accepted.setdefault(accepted, []).append(seconds)
    return {
        "cycles": len(steps), "timed_cycles": len(timed), "decode_ms": 1e3 * decode_seconds,
        "timed_ms": 1e3 * sum(timed), "untimed_ms": 1e3 * (decode_seconds - sum(timed)),
        "median_cycle_ms": 1e3 * statistics.median(timed) if timed else None,
        "slowest_cycle_ms": 1e3 * max(timed) if timed else None,
        "median_cycle_ms_by_accepted": {a: 1e3 * statistics.median(v) for a, v in sorted(by_accepted.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--prompts", type=Path, help="a `dflash corpus` JSONL file")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.prompts_per_set < 1 or args.max_tokens < 2:
        parser.error("--prompts-per-set must be at least 1 and --max-tokens at least 2")

    target_dir, drafter_dir, engine = load_pair(args)
    greedy = SamplingParams()
    warm = engine.tokenizer.encode("Warm up")
    for speculative in (False, True):  # compile and allocate before anything is timed
        run_once(engine, warm, speculative=speculative, max_tokens=32, sampling=greedy, ignore_eos=True,
                 speculation="on")

    rows = []
    for name, prompts in held_out_prompts(args.prompts, args.prompts_per_set).items():
        for prompt in prompts:
            tokens = engine.tokenizer.encode(prompt)
            alone = run_once(engine, tokens, speculative=False, max_tokens=args.max_tokens, sampling=greedy,
                             ignore_eos=True)
            policy = TracedCycles(engine.drafter.block_size)
            dflash = run_once(engine, tokens, speculative=True, max_tokens=args.max_tokens, sampling=greedy,
                              ignore_eos=True, speculation=policy)
            if dflash.tokens != alone.tokens:
                sys.exit(f"{name}: DFlash's output differed from the target alone's")
            # The same generation again: what its first run paid once for this prompt's shapes (a
            # prompt of a new length compiles and captures what the first cycle's write of its taps
            # into the drafter's context runs) shows as the difference.
            again_policy = TracedCycles(engine.drafter.block_size)
            again = run_once(engine, tokens, speculative=True, max_tokens=args.max_tokens, sampling=greedy,
                             ignore_eos=True, speculation=again_policy)
            row = {"set": name, "prompt_tokens": len(tokens),
                   "alone_ms_per_token": 1e3 * alone.stats.decode_seconds / (alone.stats.generated_tokens - 1),
                   "tokens_per_cycle": dflash.stats.tokens_per_cycle,
                   **summary(dflash.stats.decode_seconds, policy.steps),
                   "again": summary(again.stats.decode_seconds, again_policy.steps)}
            rows.append(row)
            cycles = (f"cycle median {row['median_cycle_ms']:.2f}, slowest {row['slowest_cycle_ms']:.2f} ms"
                      if row["timed_cycles"] else "no cycle timed")
            print(f"{name}: alone {row['alone_ms_per_token']:.2f} ms/token; {row['cycles']} cycles at "
                  f"{row['tokens_per_cycle']:.2f} tokens, decode {row['decode_ms']:.1f} ms = timed "
                  f"{row['timed_ms']:.1f} + untimed {row['untimed_ms']:.1f}; {cycles}; again: decode "
                  f"{row['again']['decode_ms']:.1f} = timed {row['again']['timed_ms']:.1f} + untimed "
                  f"{row['again']['untimed_ms']:.1f}", flush=True)

    result = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "mlx": mx.__version__,
              "target": target_dir, "drafter": drafter_dir, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "generations": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
