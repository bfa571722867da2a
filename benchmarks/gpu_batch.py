"""Continuous batching with speculation on a GPU: aggregate and per-stream speed at 1..16 streams.

    python benchmarks/gpu_batch.py --shape qwen3.5-9b --quants bf16,4bit --streams 1,2,4,8,16 --out gpu_batch.json

A random-weight target at a real shape and a random drafter (`random_models`); N generations of
--max-tokens tokens after prompts of --context tokens step together (`batching.step_together`: one
drafter forward and one target forward per step for all of them), in two modes: DFlash with the
target made to accept 5.4 drafts per cycle on average (6.4 tokens per cycle, `ForcedAcceptance`),
and the target alone (with --auto also `speculation: auto` at 6.4 tokens per cycle and at 1, no
draft ever accepted). The reference line is mlx-lm's own continuous batching (`BatchGenerator`,
target alone) at the same batch sizes. Reported per N: aggregate tok/s over the decode phase (from
the moment every stream has its first token to the last token), per-stream tok/s (each stream's
tokens after its first over its own decode time), and mean time to first token (prefill is not
batched: prompts are prefilled one chunk per step each). One process; MLX's CUDA graphs off as in
a speculating server. With --rounds R the sweep runs R times in turn and the report adds, per
stream count, the median aggregate of each mode and the median of its ratio to one stream's
aggregate in the same round (`medians`): the machine's speed drifts between minutes. With
--step-states each round also runs DFlash with `KernelOptions.step_deltas` off (GatedDeltaNet rollbacks
picking recorded states instead of replaying recorded deltas; CUDA) right after the default.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

FORCED = [5, 5, 6, 5, 6]  # accepted drafts per cycle: 6.4 tokens per cycle on average


def _prompts(vocab: int, n: int, context: int):
    import mlx.core as mx

    return [mx.random.randint(0, vocab, (context,), key=mx.random.key(1000 + i)).tolist() for i in range(n)]


def run_dflash(engine, prompts, max_tokens: int, mode: str) -> dict:
    """N streams of one engine stepping together; times per stream."""
    import mlx.core as mx

    from dflash_core.batching import step_together

    extra = {"speculation": mode} if mode != "off" else {"speculative": False}
    mx.synchronize()
    start = time.perf_counter()
    streams = [engine.generate(p, max_tokens=max_tokens, stop_token_ids=set(), batched=True, **extra) for p in prompts]
    first, last, counts = [None] * len(streams), [None] * len(streams), [0] * len(streams)
    stats = [None] * len(streams)
    live = list(range(len(streams)))
    while live:
        results = step_together(engine, [streams[i] for i in live])
        now = time.perf_counter()
        for i, r in zip(list(live), results):
            if r.error is not None:
                raise r.error
            if r.done or (r.chunk is not None and r.chunk.finish_reason):
                live.remove(i)
            if r.chunk is not None and r.chunk.token_ids:
                counts[i] += len(r.chunk.token_ids)
                first[i] = first[i] or now
                last[i] = now
            if r.chunk is not None and r.chunk.stats is not None:
                stats[i] = r.chunk.stats
    mx.synchronize()
    summary = _summary(start, first, last, counts)
    if mode == "auto":  # what it chose
        summary.update(cycles=sum(s.cycles for s in stats), plain_steps=sum(s.plain_steps for s in stats),
                       note=stats[0].speculation_note)
    return summary


def _summary(start, first, last, counts) -> dict:
    all_started = max(first)
    # Tokens handed out after every stream had its first one, over that window (stream by stream:
    # the share of a stream's decode inside the window, assuming its tokens were evenly spread).
    inside = sum((c - 1) * max(0.0, end - all_started) / (end - f) if end > f else 0
                 for f, end, c in zip(first, last, counts))
    window = max(last) - all_started
    return {
        "aggregate_tok_s": inside / window if window > 0 else None,
        "per_stream_tok_s": statistics.mean((c - 1) / (end - f) for f, end, c in zip(first, last, counts) if end > f),
        "ttft_s": statistics.mean(f - start for f in first),
        "tokens": sum(counts),
    }


def _medians(rows: list[dict]) -> list[dict]:
    """Per stream count: the median aggregate over the rounds of each mode, and the median of its
    ratio to one stream's aggregate of the same mode in the same round (the machine drifts between
    rounds; within a round the two were measured minutes apart at most)."""
    out = []
    modes = [m for m in ("dflash", "target", "mlx_lm", "dflash_step_states")
             if all("aggregate_tok_s" in r.get(m, {}) for r in rows)]
    solo = {(r["round"], m): r[m]["aggregate_tok_s"] for r in rows if r["streams"] == 1 for m in modes}
    for n in sorted({r["streams"] for r in rows}):
        line = {"quant": rows[0]["quant"], "streams": n}
        mine = [r for r in rows if r["streams"] == n]
        for m in modes:
            line[m] = statistics.median(r[m]["aggregate_tok_s"] for r in mine)
            ratios = [r[m]["aggregate_tok_s"] / solo[(r["round"], m)] for r in mine if (r["round"], m) in solo]
            if ratios:
                line[f"{m}_x_one_stream"] = statistics.median(ratios)
                line[f"{m}_x_one_stream_each_round"] = [round(x, 2) for x in ratios]
        print(f"{line['quant']}: median over rounds, {n} streams: " + "  ".join(
            f"{m} {line[m]:.1f} tok/s" + (f" ({line[m + '_x_one_stream']:.2f}x one stream, rounds "
                                          f"{line[m + '_x_one_stream_each_round']})" if m + "_x_one_stream" in line else "")
            for m in modes), flush=True)
        out.append(line)
    return out


def run_mlx_lm(model, prompts, max_tokens: int) -> dict:
    """mlx-lm's BatchGenerator, the target alone, greedy."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=max(32, len(prompts)),
                         prefill_batch_size=len(prompts))
    mx.synchronize()
    start = time.perf_counter()
    uids = gen.insert(prompts, [max_tokens] * len(prompts))
    index = {u: i for i, u in enumerate(uids)}
    first, last, counts = [None] * len(prompts), [None] * len(prompts), [0] * len(prompts)
    while responses := gen.next_generated():
        now = time.perf_counter()
        for r in responses:
            i = index[r.uid]
            counts[i] += 1
            first[i] = first[i] or now
            last[i] = now
    gen.close()
    return _summary(start, first, last, counts)


