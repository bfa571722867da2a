"""Host time to build (not run) the graphs of a decode step, a 16-token verify and a draft.

A small target's cycle is bound by the host, not the device: the host builds a verify and a draft
graph a cycle, and a decode step's graph a token (docs/performance.md, "Drafts ahead and split
outputs"). This builds each at a real shape (random weights) after a prompt, with the layers not
queued to the device while they are built (`KernelOptions.queue_layers` off), so the time is the
host's alone; `--profile` adds cProfile's top functions for each.

    python benchmarks/host_build.py --shape gemma-3-270m --out host_build.json
    python benchmarks/host_build.py --shape gemma-3-270m --profile
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

import mlx.core as mx  # noqa: E402

from dflash_core.random_models import parse_shape, random_drafter, random_target  # noqa: E402


def builders(target, drafter, prompt_tokens: int):
    """kind -> a function that builds one graph of that kind and returns what evaluates it."""
    taps = drafter.config.target_layer_ids
    cache = target.make_cache(drafter.config.block_size)
    out = target.forward(mx.random.randint(0, target.vocab_size, (1, prompt_tokens)), cache, taps)
    mx.eval(out.logits, [c.state for c in cache if c is not None])
    context = drafter.make_cache()
    drafter.add_context(out.tapped_hidden, context)
    mx.eval([c.state for c in context])
    block = mx.random.randint(0, target.vocab_size, (1, drafter.config.block_size))
    op_by_op = drafter.with_kernels(replace(drafter.kernels, compiled_drafter=False))

    def forward(tokens, tap_ids, record):
        o = target.forward(tokens, cache, tap_ids, record=record)
        if o.rollback is not None:
            target.rollback(cache, o.rollback, keep=0)  # the cache back where it was, every repeat alike
        return o.logits

    return {
        "decode": lambda: forward(block[:, :1], (), False),
        "verify16": lambda: forward(block, taps, True),
        "draft": lambda: drafter.propose(mx.array([1]), target, context),
        "draft-op-by-op": lambda: op_by_op.propose(mx.array([1]), target, context),  # no compiled blocks
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="gemma-3-270m", help="a real shape, or tiny-<family> (checks the script)")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--profile", action="store_true", help="print cProfile's top functions for each graph")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    name, tiny = parse_shape(args.shape)
    target = random_target(name, "bf16", tiny=tiny)
    target = target.with_kernels(replace(target.kernels, queue_layers=False))
    drafter = random_drafter(name, target, tiny)
    report = {"shape": args.shape, "device": str(mx.default_device()), "mlx": mx.__version__,
              "prompt_tokens": args.prompt_tokens, "build_ms": {}}
    for kind, build in builders(target, drafter, args.prompt_tokens).items():
        for _ in range(3):  # traced and compiled before timing
            mx.eval(build())
        times = []
        profile = cProfile.Profile() if args.profile else None
        for _ in range(args.repeats):
            if profile:
                profile.enable()
            start = time.perf_counter()
            result = build()
            times.append((time.perf_counter() - start) * 1e3)
            if profile:
                profile.disable()
            mx.eval(result)
        report["build_ms"][kind] = {"median": statistics.median(times), "min": min(times)}
        print(f"{kind}: build {statistics.median(times):.3f} ms median, {min(times):.3f} min", flush=True)
        if profile:
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(15)
            print(text.getvalue())
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
