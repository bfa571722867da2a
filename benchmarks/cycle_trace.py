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

`--replay` also runs each generation's cycles forced (`random_models.ForcedAcceptance`, the real
weights) to accept exactly what the real run accepted, cycle by cycle: the same widths, the same
context lengths and the same drafts accepted, the target's choices replaced by what the forcing
computes from the verify's input. A forced cycle that is faster than the real one with the same
acceptance is what the forced benchmarks miss; one as fast says the gap is elsewhere (the
prompt's context, the machine). `--profile` splits each real (`again`) and replayed cycle's host
time as `cycle_profile.py` does (build, launch, the read's wait, the rest), under cProfile.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/cycle_trace.py --target DIR --drafter DIR --dtype bfloat16 \\
        --prompts prompts.jsonl --prompts-per-set 4 --replay --profile --out cycle_trace.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402
from cycle_profile import CYCLE_PARTS, split  # noqa: E402
from demo_pair import add_pair_arguments, load_pair  # noqa: E402
from pair_paths import held_out_prompts  # noqa: E402

from dflash_core.bench import run_once  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.random_models import ForcedAcceptance  # noqa: E402
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


def traced(generate, profile: bool, stats: int = 0, label: str = ""):
    """(run, host ms a cycle split as cycle_profile.py splits it, or None) of `generate()`; with
    `stats`, its top functions by own time printed under `label`."""
    if not profile:
        return generate(), None
    profiler = cProfile.Profile()
    profiler.enable()
    run = generate()
    profiler.disable()
    if stats:
        print(f"{label}: top {stats} functions of {run.stats.cycles} cycles by own time", flush=True)
        pstats.Stats(profiler, stream=sys.stdout).sort_stats("tottime").print_stats(stats)
    return run, {k: round(v, 3) for k, v in split(profiler, max(run.stats.cycles, 1), CYCLE_PARTS).items()}


def summary(decode_seconds: float, steps: list[tuple[int, Optional[float], int]],
            host_ms: Optional[dict] = None) -> dict:
    """One generation's cycles: what was timed, what was not, and the timed ones by acceptance
    (and `host_ms`, the host's time a cycle by part, when profiled)."""
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
        **({"host_ms": host_ms} if host_ms is not None else {}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--prompts", type=Path, help="a `dflash corpus` JSONL file")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--replay", action="store_true",
                        help="also run each generation's cycles forced to the real run's acceptance")
    parser.add_argument("--profile", action="store_true",
                        help="split the host time of the real (again) and replayed cycles under cProfile")
    parser.add_argument("--stats", type=int, default=0,
                        help="with --profile: also print the first prompt's top N functions by own time")
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
            again, again_host = traced(lambda: run_once(engine, tokens, speculative=True, max_tokens=args.max_tokens,
                                                        sampling=greedy, ignore_eos=True, speculation=again_policy),
                                       args.profile, args.stats if not rows else 0, f"{name}, real")
            row = {"set": name, "prompt_tokens": len(tokens),
                   "alone_ms_per_token": 1e3 * alone.stats.decode_seconds / (alone.stats.generated_tokens - 1),
                   "tokens_per_cycle": dflash.stats.tokens_per_cycle,
                   **summary(dflash.stats.decode_seconds, policy.steps),
                   "again": summary(again.stats.decode_seconds, again_policy.steps, again_host)}
            if args.replay:
                schedule = [accepted for _, _, accepted in policy.steps]
                forced = Engine(ForcedAcceptance(engine.target, schedule, engine.drafter.block_size), engine.tokenizer,
                                engine.drafter, prefill_chunk=engine.prefill_chunk)
                replay_policy = TracedCycles(engine.drafter.block_size)
                replay, replay_host = traced(lambda: run_once(forced, tokens, speculative=True,
                                                              max_tokens=args.max_tokens, sampling=greedy,
                                                              ignore_eos=True, speculation=replay_policy),
                                             args.profile, args.stats if not rows else 0, f"{name}, replayed")
                if [a for _, _, a in replay_policy.steps] != schedule:
                    sys.exit(f"{name}: the replay accepted other drafts than the real run")
                row["replay"] = summary(replay.stats.decode_seconds, replay_policy.steps, replay_host)
            rows.append(row)
            cycles = (f"cycle median {row['median_cycle_ms']:.2f}, slowest {row['slowest_cycle_ms']:.2f} ms"
                      if row["timed_cycles"] else "no cycle timed")
            print(f"{name}: alone {row['alone_ms_per_token']:.2f} ms/token; {row['cycles']} cycles at "
                  f"{row['tokens_per_cycle']:.2f} tokens, decode {row['decode_ms']:.1f} ms = timed "
                  f"{row['timed_ms']:.1f} + untimed {row['untimed_ms']:.1f}; {cycles}; again: decode "
                  f"{row['again']['decode_ms']:.1f} = timed {row['again']['timed_ms']:.1f} + untimed "
                  f"{row['again']['untimed_ms']:.1f}", flush=True)
            for label in ("again", "replay"):
                part = row.get(label)
                if part is not None and (label == "replay" or part.get("host_ms")):
                    host = part.get("host_ms")
                    print(f"    {label}: cycle median {part['median_cycle_ms']:.2f} ms, decode {part['decode_ms']:.1f}"
                          + (": " + ", ".join(f"{k} {v:.2f}" for k, v in host.items()) if host else ""), flush=True)

    result = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "mlx": mx.__version__,
              "target": target_dir, "drafter": drafter_dir, "dtype": args.dtype, "max_tokens": args.max_tokens,
              "generations": rows}
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
