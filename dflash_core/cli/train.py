"""`dflash train`: distil a drafter for a target; `dflash corpus`: write prompts to train it on."""

from __future__ import annotations

import argparse
from collections import Counter
from pathlib import Path

from ..corpus import CATEGORIES, HELD_OUT, SOURCE_NAMES, build_corpus, write_corpus
from ..train import HEAD_DTYPES, TARGET_DTYPES, TrainOptions, train
from .args import positive_int


def add_train(sub) -> None:
    p = sub.add_parser("train", help="distil a DFlash drafter for a target (saved in the z-lab format)")
    p.add_argument("--target", required=True, help="target model: repo id or local directory")
    p.add_argument("--data", required=True, type=Path, help="prompts: .txt (one per line), .jsonl or a folder of documents")
    p.add_argument("--out", required=True, type=Path, help="output folder (the drafter, checkpoints, the data)")
    p.add_argument("--init-from", metavar="DRAFTER",
                   help="a DFlash drafter (directory or repo id) to train further instead of a new one: its "
                        "architecture, taps, block size and mask token are kept (the flags that set them are refused)")
    p.add_argument("--layers", type=positive_int, help="drafter layers (default 1)")
    p.add_argument("--block-size", type=_block_size, help="tokens per draft block (default 16)")
    p.add_argument("--taps", help="comma-separated target layer ids (default: spread over the target)")
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--minutes", type=_positive_float,
                   help="training time budget (data generation not counted): the run ends at --steps or when this "
                        "runs out, the learning rate decaying by whichever comes first")
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per optimizer step")
    p.add_argument("--anchors", type=positive_int, default=8, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block positions")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="length of the regenerated responses")
    p.add_argument("--generation-batch", type=positive_int, default=16,
                   help="target responses generated together (one batched forward per step)")
    p.add_argument("--generator", choices=("engine", "mlx-lm"), default="engine",
                   help="whose batched generation makes the responses: the engine's, or mlx-lm's BatchGenerator "
                        "(far less host work a row at hundreds of rows on a GPU; docs/train.md)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384, help="longer prompts keep their head and end")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--samples-per-prompt", type=positive_int, default=1,
                   help="responses per prompt: the greedy one, then sampled ones (seeded)")
    p.add_argument("--sample-temperature", type=_temperature, default=0.8, help="temperature of the sampled responses")
    p.add_argument("--shard-prompts", type=positive_int, default=256,
                   help="prompts per shard of the data generation (a cut run resumes at its first unfinished shard)")
    p.add_argument("--generation-minutes", type=_non_negative_float,
                   help="time budget of the data generation: no shard starts after it, the run trains on the prompts "
                        "done so far, and a later run into the same --out continues the generation; 0: generate "
                        "nothing, train on the data OUT/data holds (without this flag a run first finishes the data)")
    p.add_argument("--generate-only", action="store_true",
                   help="make (or continue) the data in OUT/data and stop without training: a later run into the same "
                        "--out with the same --target, --data and response settings continues it, or trains on it "
                        "(on the prompts done so far with --generation-minutes 0; data can grow over runs)")
    p.add_argument("--held-out", type=_share, default=0.1,
                   help="share of prompts held out where the data has no split (dflash corpus writes one)")
    p.add_argument("--eval-every", type=positive_int, default=100)
    p.add_argument("--save-every", type=positive_int, default=200)
    p.add_argument("--intermediate-size", type=positive_int)
    p.add_argument("--heads", type=positive_int)
    p.add_argument("--kv-heads", type=positive_int)
    p.add_argument("--head-dim", type=positive_int, help="default 128")
    p.add_argument("--mask-token-id", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from out/checkpoint")
    p.add_argument("--head-dtype", choices=HEAD_DTYPES, default="target",
                   help="dtype of the loss's LM-head product: the target head's own, or bfloat16 (tensor cores on a "
                        "GPU, where a float32 target's full-vocabulary head is most of a step; a quantized head is "
                        "left as it is; docs/train.md)")
    p.add_argument("--target-dtype", choices=TARGET_DTYPES, default="target",
                   help="dtype the target is loaded in for training (its taps, embedding and head), after the data "
                        "is made by the target as stored: bfloat16 runs a float32 target's forwards on a GPU's "
                        "tensor cores; the drafter is still saved in the stored target's dtype unless --save-dtype "
                        "(docs/train.md)")
    p.add_argument("--tap-cache-gb", type=_positive_float, default=4.0,
                   help="memory for the target's hidden states of the training sequences, kept across steps "
                        "(a sequence beyond it runs through the target each time it is drawn)")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the saved weights")
    p.add_argument("--loss-vocab", choices=("full", "data"), default="full",
                   help="softmax over the whole vocabulary (default) or only the tokens in the training responses")
    p.add_argument("--draft-vocab", type=_non_negative_int, default=0, metavar="N",
                   help="also write draft_vocab.json: the N tokens most frequent in the training responses, the only "
                        "ones the drafter then drafts (cheaper drafts where the LM head is their cost, as on a CPU "
                        "with a large vocabulary; docs/train.md). 0 (default): drafts over the whole vocabulary")
    p.set_defaults(func=run_train)


def _temperature(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a sampling temperature must be above 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"a number of 0 or more expected, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"a number above 0 expected, got {text}")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:  # (NaN too)
        raise argparse.ArgumentTypeError(f"a number of at least 0 expected, got {text}")
    return value


def _share(text: str) -> float:
    value = float(text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"a share between 0 and 1 expected, got {text}")
    return value


def add_corpus(sub) -> None:
    p = sub.add_parser("corpus", help="write a prompt corpus for dflash train from the Python standard library, "
                                      "the bundled prompt sets and the packages installed with dflash "
                                      "(code, prose, chat, structured)")
    p.add_argument("--out", required=True, type=Path, help="the .jsonl to write (dflash train --data reads it)")
    p.add_argument("--categories", default=",".join(CATEGORIES), help=f"comma list of: {', '.join(CATEGORIES)}")
    p.add_argument("--sources", default=",".join(SOURCE_NAMES),
                   help="comma list of: stdlib (the standard library and the bundled prompt sets), packages (the "
                        "docstrings and code of numpy, transformers, mlx-lm, pydantic, ...: about two minutes to read); "
                        "stdlib alone is the corpus the demo drafter was trained on")
    p.add_argument("--per-category", type=positive_int, help="at most this many prompts of each (default: all)")
    p.add_argument("--held-out", type=_share, default=HELD_OUT, help="share of prompts held out (by a hash of each)")
    p.set_defaults(func=run_corpus)


def run_corpus(args) -> int:
    corpus = build_corpus(args.categories.split(","), args.per_category, args.held_out, sources=args.sources.split(","))
    write_corpus(corpus, args.out)
    counts = Counter((c.category, c.split) for c in corpus)
    for category in dict.fromkeys(c.category for c in corpus):
        print(f"{category:>10}: {counts[category, 'train']} train, {counts[category, 'held_out']} held out")
    print(f"{len(corpus)} prompts in {args.out}")
    return 0


def _block_size(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a block needs at least 2 tokens, got {text}")
    return value


def run_train(args) -> int:
    opts = TrainOptions(
        target=args.target, data=args.data, out=args.out, init_from=args.init_from, layers=args.layers,
        block_size=args.block_size, taps=[int(t) for t in args.taps.split(",")] if args.taps else None,
        steps=args.steps, minutes=args.minutes,
        batch=args.batch,
        anchors=args.anchors, lr=args.lr, warmup=args.warmup, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
        generation_batch=args.generation_batch, generator=args.generator,
        samples_per_prompt=args.samples_per_prompt,
        sample_temperature=args.sample_temperature, shard_prompts=args.shard_prompts,
        generation_minutes=args.generation_minutes, generate_only=args.generate_only, held_out=args.held_out,
        max_prompt_tokens=args.max_prompt_tokens,
        chat=not args.no_chat, eval_every=args.eval_every, save_every=args.save_every,
        intermediate_size=args.intermediate_size, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        mask_token_id=args.mask_token_id, seed=args.seed, resume=args.resume, loss_vocab=args.loss_vocab,
        head_dtype=args.head_dtype,
        target_dtype=args.target_dtype,
        save_dtype=args.save_dtype, tap_cache_gb=args.tap_cache_gb, draft_vocab=args.draft_vocab,
    )
    report = train(opts)
    data = report.data
    speed = data.get("generation_tokens_per_second")
    print(f"data: {data.get('sequences')} sequences, {data.get('response_tokens')} response tokens"
          + (f" (target responses at {speed:.1f} tok/s)" if speed else ""))
    if report.ended_by == "data":
        print(f"data only (--generate-only): {data.get('prompts_done')} prompts done, in {opts.out / 'data'}; "
              "the same command continues it, and without --generate-only trains on it")
        return 0
    ended = " (the time budget ran out)" if report.ended_by == "time" else ""
    print(f"trained {report.steps} steps{ended} in {report.seconds:.0f}s ({report.trained_tokens_per_second:.0f} block "
          f"tokens/s): loss {report.first_loss:.3f} -> {report.last_loss:.3f}, held-out estimate "
          f"{report.tokens_per_cycle_estimate:.2f} tokens/cycle; drafter in {opts.out}")
    if report.acceptance_by_position:
        print("held-out acceptance by block position: " + " ".join(f"{a:.2f}" for a in report.acceptance_by_position))
    if report.taps:
        taps = report.taps
        print(f"target taps: {taps['target_seconds']:.0f}s of the run in the target, {taps['hits']} of "
              f"{taps['hits'] + taps['misses']} sequences drawn from the tap cache ({taps['kept_sequences']} kept, "
              f"{taps['kept_gb']:.1f} of {taps['budget_gb']:.1f} GB)")
    return 0
