"""Where the host's time of a DFlash cycle goes, path by path (diagnostics).

A small target's cycle is bound by the host: building the verify's and the draft's graphs, and MLX
encoding and launching their kernels in `mx.async_eval` (docs/performance.md, "A 270M cycle is the
host launching kernels"). This runs forced-acceptance cycles (random weights, a real shape) under
cProfile and splits each cycle's host time into:

- verify build: the target's forward (`run_rows`), less the launches queued inside it;
- verify launch: `queue_layers`' `mx.async_eval`s (the first layers' kernels, as they are built)
  and `read_later`'s (the rest, the head and the choices);
- draft build: the drafter's `propose`;
- draft launch: `DecodeState.evaluate` (the drafts' `mx.async_eval`);
- read wait: the blocking read of the cycle's tokens (what the device still had to do; about 0
  where the host is the bound);
- rest: the engine's bookkeeping, cProfile's own overhead, and the first cycle's write of the
  prompt's taps into the drafter's context (spread over the run's cycles; the prompt's own
  forward, `run_layers`, is left out).

and the same for the target alone, a plain step a token: its build, its launch (`read_later`'s
`mx.async_eval`), the read's wait and the rest. A change that takes launches out of both (the
target's layers) moves both; one that takes them out of the draft moves the cycle alone.

Each path (gpu_cycle.py's `--paths` labels: kernel options) runs in turn, as often as it is
named, so a path that takes launches out of a forward shows as less launch time a cycle, a
steadier measure than wall time on a noisy host.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/cycle_profile.py --shape gemma-3-270m \\
        --paths dflash,cycle-copies,fused-norms,dflash,cycle-copies,fused-norms --out cycle_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402
from gpu_cycle import PATHS, parse_paths  # noqa: E402

from dflash_core.engine import Engine  # noqa: E402
from dflash_core.random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target  # noqa: E402

# What each part of a step's host time is: (file name ending, function name, tottime or cumtime)
# summed, less what other parts count inside it.
LAUNCH_VERIFY = [("adapters/base.py", "queue_layers", "tottime"),  # its first layers as they are built
                 ("decode_state.py", "read_later", "tottime")]  # the rest, the head, the choices
CYCLE_PARTS = {
    "verify_build": ([("adapters/", "run_rows", "cumtime")], LAUNCH_VERIFY[:1]),
    "verify_launch": (LAUNCH_VERIFY, []),
    "draft_build": ([("drafter.py", "propose", "cumtime")], []),
    "draft_launch": ([("decode_state.py", "evaluate", "tottime")], []),
    "read_wait": ([("host_reads.py", "tolist", "tottime")], []),  # the blocking read: the device's lead
}
STEP_PARTS = {  # a plain target step (the target alone): one launch point, at its read_later
    "step_build": ([("adapters/", "run_rows", "cumtime")], []),
    "step_launch": ([("decode_state.py", "read_later", "tottime")], []),
    "read_wait": ([("host_reads.py", "tolist", "tottime")], []),
}
PREFILL = ("adapters/", "run_layers", "cumtime")  # a prompt's forward: left out of "rest"


def split(profile: cProfile.Profile, steps: int, parts: dict) -> dict[str, float]:
    """ms a step (a cycle, or a plain step) of each of `parts` and of the rest, from one profile."""
    stats = pstats.Stats(profile).stats

    def seconds(entries) -> float:
        return sum(tottime if kind == "tottime" else cumtime
                   for (path, _, function), (_, _, tottime, cumtime, _) in stats.items()
                   for ending, wanted, kind in entries if ending in path and function == wanted)

    out = {name: 1e3 * (seconds(plus) - seconds(minus)) / steps for name, (plus, minus) in parts.items()}
    total = sum(tottime for _, _, tottime, _, _ in stats.values())
    out["rest"] = 1e3 * (total - seconds([PREFILL])) / steps - sum(out.values())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma-3-270m", help="a real shape, or tiny-<family> (checks the script)")
    parser.add_argument("--paths", default="dflash", help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--accepted", type=int, default=2, help="drafts accepted a cycle (tokens a cycle: one more)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=300, help="tokens generated a profiled run")
    parser.add_argument("--stats", type=int, default=0,
                        help="also print each path's first profiled cycles' top N functions by own time")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    paths = parse_paths(parser, args.paths)

    name, tiny = parse_shape(args.shape)
    target = random_target(name, "bf16", tiny=tiny)
    drafter = random_drafter(name, target, tiny)
    mx.random.seed(0)
    prompt = mx.random.randint(0, target.vocab_size, (args.context,)).tolist()
    engines = {}
    for p in set(paths):
        engine = Engine(ForcedAcceptance(target.with_kernels(PATHS[p]), [args.accepted]), None,
                        drafter.with_kernels(PATHS[p]), prefill_chunk=args.context)
        engine.tokenizer = ByteTokenizer(target.vocab_size)
        engines[p] = engine

    def run(engine, tokens, speculative=True):
        return list(engine.generate(prompt, max_tokens=tokens, stop_token_ids=set(), speculative=speculative,
                                    speculation="on"))[-1].stats

    def profiled(engine, speculative):
        profile = cProfile.Profile()
        profile.enable()
        stats = run(engine, args.tokens, speculative)
        profile.disable()
        return profile, stats

    for engine in engines.values():  # traced, compiled and allocated before anything is timed
        run(engine, 64)
        run(engine, 64, speculative=False)
    results, printed = [], set()
    for p in paths:
        plain_cycles, plain_steps = run(engines[p], args.tokens), run(engines[p], args.tokens, speculative=False)
        (cycle_profile, cycles), (step_profile, steps) = profiled(engines[p], True), profiled(engines[p], False)
        if not cycles.cycles or not plain_cycles.cycles:
            sys.exit(f"{p}: no cycle ran in {args.tokens} tokens (more --tokens)")
        step_count = steps.generated_tokens - 1  # (the first token is the prompt's)
        row = {"path": p, "cycles": cycles.cycles, "tokens_per_cycle": cycles.tokens_per_cycle,
               "cycle_ms": 1e3 * plain_cycles.decode_seconds / plain_cycles.cycles,
               "profiled_cycle_ms": 1e3 * cycles.decode_seconds / cycles.cycles,
               "host_ms": {k: round(v, 3) for k, v in split(cycle_profile, cycles.cycles, CYCLE_PARTS).items()},
               "target_alone": {
                   "step_ms": 1e3 * plain_steps.decode_seconds / (plain_steps.generated_tokens - 1),
                   "profiled_step_ms": 1e3 * steps.decode_seconds / step_count,
                   "host_ms": {k: round(v, 3) for k, v in split(step_profile, step_count, STEP_PARTS).items()}}}
        results.append(row)
        if args.stats and p not in printed:
            printed.add(p)
            print(f"{p}: top {args.stats} functions of {cycles.cycles} cycles by own time", flush=True)
            pstats.Stats(cycle_profile, stream=sys.stdout).sort_stats("tottime").print_stats(args.stats)
        alone = row["target_alone"]
        print(f"{p}: cycle {row['cycle_ms']:.2f} ms (profiled {row['profiled_cycle_ms']:.2f}), "
              + ", ".join(f"{k} {v:.2f}" for k, v in row["host_ms"].items())
              + f"; target alone: step {alone['step_ms']:.2f} ms (profiled {alone['profiled_step_ms']:.2f}), "
              + ", ".join(f"{k} {v:.2f}" for k, v in alone["host_ms"].items()), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "mlx": mx.__version__,
              "shape": args.shape, "context": args.context, "accepted": args.accepted, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
