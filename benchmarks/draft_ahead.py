"""Drafts ahead against drafts after the read, on a real pair, in one process.

A cycle followed by a cycle can queue the next block's drafts behind its verify before the host
reads it (`KernelOptions.draft_ahead`, dflash_core/engine.py). This runs the same held-out prompts
(benchmarks/demo_pair.py's) with always-on DFlash, greedy, the drafter drafting ahead and not,
alternated prompt by prompt, and reports each mode's median decode tok/s, the per-prompt ratio
(ahead / after the read) and whether both gave the same tokens (they must).

    python benchmarks/draft_ahead.py --out draft_ahead.json            # the installed demo pair
    python benchmarks/draft_ahead.py --target DIR --drafter DIR --repeats 3
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402
from demo_pair import HELD_OUT, add_pair_arguments, load_pair  # noqa: E402

from dflash_core.bench import run_once  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2, help="passes over the prompts")
    parser.add_argument("--prompts-per-set", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    target, drafter, engine = load_pair(args)
    kernels = engine.drafter.kernels
    drafters = {"ahead": engine.drafter.with_kernels(replace(kernels, draft_ahead=True)),
                "after_read": engine.drafter.with_kernels(replace(kernels, draft_ahead=False))}
    greedy = SamplingParams()
    prompts = [p for ps in HELD_OUT.values() for p in ps[: args.prompts_per_set]]
    for d in drafters.values():  # compile and allocate before anything is timed
        engine.drafter = d
        run_once(engine, engine.tokenizer.encode("Warm up"), speculative=True, max_tokens=48, sampling=greedy,
                 ignore_eos=True, speculation="on")
    speeds = {name: [] for name in drafters}
    same = True
    for _ in range(args.repeats):
        for prompt in prompts:
            tokens = engine.tokenizer.encode(prompt)
            outputs = []
            for name, d in drafters.items():
                engine.drafter = d
                run = run_once(engine, tokens, speculative=True, max_tokens=args.max_tokens, sampling=greedy,
                               ignore_eos=True, speculation="on")
                speeds[name].append(run.decode_tokens_per_second)
                outputs.append(run.tokens)
            same = same and outputs[0] == outputs[1]
    ratios = [a / b for a, b in zip(speeds["ahead"], speeds["after_read"])]
    result = {
        "date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "machine": platform.machine(),
        "mlx": mx.__version__, "target": target, "drafter": drafter, "max_tokens": args.max_tokens,
        "runs_per_mode": len(ratios), "speculation": "on", "greedy": True,
        "median_tokens_per_second": {name: statistics.median(v) for name, v in speeds.items()},
        "ahead_over_after_read": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        "outputs_identical": same,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if not same:
        sys.exit("drafting ahead changed the output")


if __name__ == "__main__":
    main()
