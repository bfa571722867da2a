"""A real pair's speed under several kernel paths, against the target alone, in one process.

For each prompt, each path in turn (gpu_cycle.py's `--paths` labels: kernel options) runs the
target alone and always-on DFlash, greedy, so that the paths alternate prompt by prompt on a noisy
host. Per path: the median decode tok/s of each mode, DFlash over the target alone (the median of
the per-prompt ratios, and the ratio of the medians), tokens per cycle, and whether every output
of DFlash was the target alone's of the same path token for token (it must be). Paths that round
differently (another attention chunk) may give the target itself other tokens in bf16, so outputs
are compared within a path, not across.

    python benchmarks/pair_paths.py --target DIR --drafter DIR --dtype bfloat16 --paths dflash,chunk32 \
        --prompts prompts.jsonl --prompts-per-set 6 --out pair_paths.json

`--prompts`: a `dflash corpus` JSONL file (its held-out split, the first N of each category), else
benchmarks/demo_pair.py's held-out openings. Prompts go in without a chat template.
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
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402
from demo_pair import HELD_OUT, add_pair_arguments, load_pair  # noqa: E402
from gpu_cycle import PATHS, parse_paths  # noqa: E402

from dflash_core.bench import first_divergence, mode_result, run_once  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402


def held_out_prompts(path: Path | None, per_set: int) -> dict[str, list[str]]:
    """category -> prompts: the file's held-out split, or demo_pair.py's openings."""
    if path is None:
        return {name: prompts[:per_set] for name, prompts in HELD_OUT.items()}
    sets: dict[str, list[str]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        if record.get("split", "held_out") == "held_out":
            prompts = sets.setdefault(record.get("category", "all"), [])
            if len(prompts) < per_set:
                prompts.append(record["prompt"])
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--paths", default="dflash", help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--prompts", type=Path, help="a `dflash corpus` JSONL file")
    parser.add_argument("--prompts-per-set", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    paths = parse_paths(parser, args.paths)
    if args.prompts_per_set < 1 or args.max_tokens < 2:  # (a decode speed needs two tokens)
        parser.error("--prompts-per-set must be at least 1 and --max-tokens at least 2")

    target_dir, drafter_dir, loaded = load_pair(args)
    engines = {p: Engine(loaded.target.with_kernels(PATHS[p]), loaded.tokenizer, loaded.drafter.with_kernels(PATHS[p]),
                         prefill_chunk=loaded.prefill_chunk)
               for p in paths}
    greedy = SamplingParams()
    warm = loaded.tokenizer.encode("Warm up")
    for engine in engines.values():  # compile and allocate before anything is timed
        for speculative in (False, True):
            run_once(engine, warm, speculative=speculative, max_tokens=32, sampling=greedy, ignore_eos=True,
                     speculation="on")

    sets = {}
    identical = True
    for name, prompts in held_out_prompts(args.prompts, args.prompts_per_set).items():
        runs = {p: {False: [], True: []} for p in paths}
        for prompt in prompts:
            tokens = loaded.tokenizer.encode(prompt)
            for p, engine in engines.items():
                for speculative in (False, True):
                    runs[p][speculative].append(run_once(engine, tokens, speculative=speculative,
                                                         max_tokens=args.max_tokens, sampling=greedy,
                                                         ignore_eos=True, speculation="on"))
                if first_divergence(runs[p][False][-1].tokens, runs[p][True][-1].tokens) is not None:
                    identical = False
        sets[name] = {}
        for p in paths:
            alone, dflash = runs[p][False], runs[p][True]
            alone_tps = statistics.median(r.decode_tokens_per_second for r in alone)
            dflash_tps = statistics.median(r.decode_tokens_per_second for r in dflash)
            ratios = [d.decode_tokens_per_second / a.decode_tokens_per_second for a, d in zip(alone, dflash)]
            sets[name][p] = {
                "prompts": len(prompts), "tokens_per_cycle": mode_result(dflash).tokens_per_cycle,
                "target_alone_decode_tokens_per_second": alone_tps, "dflash_decode_tokens_per_second": dflash_tps,
                "speedup_of_medians": dflash_tps / alone_tps, "speedup_median_per_prompt": statistics.median(ratios),
            }
            s = sets[name][p]
            print(f"{name} {p}: {s['tokens_per_cycle']:.2f} tokens/cycle, alone {alone_tps:.1f} tok/s, "
                  f"DFlash {dflash_tps:.1f} tok/s, {s['speedup_of_medians']:.2f}x "
                  f"(per prompt {s['speedup_median_per_prompt']:.2f}x)", flush=True)

    result = {
        "date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "machine": platform.machine(),
        "mlx": mx.__version__, "target": target_dir, "drafter": drafter_dir, "dtype": args.dtype,
        "max_tokens": args.max_tokens, "paths": paths, "greedy": True, "sets": sets, "outputs_identical": identical,
    }
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))
    if not identical:
        sys.exit("DFlash's output differed from the target alone's")


if __name__ == "__main__":
    main()
