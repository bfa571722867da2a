"""speculation auto against the target alone and always-on DFlash, on this machine, in one run.

    python benchmarks/cpu_auto.py --out cpu_auto.json

Four pairs, each run in all three modes on the same prompts, alternating, median decode tok/s:

- `demo`: the offline demo pair (Gemma 3 270M and its trained drafter; about 1.1 tokens per cycle),
- `tiny-untrained`: a tiny random Qwen3 target with an untrained drafter (nothing is accepted),
- `demo-forced-5`: the demo target with its drafter, the target made to accept 5 drafts per
  cycle (6 tokens per cycle; `random_models.ForcedAcceptance`): a well-accepted pair's speed,
- `tiny-trained`: a real pair that is accepted well, nothing forced: a tiny Gemma 3 target trained
  to answer these prompts with fixed passages (the tests' `agent_model`), and a drafter trained for
  it by `dflash train` on the target's own responses (about 3 minutes to build here). It knows what
  the target will say, so nearly every draft is accepted: speed where acceptance is high.

`--pairs` picks some of them (all by default). `--without-report` also runs `auto` as if the
drafter had no training report (its held-out acceptance, which `auto` starts from), alternated on
the same engine, for pairs whose drafter has one (the demo's):

    python benchmarks/cpu_auto.py --max-tokens 128 --repeats 2 --pairs demo --without-report

`--without-draft-vocab` also runs always-on and `auto` drafting over the whole LM head, for pairs
whose drafter has a draft vocabulary (the demo's: docs/performance.md, "A draft vocabulary").

Prints the ratios `auto / target` and `auto / on`, and the median over runs of each `auto` run against
the target alone's run of the same prompt (paired: what the machine's drift between prompts does not
move); `auto` should not fall below 0.95 of the better mode. Each prompt starts the modes one further
along, so that no mode always runs right after the same other one. The first generation of each mode
is a warm-up (auto's first measurements and probes); auto
keeps what it measured across the prompts of a pair, as a server does across requests.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.blas import preload  # noqa: E402

preload()

import mlx.core as mx  # noqa: E402

from dflash_core.bench import run_once  # noqa: E402
from dflash_core.engine import Engine  # noqa: E402
from dflash_core.sampling import SamplingParams  # noqa: E402
from dflash_core.speculation import ModelSpeculation  # noqa: E402

PROMPTS = [
    "The lighthouse keeper wrote in his diary that",
    "def parse_config(path):\n    \"\"\"Read a YAML file and",
    "Volcanoes form when",
    "The first thing every new gardener learns is",
    "import numpy as np\n\ndef moving_average(x, n):",
    "Dear Sarah, thank you for the letter about",
]


PAIRS = ("demo", "tiny-untrained", "demo-forced-5", "tiny-trained")


def trained_tiny_pair(work: Path, response_tokens: int = 140) -> tuple[Path, Path]:
    """A tiny target trained to answer each of PROMPTS with its own passage of the tests' synthetic
    text, and a drafter that `dflash train` distils from it on those prompts: both directories."""
    from agent_model import agent_tokenizer, train_agent_target
    from synthetic import _corpus

    from dflash_core.train import TrainOptions, train

    tokenizer = agent_tokenizer(work / "tokenizer")
    words = " ".join(_corpus()).split()
    end = tokenizer.encode("<end_of_turn>", add_special_tokens=False)
    examples = []
    for i, prompt in enumerate(PROMPTS):
        passage = " " + " ".join(words[i * 100:(i + 1) * 100])
        examples.append((tokenizer.encode(prompt), tokenizer.encode(passage, add_special_tokens=False)[:response_tokens] + end))
    target = train_agent_target(work / "target", examples, steps=3000, margin=4.0, log=lambda *a: None)
    records = [{"prompt": p, "split": "train"} for p in PROMPTS] + [{"prompt": "A note on rivers", "split": "held_out"}]
    data = work / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    train(TrainOptions(target=str(target), data=data, out=work / "drafter", chat=False, layers=2, heads=4, kv_heads=2,
                       head_dim=16, intermediate_size=128, max_new_tokens=response_tokens + 8, steps=300, batch=8,
                       anchors=8, lr=3e-3, warmup=50, eval_every=300, save_every=300, seed=0))
    return target, work / "drafter"


def pairs(work: Path, names=PAIRS):
    from dflash_core.demo import DEMO_DRAFTER, demo_target_dir
    from dflash_core.loading import load_model
    from dflash_core.random_models import ForcedAcceptance
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from synthetic import tiny_pair  # the tests' fixtures: a tiny checkpoint on disk, with a tokenizer

    demo = load_model(str(demo_target_dir()), str(DEMO_DRAFTER)).engine if {"demo", "demo-forced-5"} & set(names) else None
    if "demo" in names:
        yield "demo", demo
    if "tiny-untrained" in names:
        target, drafter = tiny_pair(work / "tiny", "qwen3")
        yield "tiny-untrained", load_model(str(target), str(drafter)).engine
    if "demo-forced-5" in names:
        forced = ForcedAcceptance(demo.target, [5], demo.drafter.block_size)
        yield "demo-forced-5", Engine(forced, demo.tokenizer, demo.drafter)
    if "tiny-trained" in names:
        target, drafter = trained_tiny_pair(work / "trained")
        yield "tiny-trained", load_model(str(target), str(drafter)).engine


def measure(engine, prompts, max_tokens: int, repeats: int, without_report: bool = False,
            without_draft_vocab: bool = False) -> dict:
    """`without_report`: also `auto` as if the drafter had no training report (`auto-no-report`: a
    model's auto state that starts from nothing); `without_draft_vocab`: also always-on and `auto`
    drafting over the whole LM head where the drafter has a draft vocabulary (`on-whole-head`,
    `auto-whole-head`, the latter with its own auto state); all on the same engine, alternated with
    the rest."""
    sampling = SamplingParams()
    drafter, held_out = engine.drafter, engine.speculation_state.held_out
    vocab = getattr(drafter, "draft_vocab", None)
    # mode -> (speculation, its auto state or None, the drafter's draft vocabulary)
    variants = {"off": ("off", None, vocab), "on": ("on", None, vocab), "auto": ("auto", engine.speculation_state, vocab)}
    if without_report and held_out is not None:
        variants["auto-no-report"] = ("auto", ModelSpeculation(drafter.block_size), vocab)
    if without_draft_vocab and vocab is not None:
        variants["on-whole-head"] = ("on", None, None)
        start = engine.speculation_state.expected  # (the drafter's held-out acceptance, as auto's)
        variants["auto-whole-head"] = ("auto", ModelSpeculation(drafter.block_size, start), None)
    modes = tuple(variants)
    encoded = [engine.tokenizer.encode(p) for p in prompts]

    def run(tokens, mode):
        speculation, state, drafter.draft_vocab = variants[mode]
        engine.speculation_state = state or engine.speculation_state
        return run_once(engine, tokens, speculative=speculation != "off", speculation=speculation,
                        max_tokens=max_tokens, sampling=sampling, ignore_eos=True)

    for mode in modes:  # warm-up: kernels compile, and auto measures this machine as a server would
        run(encoded[0], mode)
    runs = {m: [] for m in modes}
    for _ in range(repeats):
        for i, tokens in enumerate(encoded):
            # Each prompt starts the modes at the next one: no mode always runs right after the same
            # one (what a run leaves behind, in caches and the allocator, lands on the next).
            for mode in modes[i % len(modes):] + modes[: i % len(modes)]:
                runs[mode].append(run(tokens, mode))
    engine.speculation_state, drafter.draft_vocab = variants["auto"][1], vocab
    out = {}
    for mode, rs in runs.items():
        cycles = sum(r.cycles for r in rs)
        out[mode] = {
            "decode_tokens_per_second": statistics.median(r.decode_tokens_per_second for r in rs),
            "tokens_per_cycle": (sum(r.draft_tokens_accepted for r in rs) + cycles) / cycles if cycles else None,
            "cycles": cycles, "plain_steps": sum(r.plain_steps for r in rs),
            "same_output": all(a.tokens == b.tokens for a, b in zip(rs, runs["off"])),
            # each run against the target alone's run of the same prompt: the machine's drift between
            # prompts cancels (on this CPU a plain step varied 30-57 ms in one run)
            "vs_target_paired": statistics.median(r.decode_tokens_per_second / o.decode_tokens_per_second
                                                  for r, o in zip(rs, runs["off"])),
        }
    t, on, auto = (out[m]["decode_tokens_per_second"] for m in ("off", "on", "auto"))
    out["auto_vs_target"], out["auto_vs_on"], out["auto_vs_best"] = auto / t, auto / on, auto / max(t, on)
    for mode in ("auto-no-report", "on-whole-head", "auto-whole-head"):
        if mode in out:
            out[mode.replace("-", "_") + "_vs_target"] = out[mode]["decode_tokens_per_second"] / t
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=len(PROMPTS))
    parser.add_argument("--pairs", default=",".join(PAIRS), help=f"comma list of: {', '.join(PAIRS)}")
    parser.add_argument("--without-report", action="store_true",
                        help="also auto without the drafter's held-out acceptance (pairs whose drafter has one)")
    parser.add_argument("--without-draft-vocab", action="store_true",
                        help="also always-on and auto drafting over the whole LM head (pairs whose drafter has a "
                             "draft vocabulary)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    names = args.pairs.split(",")
    if unknown := [n for n in names if n not in PAIRS]:
        parser.error(f"unknown pairs {unknown}; known: {', '.join(PAIRS)}")
    report = {"machine": f"{platform.system()} {platform.machine()}, {mx.default_device()}", "blas": None,
              "max_tokens": args.max_tokens, "pairs": {}}
    from dflash_core.blas import describe

    report["blas"] = describe()
    with tempfile.TemporaryDirectory() as work:
        for name, engine in pairs(Path(work), names):
            result = measure(engine, PROMPTS[: args.prompts], args.max_tokens, args.repeats, args.without_report,
                             args.without_draft_vocab)
            report["pairs"][name] = result
            print(f"{name:<16} target {result['off']['decode_tokens_per_second']:7.1f} tok/s | "
                  f"on {result['on']['decode_tokens_per_second']:7.1f} ({result['on']['tokens_per_cycle'] or 0:.2f} tok/cycle) | "
                  f"auto {result['auto']['decode_tokens_per_second']:7.1f} ({result['auto']['cycles']} cycles, "
                  f"{result['auto']['plain_steps']} steps) | auto/target {result['auto_vs_target']:.2f}x "
                  f"auto/on {result['auto_vs_on']:.2f}x | same output: "
                  f"{result['on']['same_output'] and result['auto']['same_output']}"
                  + f" | paired auto/target {result['auto']['vs_target_paired']:.2f}x"
                  + (f" | auto without the report {result['auto_no_report_vs_target']:.2f}x the target "
                     f"(paired {result['auto-no-report']['vs_target_paired']:.2f}x)"
                     if "auto_no_report_vs_target" in result else "")
                  + "".join(f" | {mode} {result[mode.replace('-', '_') + '_vs_target']:.2f}x the target (paired "
                            f"{result[mode]['vs_target_paired']:.2f}x, {result[mode]['tokens_per_cycle'] or 0:.2f} tok/cycle)"
                            for mode in ("on-whole-head", "auto-whole-head") if mode in result), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
