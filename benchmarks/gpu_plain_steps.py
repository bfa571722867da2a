"""What a plain target step of a speculating generation costs against the target alone's step.

    MLX_USE_CUDA_GRAPHS=1 python benchmarks/gpu_plain_steps.py --shape qwen3.5-9b --context 32768 --out plain_steps.json

`speculation: auto` runs plain steps while cycles lose (docs/performance.md, "Never slower"). Such
a step also taps the drafter's layers and records its rollback; at 32K context the 9B shape's
plain steps once measured 11.0 ms against the target alone's 10.2. This script separates the
parts, in one process (random weights at a real shape, bf16; `tiny-<family>` checks it on a CPU):

- `steps`: one cache prefilled to the context, then runs of `--steps` one-token forwards, each
  queued before the one ahead is read, as the engine queues them, in four variants: taps or not,
  rollback record or not (each run trimmed back after, so every run starts at the same context);
- `generations`: the target alone (`off`), a speculating generation of plain steps only
  (`plain`), and one that runs a cycle first (`cycle1`: the prompt's taps written into the
  drafter's context before the plain steps); per generation, the median time between its tokens
  after the first ten.

The variants alternate, the order reversed every other repeat. `fastest` keeps each variant's
fastest repeat: on a machine where other work only adds time (a shared host), that is the closest
to its own cost; medians are kept too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STEP_VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (taps, record)
GENERATIONS = {"off": None, "plain": [], "cycle1": [16]}  # FixedPlans of each (None: the target alone)


def _variant(taps: bool, record: bool) -> str:
    return f"taps={taps} record={record}"


def time_steps(target, cache, token, tap_ids, taps: bool, record: bool, n: int) -> float:
    """ms a step over `n` one-token forwards from `token`, each queued before the one ahead is read;
    the attention caches are trimmed back after."""
    import mlx.core as mx

    ids = tap_ids if taps else ()
    mx.synchronize()
    start = time.perf_counter()
    ahead = None
    for _ in range(n):
        out = target.forward(token[None], cache, ids, record=record)
        token = mx.argmax(out.logits[0, -1:], axis=-1).astype(mx.int32)
        mx.async_eval(token, *([out.tapped_hidden] if taps else []))
        if ahead is not None:
            ahead.tolist()
        ahead = token
    ahead.tolist()
    mx.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / n
    for c in cache:
        if c is not None and c.is_trimmable():
            c.trim(n)
    return ms


def time_generation(engine, prompt, plans, steps: int) -> dict:
    import mlx.core as mx

    from dflash_core.warm_up import FixedPlans

    extra = {"speculative": False} if plans is None else {"speculation": FixedPlans(list(plans))}
    mx.synchronize()
    arrivals, last = [], None
    for chunk in engine.generate(prompt, max_tokens=steps, stop_token_ids=set(), **extra):
        if chunk.token_ids:
            arrivals.append(time.perf_counter())
        last = chunk
    mx.synchronize()
    gaps = [1e3 * (b - a) for a, b in zip(arrivals[10:], arrivals[11:])]
    return {"median_step_ms": round(statistics.median(gaps), 3), "tok_s": round(last.stats.decode_tokens_per_second, 2),
            "cycles": last.stats.cycles, "plain_steps": last.stats.plain_steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    import mlx.core as mx

    from dflash_core.cache import cache_arrays
    from dflash_core.engine import Engine
    from dflash_core.random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target
    from dflash_core.warm_up import warm_up

    name, tiny = parse_shape(args.shape)
    target = random_target(name, "bf16", tiny=tiny)
    drafter = random_drafter(name, target, tiny)
    engine = Engine(ForcedAcceptance(target, [0], drafter.block_size), ByteTokenizer(target.vocab_size), drafter)
    started = time.perf_counter()
    warm_up(engine)
    report = {"device": mx.device_info().get("device_name"), "shape": args.shape, "context": args.context,
              "warm_up_s": round(time.perf_counter() - started, 1), "steps": {}, "generations": {}}
    prompt = mx.random.randint(0, target.vocab_size, (args.context,), key=mx.random.key(args.context)).tolist()

    cache = target.make_cache(max_rollback=drafter.block_size)
    for start in range(0, args.context - 1, 2048):
        out = target.forward(mx.array(prompt[start:min(args.context - 1, start + 2048)], dtype=mx.int32)[None], cache,
                             last_logits_only=True)
        mx.eval(out.logits, cache_arrays(cache))
    token = mx.array(prompt[-1:], dtype=mx.int32)
    tap_ids = drafter.config.target_layer_ids
    for taps, record in STEP_VARIANTS:  # compiles, off the clock
        time_steps(target, cache, token, tap_ids, taps, record, 4)
    for repeat in range(args.repeats):
        for taps, record in STEP_VARIANTS[::-1 if repeat % 2 else 1]:
            ms = time_steps(target, cache, token, tap_ids, taps, record, args.steps)
            report["steps"].setdefault(_variant(taps, record), []).append(round(ms, 3))
    del cache

    for plans in GENERATIONS.values():
        time_generation(engine, prompt, plans, 16)
    for repeat in range(args.repeats):
        for mode in list(GENERATIONS)[::-1 if repeat % 2 else 1]:
            report["generations"].setdefault(mode, []).append(time_generation(engine, prompt, GENERATIONS[mode], args.steps))

    report["fastest"] = {**{k: min(v) for k, v in report["steps"].items()},
                         **{k: min(r["median_step_ms"] for r in v) for k, v in report["generations"].items()}}
    report["median"] = {**{k: statistics.median(v) for k, v in report["steps"].items()},
                        **{k: statistics.median(r["median_step_ms"] for r in v) for k, v in report["generations"].items()}}
    for kind in ("fastest", "median"):
        print(f"{kind} ms a step: " + ", ".join(f"{k} {v:.2f}" for k, v in report[kind].items()), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
