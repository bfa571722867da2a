"""How `auto`'s narrower cycles fare against always-on on a real pair, by a modeled clock.

Two measures, both on one engine (the real target and drafter, on any backend):

- `fixed`: each prompt always-on at the whole block and at `--narrow` wide, tokens a cycle, beside
  what the narrow width would make if its drafts were the whole block's first ones (1 + the whole
  block's acceptance through each of the narrow width's drafts). A narrow cycle that drafts a
  narrower block falls short of it (docs/performance.md, "Narrow cycles draft the whole block").
- `auto`: each prompt always-on, then `speculation: auto`, timed by a clock that charges each target
  forward `--step-ms` plus `--token-ms` a token beyond the first (`tests/cost_clock.py`): a machine
  where widths cost about the same, as a GPU, whatever this one is. Tokens a cycle, cycles by width,
  plain steps, and the modeled decode time of `auto` against always-on's.

    python benchmarks/auto_widths.py --prompts held_out_prompts.jsonl --set code --prompts-per-set 6
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from dflash_core.blas import preload  # noqa: E402

preload()  # the fast BLAS `dflash` runs with on a Linux CPU, loaded before MLX

from cost_clock import CostClock, CostedTarget  # noqa: E402
from demo_pair import add_pair_arguments, load_pair  # noqa: E402
from pair_paths import held_out_prompts  # noqa: E402

from dflash_core.bench import run_once  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402
from dflash_core.speculation import AlwaysSpeculate  # noqa: E402


def modeled_seconds(stats, clock: CostClock) -> float:
    """A generation's decode time on `clock`'s model: its cycles by width and its plain steps."""
    cycles = sum(n * clock.forward_cost(w) for w, n in stats.cycle_widths.items())
    return cycles + stats.plain_steps * clock.forward_cost(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_arguments(parser)
    parser.add_argument("--prompts", type=Path, help="a `dflash corpus` JSONL file (default: demo_pair.py's openings)")
    parser.add_argument("--set", default="code", help="the category of prompts to run")
    parser.add_argument("--prompts-per-set", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--narrow", type=int, default=8, help="the narrower width of `fixed`")
    parser.add_argument("--step-ms", type=float, default=4.0)
    parser.add_argument("--token-ms", type=float, default=0.05)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    _, _, base = load_pair(args)
    block = base.drafter.config.block_size
    clock = CostClock(step=args.step_ms / 1e3, per_token=args.token_ms / 1e3)
    engine = Engine(CostedTarget(base.target, clock), base.tokenizer, base.drafter, clock=clock)
    greedy = SamplingParams()
    prompts = held_out_prompts(args.prompts, args.prompts_per_set).get(args.set, [])
    if not prompts:
        parser.error(f"no held-out prompts of set {args.set!r}")
    rows = []
    for prompt in prompts:
        tokens = engine.tokenizer.encode(prompt)

        def run(speculation):
            return run_once(engine, tokens, speculative=True, speculation=speculation, max_tokens=args.max_tokens,
                            sampling=greedy, ignore_eos=True)

        whole, narrow = run(AlwaysSpeculate(block)), run(AlwaysSpeculate(args.narrow))
        on, auto = run("on"), run("auto")
        through = [a / whole.stats.cycles for a in whole.stats.accepted_by_position]
        row = {
            "prompt": prompt[:60],
            "same_output": whole.tokens == narrow.tokens == on.tokens == auto.tokens,
            "fixed": {"whole_tokens_per_cycle": whole.stats.generated_tokens / whole.stats.cycles,
                      "narrow_tokens_per_cycle": narrow.stats.generated_tokens / narrow.stats.cycles,
                      "narrow_from_whole_block": 1 + sum(through[: args.narrow - 1])},
            "auto": {"on_tokens_per_cycle": on.stats.generated_tokens / on.stats.cycles,
                     "auto_tokens_per_cycle": (auto.stats.generated_tokens - auto.stats.tokens_from_steps)
                     / max(auto.stats.cycles, 1),
                     "auto_cycle_widths": auto.stats.cycle_widths, "auto_plain_steps": auto.stats.plain_steps,
                     "on_seconds": modeled_seconds(on.stats, clock), "auto_seconds": modeled_seconds(auto.stats, clock)},
        }
        rows.append(row)
        f, a = row["fixed"], row["auto"]
        print(f"{row['prompt'][:30]!r}: whole {f['whole_tokens_per_cycle']:.2f}, {args.narrow} wide "
              f"{f['narrow_tokens_per_cycle']:.2f} (the whole block's first drafts: {f['narrow_from_whole_block']:.2f}); "
              f"auto {a['auto_tokens_per_cycle']:.2f} against on {a['on_tokens_per_cycle']:.2f}, widths "
              f"{a['auto_cycle_widths']}, plain {a['auto_plain_steps']}, modeled on/auto "
              f"{a['on_seconds'] / a['auto_seconds']:.2f}x", flush=True)
    on_total = sum(r["auto"]["on_seconds"] for r in rows)
    auto_total = sum(r["auto"]["auto_seconds"] for r in rows)
    print(f"auto against always-on, modeled decode time over the prompts: {on_total / auto_total:.2f}x as fast; "
          f"outputs the same: {all(r['same_output'] for r in rows)}")
    if args.out:
        args.out.write_text(json.dumps({"settings": {k: str(v) for k, v in vars(args).items()},
                                        "auto_against_on": on_total / auto_total, "prompts": rows}, indent=1))


if __name__ == "__main__":
    main()