def _positive(text: str) -> int:
    # (dflash_core.cli.args.positive_int, but importing dflash_core imports MLX, which must come
    # after main() sets MLX_USE_CUDA_GRAPHS.)
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer expected, got {text}")
    return value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b")
    parser.add_argument("--quants", default="bf16")
    parser.add_argument("--streams", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4, 8, 16])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's BatchGenerator")
    parser.add_argument("--unqueued", action="store_true",
                        help="also run both modes with forwards that start on the device only once built whole")
    parser.add_argument("--restacked", action="store_true",
                        help="also run each mode with every batched forward stacking the rows' caches anew "
                             "(rows.StackedRows off), alternating with the default")
    parser.add_argument("--step-states", action="store_true",
                        help="also run DFlash with verifies recording every GatedDeltaNet step state and rollbacks "
                             "picking one (KernelOptions.step_deltas off; on CUDA), in every round beside the default")
    parser.add_argument("--auto", action="store_true",
                        help="also run speculation: auto, at 6.4 tokens per cycle and at 1 (no draft accepted)")
    parser.add_argument("--rounds", type=_positive, default=1,
                        help="run the --streams sweep this many times in turn (one process) and report each "
                             "stream count's median aggregate and its median ratio to one stream's in the same round")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    os.environ.setdefault("MLX_USE_CUDA_GRAPHS", "0")  # as a speculating server runs
    import mlx.core as mx

    from dflash_core.engine import Engine
    from dflash_core.random_models import ByteTokenizer, ForcedAcceptance, parse_shape, random_drafter, random_target

    report = {"device": mx.device_info().get("device_name"), "shape": args.shape, "context": args.context,
              "max_tokens": args.max_tokens, "date": time.strftime("%Y-%m-%d"), "rows": []}
    name, tiny = parse_shape(args.shape)
    for quant in args.quants.split(","):
        target = random_target(name, quant, tiny=tiny)
        drafter = random_drafter(name, target, tiny)
        tokenizer = ByteTokenizer(target.vocab_size)
        forced = Engine(ForcedAcceptance(target, FORCED, drafter.block_size), tokenizer, drafter)
        alone = Engine(target, tokenizer)
        warm = _prompts(target.vocab_size, 2, args.context)
        # Every stream count once, briefly: compiles the blocks and kernels of its shapes (a 4-bit
        # target's quantized kernels compile on first use: a first measured one-stream run paid
        # for them on 2026-12-05).
        for n in sorted(set(args.streams) | {2}):
            some = warm if n == 2 else _prompts(target.vocab_size, n, args.context)
            run_dflash(forced, some, 16, "on")
            run_dflash(alone, some, 16, "off")
        unaccepted = None
        if args.auto:  # (auto learns the machine over its first generations, as a server does)
            unaccepted = Engine(ForcedAcceptance(target, [0], drafter.block_size), tokenizer, drafter)
            for engine in (forced, unaccepted):
                run_dflash(engine, warm, 64, "auto")
        unqueued = None
        if args.unqueued:  # the same model, forwards built whole before the device starts (KernelOptions)
            plain = target.with_kernels(replace(target.kernels, queue_layers=False))
            unqueued = (Engine(ForcedAcceptance(plain, FORCED, drafter.block_size), tokenizer, drafter),
                        Engine(plain, tokenizer))
            run_dflash(unqueued[0], warm, 16, "on")
            run_dflash(unqueued[1], warm, 16, "off")
        states = None
        if args.step_states:  # the same model, GatedDeltaNet rollbacks picking recorded step states
            recording = target.with_kernels(replace(target.kernels, step_deltas=False))
            states = Engine(ForcedAcceptance(recording, FORCED, drafter.block_size), tokenizer, drafter)
            for n in sorted(set(args.streams) | {2}):
                run_dflash(states, warm if n == 2 else _prompts(target.vocab_size, n, args.context), 16, "on")
        print(f"{quant}: {'N':>3} | {'dflash agg':>10} {'per stream':>10} {'ttft':>6} | {'target agg':>10} "
              f"{'per stream':>10} | {'mlx-lm agg':>10}", flush=True)
        for n, round_ in [(n, r) for r in range(args.rounds) for n in args.streams]:
            prompts = _prompts(target.vocab_size, n, args.context)
            row = {"quant": quant, "streams": n, "round": round_,
                   "dflash": run_dflash(forced, prompts, args.max_tokens, "on"),
                   "target": run_dflash(alone, prompts, args.max_tokens, "off")}
            if args.restacked:
                for part in (target, drafter):
                    part.stacked_rows.enabled = False
                row["dflash_restacked"] = run_dflash(forced, prompts, args.max_tokens, "on")
                row["target_restacked"] = run_dflash(alone, prompts, args.max_tokens, "off")
                for part in (target, drafter):
                    part.stacked_rows.enabled = True
            if states is not None:
                row["dflash_step_states"] = run_dflash(states, prompts, args.max_tokens, "on")
            if unaccepted is not None:
                row["auto"] = run_dflash(forced, prompts, args.max_tokens, "auto")
                row["auto_unaccepted"] = run_dflash(unaccepted, prompts, args.max_tokens, "auto")
            if unqueued is not None:
                row["dflash_unqueued"] = run_dflash(unqueued[0], prompts, args.max_tokens, "on")
                row["target_unqueued"] = run_dflash(unqueued[1], prompts, args.max_tokens, "off")
            if not args.no_mlx_lm:
                try:
                    row["mlx_lm"] = run_mlx_lm(target.model, prompts, args.max_tokens)
                except Exception as e:  # noqa: BLE001 - a family mlx-lm cannot batch: say so, go on
                    row["mlx_lm"] = {"error": f"{type(e).__name__}: {e}"}
            report["rows"].append(row)
            d, t, m = row["dflash"], row["target"], row.get("mlx_lm", {})
            print(f"{quant}: {n:>3} | {d['aggregate_tok_s']:10.1f} {d['per_stream_tok_s']:10.1f} {d['ttft_s']:6.2f} | "
                  f"{t['aggregate_tok_s']:10.1f} {t['per_stream_tok_s']:10.1f} | "
                  f"{m.get('aggregate_tok_s') or float('nan'):10.1f}"
                  + (f" | unqueued: dflash {row['dflash_unqueued']['aggregate_tok_s']:.1f}"
                     f" target {row['target_unqueued']['aggregate_tok_s']:.1f}" if unqueued else "")
                  + (f" | step states: dflash {row['dflash_step_states']['aggregate_tok_s']:.1f}" if states else "")
                  + (f" | restacked: dflash {row['dflash_restacked']['aggregate_tok_s']:.1f}"
                     f" target {row['target_restacked']['aggregate_tok_s']:.1f}" if args.restacked else "")
                  + (f" | auto: {row['auto']['aggregate_tok_s']:.1f} ({row['auto']['cycles']} cycles, "
                     f"{row['auto']['plain_steps']} steps), at 1 tok/cycle {row['auto_unaccepted']['aggregate_tok_s']:.1f} "
                     f"({row['auto_unaccepted']['cycles']} cycles, {row['auto_unaccepted']['plain_steps']} steps)"
                     if unaccepted else ""), flush=True)
        if args.rounds > 1:
            report.setdefault("medians", []).extend(_medians([r for r in report["rows"] if r["quant"] == quant]))
        del forced, alone, target, drafter, unqueued, unaccepted, states
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
