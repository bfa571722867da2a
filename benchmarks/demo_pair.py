"""Measure the offline demo pair (Gemma 3 270M + its trained drafter) on held-out prompts.

    python benchmarks/demo_pair.py --out demo_pair.json                # the installed demo pair
    python benchmarks/demo_pair.py --target DIR --drafter DIR --out F  # any converted target/drafter

The prompts below are plain-text continuations and code beginnings that are NOT in the training
prompts (dflash_core/demo/prompts.txt), sent without a chat template, as the drafter was trained.
For each set: tokens per cycle and acceptance by block position (pooled over every cycle), the
median decode speed of DFlash and of the target alone in the same process, their ratio, and
whether the two outputs were identical token for token (greedy).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402

from dflash_core.bench import first_divergence, mode_result, run_once  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402

HELD_OUT = {
    "text": [
        "The lighthouse keeper wrote in his diary that",
        "A recipe for tomato soup. Ingredients:",
        "The weather report for Tuesday says",
        "Dear Sarah, thank you for the letter about",
        "The museum opened its doors in",
        "Volcanoes form when",
        "The first thing every new gardener learns is",
        "Once upon a time, a small fox",
    ],
    "code": [
        "def quicksort(arr):",
        "def gcd(a, b):",
        "class Queue:\n    def __init__(self):",
        "import json\n\ndef load_config(path):",
        "for (int i = 0; i < n; i++) {",
        "def reverse_words(sentence):",
        "const express = require('express');\nconst app = express();",
        "def count_vowels(text):\n    \"\"\"Return the number of vowels in text.\"\"\"",
    ],
}


def add_pair_arguments(parser: argparse.ArgumentParser) -> None:
    """--target and --drafter: a pair to load instead of the demo's, --dtype to cast it to (`load_pair`)."""
    parser.add_argument("--target", help="converted target directory (default: the installed demo target)")
    parser.add_argument("--drafter", help="drafter directory (default: the shipped demo drafter)")
    parser.add_argument("--dtype", help="the target's and drafter's dtype (default: as stored)")


def load_pair(args: argparse.Namespace):
    """(target directory, drafter directory, engine) for `add_pair_arguments`'s values."""
    from dflash_core.demo import DEMO_DRAFTER, demo_target_dir
    from dflash_core.loading import load_model

    target = args.target or str(demo_target_dir())
    drafter = args.drafter or str(DEMO_DRAFTER)
    return target, drafter, load_model(target, drafter, dtype=args.dtype).engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="runs per prompt and mode; medians reported")
    parser.add_argument("--prompts-per-set", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    target, drafter, engine = load_pair(args)
    greedy = SamplingParams()
    warm = engine.tokenizer.encode("Warm up")
    for speculative in (False, True):  # compile and allocate before anything is timed
        run_once(engine, warm, speculative=speculative, max_tokens=16, sampling=greedy, ignore_eos=True)

    sets = {}
    for name, prompts in HELD_OUT.items():
        prompts = prompts[: args.prompts_per_set] if args.prompts_per_set else prompts
        alone, dflash, dflash_runs, mismatches = [], [], [], []
        for prompt in prompts:
            tokens = engine.tokenizer.encode(prompt)
            runs = {}
            for speculative in (False, True):
                runs[speculative] = [run_once(engine, tokens, speculative=speculative, max_tokens=args.max_tokens,
                                              sampling=greedy, ignore_eos=True) for _ in range(args.repeats)]
            divergence = first_divergence(runs[False][0].tokens, runs[True][0].tokens)
            if divergence is not None:
                mismatches.append({"prompt": prompt, "first_divergence": divergence})
            alone.append(mode_result(runs[False]))
            dflash.append(mode_result(runs[True]))
            dflash_runs += runs[True]
        pooled = mode_result(dflash_runs)  # tokens per cycle and acceptance over every cycle of the set
        alone_tps = statistics.median(r.decode_tokens_per_second for r in alone)
        dflash_tps = statistics.median(r.decode_tokens_per_second for r in dflash)
        sets[name] = {
            "prompts": len(prompts),
            "tokens_per_cycle": pooled.tokens_per_cycle,
            "acceptance_by_position": [round(a, 4) for a in pooled.acceptance_by_position],
            "target_alone_decode_tokens_per_second": alone_tps,
            "dflash_decode_tokens_per_second": dflash_tps,
            "speedup": dflash_tps / alone_tps,
            "outputs_identical": not mismatches,
            "mismatches": mismatches,
        }
        s = sets[name]
        print(f"{name}: {s['tokens_per_cycle']:.2f} tokens/cycle, target alone {alone_tps:.1f} tok/s, "
              f"DFlash {dflash_tps:.1f} tok/s, speedup {s['speedup']:.2f}x, identical: {s['outputs_identical']}")
        print("  acceptance by position:", " ".join(f"{a:.2f}" for a in s["acceptance_by_position"]))

    result = {
        "date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "machine": platform.machine(),
        "mlx": mx.__version__, "target": target, "drafter": drafter, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "greedy": True, "sets": sets,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if any(not s["outputs_identical"] for s in sets.values()):
        sys.exit("DFlash output differed from the target alone")


if __name__ == "__main__":
    main()
