"""`speculation: auto` on simulated machines: what its choices make of known costs and acceptance.

    python benchmarks/auto_simulated.py --seeds 3 --out auto_simulated.json

No model runs: the controller (dflash_core/speculation.py) plans every step and is told the wall
time a machine would take and the drafts a drafter would get accepted. Four machines: GPU-like, a
plain step 7.5 ms and a cycle 1.8 steps at any width (the demo pair on an H200, docs/train.md); the
same with a first cycle (right after a plain step or a cycle of another width) costing twice as
much, as with CUDA graphs on an H100; the same with the first plain step after a cycle costing two
steps more (on an H100 a refresh's three steps cost about six: docs/performance.md, "The two
engines on an H100"); and CPU-like, a cycle 9 steps (this project's 2-core box). Acceptance: each
draft position accepted with probability p given the one before was (iid), stretches of 60 or 200
tokens that alternate between a high and a low p (a generation whose text turns easy and hard), or
a p that changes every 128 tokens through a list (prompts of different kinds), in one generation of
4000 tokens or in 32 of 125. Steps are planned and timed in the engine's order. Reported: tok/s of
plain steps only, always-on cycles and auto, and auto over the better of the other two, the mean
over --seeds.

`--noise S` multiplies every step's and cycle's time by a lognormal noise of sigma S (a machine
whose samples vary, as an H100's did by +-10 % and more); `--width-tie T` runs auto with that
`AutoSpeculation.width_tie` (1.0: no tolerance, the width of the best rate); `--machines GPU` keeps
the machines whose name contains it. So the width tie's effect, in one run each:

    python benchmarks/auto_simulated.py --machines GPU --noise 0.1 --width-tie 1.0
    python benchmarks/auto_simulated.py --machines GPU --noise 0.1
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.speculation import ModelSpeculation  # noqa: E402

STEP = 0.0075
# (name, a cycle's cost in plain steps, a first cycle's cost in cycles: one right after a plain step or
# a cycle of another width, with CUDA graphs on an H100 about 2: docs/performance.md, "Never slower";
# what the first plain step after a cycle costs more, in steps)
MACHINES = (("GPU-like", 1.8, 1.0, 0.0), ("GPU-like, first cycles 2x", 1.8, 2.0, 0.0),
            ("GPU-like, first steps +2", 1.8, 1.0, 2.0), ("CPU-like", 9.0, 1.0, 0.0))


def geometric(p: float, width: int, rng: random.Random) -> int:
    accepted = 0
    while accepted < width - 1 and rng.random() < p:
        accepted += 1
    return accepted


def scenarios() -> dict:
    kinds = [0.3, 0.85, 0.5, 0.2, 0.7, 0.4, 0.9, 0.35]
    out = {f"iid p={p}": (lambda made, gen, p=p: p) for p in (0.3, 0.4, 0.5, 0.6, 0.8)}
    out["stretches of 60: p=0.8 / 0.1"] = lambda made, gen: 0.8 if (made // 60) % 2 else 0.1
    out["stretches of 200: p=0.7 / 0.2"] = lambda made, gen: 0.7 if (made // 200) % 2 else 0.2
    out["kinds of prompt"] = lambda made, gen: kinds[(gen + made // 128) % len(kinds)]
    return out


def run(mode: str, p_of, cycle_steps: float, generations: int, seed: int, total: int = 4000,
        first: float = 1.0, first_step: float = 0.0, noise: float = 0.0, width_tie: Optional[float] = None) -> float:
    """`first`: what a cycle costs, in cycles, right after a plain step or a cycle of another width;
    `first_step`: what a plain step right after a cycle costs more, in steps; `noise`: the sigma of
    a lognormal factor on every time (0: none drawn, the runs as before it existed)."""
    rng, model, seconds, made_all = random.Random(seed), ModelSpeculation(16), 0.0, 0
    for gen in range(generations):
        policy, context, made, last = model.policy(mode), 64, 0, None
        if width_tie is not None and hasattr(policy, "width_tie"):
            policy.width_tie = width_tie
        # In the engine's order (engine.py): the plan after a plain step is asked before that step
        # is observed (a plain step is queued early), and read to read is a step's time only where
        # it and the next were queued alike; a generation's first step is not timed.
        width, queued_early, opening = (policy.plan(context) if mode != "off" else 0), False, True
        while made < total // generations:
            planned = (policy.plan(context + 1) if mode != "off" else 0) if width == 0 else None
            accepted = geometric(p_of(made, gen), width, rng) if width else 0
            if width == 0:
                wall = STEP * (1 + (first_step if last else 0))
            else:
                wall = STEP * cycle_steps * (1 + 0.05 * rng.random()) * (1 if width == last else first)
            if noise:
                wall *= rng.lognormvariate(0, noise)
            timed = not opening and queued_early == (planned == 0)
            policy.observe(width, context, wall if timed else None, accepted)
            seconds, made, context, last = seconds + wall, made + accepted + 1, context + accepted + 1, width
            queued_early, opening = planned == 0, False
            width = planned if planned is not None else (policy.plan(context) if mode != "off" else 0)
        made_all += made
    return made_all / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--noise", type=float, default=0.0, help="lognormal sigma on every time (0: none)")
    parser.add_argument("--width-tie", type=float, help="auto's width_tie (default: AutoSpeculation's)")
    parser.add_argument("--machines", default="", help="only the machines whose name contains this")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for machine, cycle_steps, first, first_step in MACHINES:
        if args.machines not in machine:
            continue
        for name, p_of in scenarios().items():
            for generations in (1, 32):
                runs = {m: [run(m, p_of, cycle_steps, generations, s, first=first, first_step=first_step,
                                noise=args.noise, width_tie=args.width_tie)
                            for s in range(args.seeds)] for m in ("off", "on", "auto")}
                mean = {m: statistics.mean(v) for m, v in runs.items()}
                ratio = statistics.mean(a / max(o, n) for a, o, n in zip(runs["auto"], runs["off"], runs["on"]))
                rows.append({"machine": machine, "acceptance": name, "generations": generations,
                             "plain": mean["off"], "on": mean["on"], "auto": mean["auto"], "auto_over_best": ratio})
                print(f"{machine:26s} {name:32s} {generations:>2} gen  plain {mean['off']:5.0f}  on {mean['on']:5.0f}  "
                      f"auto {mean['auto']:5.0f}  auto/best {ratio:.2f}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"step_seconds": STEP, "seeds": args.seeds, "noise": args.noise,
                                        "width_tie": args.width_tie, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
