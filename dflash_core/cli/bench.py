"""`dflash bench`: the engine benchmark or, with --server, a running server's (docs/bench.md)."""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

from ..bench import (
    EngineSettings,
    PlotsUnavailable,
    checkpoint_bench_model,
    engine_table,
    random_bench_model,
    run_engine_bench,
    run_server_bench,
    server_table,
    write_plots,
)
from ..bench_prompts import PROMPT_SETS, prompts_from_file, select_prompts
from ..random_models import QUANTS
from .args import add_distributed_flag, add_model_flags, distributed_channel, positive_int, positive_ints, settings_from_args


def _names(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def add_bench(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmark DFlash against the target alone (or a running server); table, JSON and plots",
        description="Median-of-N speed of DFlash against the target alone over bundled prompts and a context "
                    "sweep, with a token-for-token output check; or, with --server, streaming latency of a "
                    "running server. See docs/bench.md.")
    add_model_flags(p, what="with --server: the served model name, by default the server's first")
    p.add_argument("--random-weights", metavar="SHAPE",
                   help="random target + random drafter at real shapes (a REAL_SHAPES name such as qwen3.5-9b, "
                        "or tiny-<family>): speed only, no acceptance, no downloads")
    p.add_argument("--quant", choices=QUANTS, default="bf16", help="random weights: bf16 or 4-bit")
    p.add_argument("--layers", type=int, help="random weights: truncate the target to this many layers")
    p.add_argument("--forced-accepted", type=int, metavar="K",
                   help="random weights: force K accepted drafts per cycle (speed at K+1 tokens per cycle)")
    p.add_argument("--sets", type=_names, default=list(PROMPT_SETS), help="prompt sets (default: math,code,chat,agent)")
    p.add_argument("--prompts-per-set", type=positive_int, help="use only the first N prompts of each set")
    p.add_argument("--prompts", type=Path, metavar="FILE",
                   help="prompts from a file dflash train reads (dflash corpus writes one), one set per category, "
                        "instead of the bundled sets")
    p.add_argument("--prompts-split", choices=("held_out", "train", "all"), default="held_out",
                   help="with --prompts: the file's prompts of this split (default: held_out)")
    p.add_argument("--no-chat", action="store_true",
                   help="with --prompts: text prompts as they are, without the chat template (a base model)")
    p.add_argument("--contexts", type=positive_ints, default=[512, 2048, 8192],
                   help="prompt lengths in tokens, filler document + prompt (default: 512,2048,8192)")
    p.add_argument("--max-tokens", type=positive_int, default=256)
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly --max-tokens in every run")
    p.add_argument("--temperature", type=float, default=0.0, help="default 0: greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (temperature > 0)")
    p.add_argument("--repeats", type=positive_int, default=3, help="runs per prompt, context and mode; medians reported")
    p.add_argument("--cooldown", type=float, default=1.0, help="seconds of rest before each run")
    p.add_argument("--out", type=Path, default=Path("dflash-bench.json"), help="JSON results")
    p.add_argument("--plots", type=Path, help="folder for the PNG plots (default: the folder of --out)")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--no-progress", action="store_true")
    add_distributed_flag(p)
    server = p.add_argument_group("server mode")
    server.add_argument("--server", metavar="URL", help="benchmark a running server (http://host:port)")
    server.add_argument("--concurrency", type=int, default=4, help="concurrent streaming clients")
    server.add_argument("--requests", type=int, help="requests in all (default: 4 x concurrency)")
    server.add_argument("--api-key")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.set_defaults(func=run_bench)


def run_bench(args) -> int:
    """Exit code 0; 1 when an output did not match or a request failed (2: bad arguments)."""
    if args.server and (args.prompts or args.no_chat):
        raise ValueError("--prompts and --no-chat choose the engine benchmark's prompts; with --server use --sets")
    if args.server:
        report = run_server_bench(
            args.server, concurrency=args.concurrency, requests=args.requests or 4 * args.concurrency,
            model=args.model, sets=args.sets, prompts_per_set=args.prompts_per_set, max_tokens=args.max_tokens,
            temperature=args.temperature, api_key=args.api_key, timeout=args.timeout,
            progress=not args.no_progress)
        _write_json(report, args.out)
        print(server_table(report))
        return 1 if report.errors else 0

    if args.repeats < 1 or args.max_tokens < 1 or args.cooldown < 0:
        raise ValueError("--repeats and --max-tokens must be at least 1, --cooldown at least 0")
    if args.forced_accepted is not None and not args.random_weights:
        raise ValueError("--forced-accepted needs --random-weights")
    settings = settings_from_args(args)
    # Target alone and DFlash share this process, so one MLX backend setting (CUDA graphs) serves
    # both: the configured one, else off, as for any model with a drafter (docs/bench.md).
    settings.apply_backend_settings()
    channel = None
    if args.random_weights:
        if args.target or args.model:
            raise ValueError("--random-weights replaces --model/--target")
        if args.distributed:
            raise ValueError("--distributed benchmarks a checkpoint (--model or --target), not --random-weights")
        model = random_bench_model(args.random_weights, args.quant, args.layers, args.forced_accepted,
                                   settings.prefill_chunk)
    else:
        channel = distributed_channel(args)
        model = checkpoint_bench_model(settings, channel)
    split = None if args.prompts_split == "all" else args.prompts_split
    if args.prompts:  # the file's categories are the sets; an empty or unreadable file fails before any work
        args.sets = list(dict.fromkeys(p.set for p in prompts_from_file(args.prompts, split, args.prompts_per_set)))
    bench_settings = EngineSettings(
        prompts_file=str(args.prompts) if args.prompts else None, prompts_split=split, chat=not args.no_chat,
        contexts=args.contexts, sets=args.sets, prompts_per_set=args.prompts_per_set, repeats=args.repeats,
        cooldown_seconds=args.cooldown, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos,
        temperature=args.temperature, seed=args.seed if args.temperature > 0 else None,
        forced_accepted=args.forced_accepted)
    if not args.prompts:
        select_prompts(args.sets, args.prompts_per_set)  # unknown set names fail before any work
    leader = channel is None or channel.leader
    report = run_engine_bench(model, bench_settings, progress=not args.no_progress and leader)
    if not leader:  # every rank ran the benchmark; rank 0 reports it
        return 0
    _write_json(report, args.out)
    print(engine_table(report))
    if not args.no_plots:
        # Without matplotlib (an optional extra) the measurements still count: the table and the
        # JSON are written, the plots are skipped with one line saying how to get them.
        try:
            paths = write_plots(report, args.plots or args.out.parent, args.out.stem)
        except PlotsUnavailable as e:
            print(f"plots skipped: {e}", file=sys.stderr)
            paths = []
        for path in paths:
            print(f"plot: {path}")
    return 1 if report.all_matched is False else 0


def _write_json(report: BaseModel, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2))
    print(f"results: {path}", file=sys.stderr)
