"""speculation auto on a GPU: against the target alone and always-on DFlash, forced acceptance.

    python benchmarks/gpu_auto.py --shape qwen3.5-9b --contexts 1024,8192,32768 --out gpu_auto.json

A random-weight target at a real shape (bf16) and a random drafter; the target is made to accept a
fixed number of drafts per cycle (`random_models.ForcedAcceptance`): 0, 2 and 5.4 on average (1, 3
and 6.4 tokens per cycle). For each context and acceptance, in one process, alternating: decode
tok/s of the target alone, of DFlash on, and of auto (median of --repeats, 256 tokens each, the
modes' order reversed every other repeat, after one warm-up generation per mode in which auto
measures this machine as a server would; the samples auto was given in the measured runs are
summarized per kind, `auto_samples`, and kept in order per run, `auto_sequences`: (width, the time
auto was given or None, the wall time since the step before, which covers the steps auto is given
no time for); `runs` has every repeat's tok/s per mode, and `same_repeat_ratios` the medians of
each repeat's own ratios, which move less with the machine's drift between repeats). The target
alone also runs in a second process with MLX's CUDA graphs on (they are read once per process, and
off in a speculating one: docs/performance.md), reported as `target_graphs`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORCED = {"1": [0], "3": [2], "6.4": [5, 5, 6, 5, 6]}  # tokens per cycle -> accepted drafts per cycle


def _engine(shape: str, schedule):
    from dflash_core.engine import Engine
    from dflash_core.random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target
    from dflash_core.warm_up import warm_up

    name, tiny = parse_shape(shape)  # tiny-<family>: a check of this script on a CPU
    target = random_target(name, "bf16", tiny=tiny)
    drafter = random_drafter(name, target, tiny)
    adapter = ForcedAcceptance(target, schedule, drafter.block_size) if schedule is not None else target
    engine = Engine(adapter, ByteTokenizer(target.vocab_size), drafter if schedule is not None else None)
    # The kernel variants a run will meet compile now (about 2 s each on first use on an H100), as
    # a server's load does, not in whichever measured run first has one.
    warm_up(engine)
    return engine


class Traced:
    """auto's choices for one generation (the model's shared state, as a server's), with every
    sample it was given noted: (width, seconds or None, whether a plain step came just before, the
    wall time since the step before was observed, which the engine does not give for every step:
    at the edges of a run of plain steps, and the first step)."""

    def __init__(self, policy, samples: list):
        self.policy, self.samples, self.after_step, self.observed = policy, samples, True, None

    def plan(self, context):
        return self.policy.plan(context)

    def observe(self, width, context, seconds, accepted):
        now = time.perf_counter()
        wall = now - self.observed if self.observed is not None else None
        self.samples.append((width, seconds, self.after_step, wall))
        self.after_step, self.observed = width == 0, now
        self.policy.observe(width, context, seconds, accepted)

    def note(self):
        return self.policy.note()


def _summary(samples: list) -> dict:
    """Per kind of sample (a plain step; a cycle of width w, after a cycle or after plain steps):
    how many, and their median, fastest and slowest in ms; and the steps auto was given no time for
    (the edges of a run of plain steps, a generation's first step) by their wall time: `untimed`."""
    kinds: dict[str, list] = {}
    for width, seconds, after_step, wall in samples:
        kind = "step" if width == 0 else f"{width} after {'steps' if after_step else 'a cycle'}"
        if seconds is None:
            if wall is None:  # a generation's first step
                continue
            kind, seconds = f"untimed {kind}", wall
        kinds.setdefault(kind, []).append(1e3 * seconds)
    return {k: {"n": len(v), "median_ms": round(statistics.median(v), 3), "min_ms": round(min(v), 3),
                "max_ms": round(max(v), 3)} for k, v in sorted(kinds.items())}


def _decode(engine, context: int, mode: str, max_tokens: int, samples: list | None = None) -> float:
    import mlx.core as mx  # the engine alone: the GPU machine has MLX, not the server's packages

    prompt = mx.random.randint(0, engine.target.vocab_size, (context,), key=mx.random.key(context)).tolist()
    extra = {"speculation": mode} if mode != "off" else {"speculative": False}
    if mode == "auto" and samples is not None:
        extra = {"speculation": Traced(engine.speculation_state.policy("auto"), samples)}
    mx.synchronize()
    chunks = list(engine.generate(prompt, max_tokens=max_tokens, stop_token_ids=set(), **extra))
    mx.synchronize()  # the engine queues a step ahead: let it finish before the next measurement
    _decode.last = chunks[-1].stats
    return chunks[-1].stats.decode_tokens_per_second


def target_only(args) -> dict:
    engine = _engine(args.shape, None)
    out = {}
    for context in args.contexts:
        _decode(engine, context, "off", 16)
        out[str(context)] = statistics.median(_decode(engine, context, "off", args.max_tokens) for _ in range(args.repeats))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b")
    parser.add_argument("--contexts", type=lambda s: [int(v) for v in s.split(",")], default=[1024, 8192, 32768])
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--forced", type=lambda s: s.split(","), default=list(FORCED),
                        help=f"tokens per cycle to force, of {','.join(FORCED)}")
    parser.add_argument("--target-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.target_only:
        print(json.dumps(target_only(args)))
        return
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # as a speculating server runs
    graphs = subprocess.run([sys.executable, __file__, "--target-only", "--shape", args.shape,
                             "--contexts", ",".join(map(str, args.contexts)), "--max-tokens", str(args.max_tokens),
                             "--repeats", str(args.repeats)], env={**os.environ, "MLX_USE_CUDA_GRAPHS": "1"},
                            capture_output=True, text=True)
    if graphs.returncode != 0:
        raise SystemExit(graphs.stderr[-3000:])
    with_graphs = json.loads(graphs.stdout.strip().splitlines()[-1])
    import mlx.core as mx

    report = {"device": mx.device_info().get("device_name"), "shape": args.shape, "rows": [],
              "graphs_in_speculating_process": os.environ["MLX_USE_CUDA_GRAPHS"]}
    print(f"{'context':>7} {'tok/cycle':>9} | {'target':>8} {'graphs':>8} {'dflash':>8} {'auto':>8} | "
          f"{'auto/target':>11} {'auto/dflash':>11} {'auto/best':>9}")
    for name in args.forced:
        schedule = FORCED[name]
        engine = _engine(args.shape, schedule)
        for context in args.contexts:
            for mode in ("off", "on", "auto"):  # warm-up: compiles, and auto measures this machine
                _decode(engine, context, mode, args.max_tokens)
            runs, samples, sequences = {m: [] for m in ("off", "on", "auto")}, [], []
            for repeat in range(args.repeats):
                # Modes in turn, the order reversed every other repeat: a machine drifting steadily
                # (clocks, heat) would otherwise favour whichever mode runs first in every repeat.
                for mode in list(runs)[::-1 if repeat % 2 else 1]:
                    sequence = []  # auto's steps in order: (width, ms or None: not timed, wall ms)
                    runs[mode].append(_decode(engine, context, mode, args.max_tokens, sequence))
                    if mode == "auto":
                        last = _decode.last  # auto's last run: what it chose
                        samples += sequence
                        sequences.append([(w, s if s is None else round(1e3 * s, 3), wall if wall is None else
                                           round(1e3 * wall, 3)) for w, s, _, wall in sequence])
            t, on, auto = (statistics.median(runs[m]) for m in ("off", "on", "auto"))
            chose = {"cycles": last.cycles, "plain_steps": last.plain_steps, "widths": last.cycle_widths}
            g = with_graphs[str(context)]
            # The same repeat's modes ran one after the other: their ratio, per repeat, then the median,
            # moves less with this machine's drift between repeats than a ratio of medians does.
            paired = {"auto_vs_target": statistics.median(a / o for a, o in zip(runs["auto"], runs["off"])),
                      "auto_vs_dflash": statistics.median(a / o for a, o in zip(runs["auto"], runs["on"])),
                      "auto_vs_best": statistics.median(a / max(o, n) for a, o, n in zip(runs["auto"], runs["off"], runs["on"]))}
            row = {"context": context, "tokens_per_cycle": float(name), "target": t, "target_graphs": g,
                   "dflash": on, "auto": auto, "auto_vs_target": auto / max(t, g), "auto_vs_dflash": auto / on,
                   "auto_vs_best": auto / max(t, g, on), "same_repeat_ratios": paired, "auto_chose": chose,
                   "auto_samples": _summary(samples), "auto_sequences": sequences, "runs": runs}
            report["rows"].append(row)
            if args.out:  # after every row: a run cut short by its time limit keeps what it measured
                args.out.write_text(json.dumps(report, indent=2))
            print(f"{context:>7} {name:>9} | {t:8.1f} {g:8.1f} {on:8.1f} {auto:8.1f} | {row['auto_vs_target']:10.2f}x "
                  f"{row['auto_vs_dflash']:10.2f}x {row['auto_vs_best']:8.2f}x  auto: {chose}", flush=True)
            print("         same-repeat ratios (median; target in this process): " + ", ".join(
                f"{k} {v:.2f}" for k, v in paired.items()), flush=True)
            print("         auto's samples (ms): " + "; ".join(f"{k}: {v['n']} x {v['median_ms']:.2f} "
                  f"[{v['min_ms']:.2f}-{v['max_ms']:.2f}]" for k, v in row["auto_samples"].items()), flush=True)
        del engine


if __name__ == "__main__":
    main()
