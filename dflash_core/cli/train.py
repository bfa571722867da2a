"""`dflash train`: distil a drafter for a target."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..train import TrainOptions, train
from .args import positive_int


def add_train(sub) -> None:
    p = sub.add_parser("train", help="distil a DFlash drafter for a target (saved in the z-lab format)")
    p.add_argument("--target", required=True, help="target model: repo id or local directory")
    p.add_argument("--data", required=True, type=Path, help="prompts: .txt (one per line), .jsonl or a folder of documents")
    p.add_argument("--out", required=True, type=Path, help="output folder (the drafter, checkpoints, the data)")
    p.add_argument("--layers", type=positive_int, default=1)
    p.add_argument("--block-size", type=_block_size, default=16)
    p.add_argument("--taps", help="comma-separated target layer ids (default: spread over the target)")
    p.add_argument("--steps", type=positive_int, default=1000)
    p.add_argument("--batch", type=positive_int, default=4, help="sequences per optimizer step")
    p.add_argument("--anchors", type=positive_int, default=8, help="blocks per sequence")
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--gamma", type=float, default=7.0, help="loss weight decay over block positions")
    p.add_argument("--max-new-tokens", type=positive_int, default=128, help="length of the regenerated responses")
    p.add_argument("--generation-batch", type=positive_int, default=16,
                   help="target responses generated together (one batched forward per step)")
    p.add_argument("--max-prompt-tokens", type=positive_int, default=384, help="longer prompts keep their head and end")
    p.add_argument("--no-chat", action="store_true", help="do not wrap prompts in the chat template")
    p.add_argument("--eval-every", type=positive_int, default=100)
    p.add_argument("--save-every", type=positive_int, default=200)
    p.add_argument("--intermediate-size", type=positive_int)
    p.add_argument("--heads", type=positive_int)
    p.add_argument("--kv-heads", type=positive_int)
    p.add_argument("--head-dim", type=positive_int, default=128)
    p.add_argument("--mask-token-id", type=int)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--resume", action="store_true", help="continue from out/checkpoint")
    p.add_argument("--save-dtype", choices=("float32", "bfloat16", "float16"), help="dtype of the saved weights")
    p.add_argument("--loss-vocab", choices=("full", "data"), default="full",
                   help="softmax over the whole vocabulary (default) or only the tokens in the training responses")
    p.set_defaults(func=run_train)


def _block_size(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"a block needs at least 2 tokens, got {text}")
    return value


def run_train(args) -> int:
    opts = TrainOptions(
        target=args.target, data=args.data, out=args.out, layers=args.layers, block_size=args.block_size,
        taps=[int(t) for t in args.taps.split(",")] if args.taps else None, steps=args.steps, batch=args.batch,
        anchors=args.anchors, lr=args.lr, warmup=args.warmup, gamma=args.gamma, max_new_tokens=args.max_new_tokens,
        generation_batch=args.generation_batch,
        max_prompt_tokens=args.max_prompt_tokens,
        chat=not args.no_chat, eval_every=args.eval_every, save_every=args.save_every,
        intermediate_size=args.intermediate_size, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        mask_token_id=args.mask_token_id, seed=args.seed, resume=args.resume, loss_vocab=args.loss_vocab,
        save_dtype=args.save_dtype,
    )
    report = train(opts)
    print(f"trained {report.steps} steps in {report.seconds:.0f}s: loss {report.first_loss:.3f} -> "
          f"{report.last_loss:.3f}, held-out estimate {report.tokens_per_cycle_estimate:.2f} tokens/cycle; "
          f"drafter in {opts.out}")
    return 0
