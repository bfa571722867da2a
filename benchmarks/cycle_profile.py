"""Where the host's time of a DFlash cycle goes, path by path (diagnostics).

A small target's cycle is bound by the host: building the verify's and the draft's graphs, and MLX
encoding and launching their kernels in `mx.async_eval` (docs/performance.md, "A 270M cycle is the
host launching kernels"). This runs forced-acceptance cycles (random weights, a real shape) under
cProfile and splits each cycle's host time into:

- verify build: the target's forward (`run_rows`), less the launches queued inside it;
- verify launch: `queue_layers`' `mx.async_eval`s (the first layers' kernels, as they are built);
- draft build: the drafter's `propose`;
- draft launch: `DecodeState.evaluate` (the drafts' `mx.async_eval`);
- rest: the read, the engine's bookkeeping, the last layers' and the head's launch, cProfile's
  own overhead, and the first cycle's write of the prompt's taps into the drafter's context
  (spread over the run's cycles; the prompt's own forward, `run_layers`, is left out).

Each path (gpu_cycle.py's `--paths` labels: kernel options) runs in turn, as often as it is
named, so a path that takes launches out of a forward shows as less launch time a cycle, a
steadier measure than wall time on a noisy host.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/cycle_profile.py --shape gemma-3-270m \\
        --paths dflash,stream-parts,fused-norms,dflash,stream-parts,fused-norms --out cycle_profile.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_cycle import PATHS, parse_paths  # noqa: E402

from dflash_core.engine import Engine  # noqa: E402
from dflash_core.random_models import ForcedAcceptance, parse_shape, random_drafter, random_target  # noqa: E402

# (file name ending, function name) -> what it measures; tottime or cumtime
PARTS = {
    "verify_launch": (("adapters/base.py", "queue_layers"), "tottime"),
    "draft_launch": (("decode_state.py", "evaluate"), "tottime"),
    "draft_build": (("drafter.py", "propose"), "cumtime"),
}
FORWARDS = "run_rows"  # every adapter's forward of rows (decode, verify)
PREFILL = "run_layers"  # and of a prompt


def split(profile: cProfile.Profile, cycles: int) -> dict[str, float]:
    """ms a cycle of each part (PARTS, verify_build, rest) from one profile."""
    stats = pstats.Stats(profile).stats
    found = {name: 0.0 for name in PARTS}
    forwards = prefill = 0.0
    total = 0.0
    for (path, _, function), (_, _, tottime, cumtime, _) in stats.items():
        total += tottime
        for name, ((ending, wanted), kind) in PARTS.items():
            if path.endswith(ending) and function == wanted:
                found[name] += tottime if kind == "tottime" else cumtime
        if "/adapters/" in path and function in (FORWARDS, PREFILL):
            forwards += cumtime if function == FORWARDS else 0.0
            prefill += cumtime if function == PREFILL else 0.0
    parts = {name: 1e3 * seconds / cycles for name, seconds in found.items()}
    parts["verify_build"] = 1e3 * (forwards - found["verify_launch"]) / cycles
    parts["rest"] = 1e3 * (total - prefill) / cycles - sum(parts.values())
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma-3-270m", help="a real shape, or tiny-<family> (checks the script)")
    parser.add_argument("--paths", default="dflash", help=f"comma-separated, of: {', '.join(PATHS)}")
    parser.add_argument("--accepted", type=int, default=2, help="drafts accepted a cycle (tokens a cycle: one more)")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--tokens", type=int, default=300, help="tokens generated a profiled run")
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
        engine.tokenizer = SimpleNamespace(eos_token_ids=[], decode=lambda *a, **k: "")
        engines[p] = engine

    def run(engine, tokens):
        return list(engine.generate(prompt, max_tokens=tokens, stop_token_ids=set(), speculation="on"))[-1].stats

    for engine in engines.values():  # traced, compiled and allocated before anything is timed
        run(engine, 64)
    results = []
    for p in paths:
        plain = run(engines[p], args.tokens)
        profile = cProfile.Profile()
        profile.enable()
        stats = run(engines[p], args.tokens)
        profile.disable()
        if not stats.cycles or not plain.cycles:
            sys.exit(f"{p}: no cycle ran in {args.tokens} tokens (more --tokens)")
        parts = split(profile, stats.cycles)
        row = {"path": p, "cycles": stats.cycles, "tokens_per_cycle": stats.tokens_per_cycle,
               "cycle_ms": 1e3 * plain.decode_seconds / plain.cycles,
               "profiled_cycle_ms": 1e3 * stats.decode_seconds / stats.cycles,
               "host_ms": {k: round(v, 3) for k, v in parts.items()}}
        results.append(row)
        print(f"{p}: cycle {row['cycle_ms']:.2f} ms (profiled {row['profiled_cycle_ms']:.2f}), "
              + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
    report = {"date": time.strftime("%Y-%m-%d"), "device": str(mx.default_device()), "mlx": mx.__version__,
              "shape": args.shape, "context": args.context, "accepted": args.accepted, "results": results}
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
