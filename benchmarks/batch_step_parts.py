"""Where a batched speculative step spends its time: each part of one step, at N rows, timed alone.

    python benchmarks/batch_step_parts.py --shape qwen3.5-9b --rows 1,8 --context 1024

For N generations whose caches hold --context tokens (random weights, `random_models`), times the
parts of one cycle of all of them: the drafter's block (`propose_rows`), the target's verify of N
blocks of 16 (`forward_rows`; and again after the rows' batched rollback of the last one, as the
engine runs it), each row's sampling of its 16 choices (greedy: the batch's one
argmax, as the engine takes it), each row's rollback to 6 tokens (one by one, and all in one
`rollback_rows`) and its drafter-context update (one `add_context` per row, and one
`add_context_rows` for all, as the engine does), and the host read (each row's, and joined into
one as the engine reads a round). Each part is timed twice: building its graph on the host
(Python and MLX's graph, no device work) and building plus evaluating it, median of --repeat runs
after a warm-up; a part whose build time is close to its total is host-bound.

With --ncu it also runs a round's device work (the draft; the batched rollback with the next verify;
the context update) between marker kernels, for a trace of kernel-only time per part:

    MLX_USE_CUDA_GRAPHS=0 ncu --clock-control none --profile-from-start off \\
        --metrics gpu__time_duration.sum,launch__grid_size -o parts \\
        python benchmarks/batch_step_parts.py --rows 1,8 --repeat 1 --ncu > parts_configs.jsonl
    ncu --import parts.ncu-rep --csv --page raw > parts.csv
    python benchmarks/parse_ncu.py --trace parts.csv --configs parts_configs.jsonl --out parts_ncu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def _timed(fn, repeat: int, evaluate, before=None):
    """(median build seconds, median build+eval seconds) of `fn`; `evaluate(out)` evaluates its
    output; `before()`, untimed, runs and is evaluated before each run."""
    import mlx.core as mx

    builds, totals = [], []
    for i in range(repeat + 1):
        if before is not None:
            before()
        mx.synchronize()
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        evaluate(out)
        mx.synchronize()
        t2 = time.perf_counter()
        if i:  # the first run traces compiled blocks
            builds.append(t1 - t0)
            totals.append(t2 - t0)
    return statistics.median(builds), statistics.median(totals)


def profile(target, drafter, rows: int, context: int, repeat: int, trace=None) -> dict:
    import mlx.core as mx

    from dflash_core.adapters import ForwardRow
    from dflash_core.cache import cache_arrays
    from dflash_core.drafter import DraftRow
    from dflash_core.engine import choose
    from dflash_core.host_reads import RoundQueue
    from dflash_core.sampling import Sampler, SamplingParams

    block, taps = drafter.block_size, drafter.config.target_layer_ids
    caches, contexts = [], []
    for r in range(rows):
        prompt = mx.random.randint(0, target.vocab_size, (1, context), key=mx.random.key(r))
        cache, ctx = target.make_cache(max_rollback=block), drafter.make_cache()
        for s in range(0, context, 512):
            out = target.forward(prompt[:, s:s + 512], cache, taps, last_logits_only=True)
            drafter.add_context(out.tapped_hidden, ctx)
            mx.eval(cache_arrays(cache), cache_arrays(ctx))
        caches.append(cache)
        contexts.append(ctx)
    bonus = [mx.array([7 + r], dtype=mx.int32) for r in range(rows)]
    parts = {}

    def evaluate(out):
        mx.eval(out)

    def draft():
        return drafter.propose_rows([DraftRow(b, c, block) for b, c in zip(bonus, contexts)], target)

    parts["draft"] = _timed(draft, repeat, evaluate)
    drafts = draft()
    blocks = [mx.concatenate([b, d])[None] for b, d in zip(bonus, drafts)]

    # The caches grow by a block per timed run (a few blocks: the same buffer sizes throughout).
    def verify():
        outs = target.forward_rows([ForwardRow(t, c, record=True) for t, c in zip(blocks, caches)], taps)
        return outs, caches

    parts["verify"] = _timed(verify, repeat, lambda o: mx.eval([(x.logits, x.tapped_hidden) for x in o[0]],
                                                                 cache_arrays([c for cs in o[1] for c in cs])))
    # As the engine runs a round: each verify starts from the rows' batched rollback to 6 tokens
    # of the last one (the caches then hold what the rollback's gathers left them).
    last = list(verify()[0])

    def roll_back_last():
        target.rollback_rows([(c, o.rollback, 6) for c, o in zip(caches, last)])
        mx.eval(cache_arrays([c for cs in caches for c in cs]))

    def verify_after_rollback():
        outs, verified = verify()
        last[:] = outs
        return outs, verified

    parts["verify_after_rollback"] = _timed(verify_after_rollback, repeat, lambda o: mx.eval(
        [(x.logits, x.tapped_hidden) for x in o[0]], cache_arrays([c for cs in o[1] for c in cs])), roll_back_last)

    def rollback_and_verify():  # the round's target work as one graph, as the engine builds it
        target.rollback_rows([(c, o.rollback, 6) for c, o in zip(caches, last)])
        return verify_after_rollback()

    parts["rollback_and_verify"] = _timed(rollback_and_verify, repeat, lambda o: mx.eval(
        [(x.logits, x.tapped_hidden) for x in o[0]], cache_arrays([c for cs in o[1] for c in cs])))
    outs, verified = verify()
    mx.eval([x.logits for x in outs])
    samplers = [Sampler(SamplingParams(), target.vocab_size) for _ in range(rows)]

    def sample():  # as the engine does: greedy rows take the batch's one argmax (engine.choose)
        return [choose(s, o, d, 1, None) for s, o, d in zip(samplers, outs, drafts)]

    parts["sample"] = _timed(sample, repeat, evaluate)
    keep = 6

    def rollback():  # (the attention caches trim a little further each run)
        for c, o in zip(verified, outs):
            target.rollback(c, o.rollback, keep=keep)
        return verified

    parts["rollback"] = _timed(rollback, repeat, lambda cs: mx.eval(cache_arrays([c for x in cs for c in x])))

    def rollback_rows():  # the engine's way: every row's rollback in one call
        target.rollback_rows([(c, o.rollback, keep) for c, o in zip(verified, outs)])
        return verified

    parts["rollback_rows"] = _timed(rollback_rows, repeat, lambda cs: mx.eval(cache_arrays([c for x in cs for c in x])))

    def context_each():
        for o, ctx in zip(outs, contexts):
            drafter.add_context(o.tapped_hidden[:, :keep], ctx)
        return contexts

    def context_rows():
        drafter.add_context_rows([(o.tapped_hidden[:, :keep], ctx) for o, ctx in zip(outs, contexts)])
        return contexts

    ctx_eval = lambda ctxs: mx.eval(cache_arrays([c for x in ctxs for c in x]))  # noqa: E731
    parts["context_per_row"] = _timed(context_each, repeat, ctx_eval)
    parts["context_rows"] = _timed(context_rows, repeat, ctx_eval)
    choices = sample()
    mx.eval(choices)
    parts["host_read_per_row"] = _timed(lambda: [mx.concatenate([d, c]).tolist() for d, c in zip(drafts, choices)],
                                        repeat, lambda _: None)

    def read_joined():  # as the engine does: the round's reads joined, read once (host_reads)
        queue = RoundQueue()
        reads = [queue.read_later(mx.concatenate([d, c])) for d, c in zip(drafts, choices)]
        queue.join_reads()
        return [r.tolist() for r in reads]

    parts["host_read"] = _timed(read_joined, repeat, lambda _: None)
    # The LM head alone at the verify's and the draft's row counts: a matmul's share of the parts.
    hidden = mx.random.normal((1, rows * block, target.hidden_size)).astype(target.dtype)
    parts["lm_head_verify_rows"] = _timed(lambda: target.lm_head(hidden), repeat, evaluate)
    parts["lm_head_one_row"] = _timed(lambda: target.lm_head(hidden[:, :1]), repeat, evaluate)
    if trace is not None:
        # A round's device work as the engine queues it, for an ncu trace (--ncu): the drafter's
        # block; the rows' batched rollback of the last verify to 6 tokens with the next verify
        # (one graph, as a round builds them); the drafter's context update.
        def round_target():
            outs, verified = rollback_and_verify()
            mx.eval([(x.logits, x.tapped_hidden) for x in outs], cache_arrays([c for cs in verified for c in cs]))

        trace(rows, "draft", lambda: mx.eval(draft()))
        trace(rows, "rollback_and_verify", round_target)
        trace(rows, "context_rows", lambda: ctx_eval(context_rows()))
    return {name: {"build_ms": b * 1e3, "total_ms": t * 1e3} for name, (b, t) in parts.items()}


def kernel_tracer(weight_bytes: int):
    """`trace(rows, part, run)` for --ncu: runs `run` three times between marker kernels
    (benchmarks/small_m_stream_cuda.py) and prints the range's configuration as a JSON line, which
    parse_ncu.py matches to the trace's kernels (their kernel-only time per run, by kind)."""
    import mlx.core as mx
    import small_m_stream_cuda as stream

    count = [0]
    profiler = _cuda_profiler()

    def trace(rows: int, part: str, run) -> None:
        run()  # (anything traced or allocated the first time, outside the range)
        index = count[0]
        count[0] += 1
        mx.synchronize()
        profiler.cudaProfilerStart()
        mx.eval(stream.marker(index))
        for _ in range(3):
            run()
        mx.eval(stream.marker(stream.IGNORE))
        mx.synchronize()
        profiler.cudaProfilerStop()
        print(json.dumps({"index": index, "rows": rows, "part": part, "weight_bytes": weight_bytes, "launches": 3}),
              flush=True)

    return trace


def _cuda_profiler():
    """CUDA's runtime library, for cudaProfilerStart/Stop around the traced ranges: with ncu's
    `--profile-from-start off` only they are profiled. ncu costs some 14 ms a kernel on the H100
    (2026-12-05), so a trace of the whole process, whose set-up (random weights, prefill) launches
    some 17,000 kernels, did not reach the parts in 4 minutes. (The primary context that MLX uses is
    the runtime's, whichever copy of the library calls it.)"""
    import ctypes
    import ctypes.util
    import os

    for name in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64", "libcudart.so"),
                 ctypes.util.find_library("cudart") or "libcudart.so"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise SystemExit("--ncu needs CUDA's runtime library (libcudart.so; set CUDA_HOME)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen3.5-9b")
    parser.add_argument("--quant", default="bf16")
    parser.add_argument("--rows", type=lambda s: [int(v) for v in s.split(",")], default=[1, 8])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--paths", default="default",
                        help="comma list: default, replay (verifies keep no per-step GatedDeltaNet states; "
                             "rollbacks replay the recurrence), step_states (verifies keep every step's state and "
                             "rollbacks pick one, not deltas), unqueued (a forward starts on the device only once "
                             "its whole graph is built)")
    parser.add_argument("--ncu", action="store_true",
                        help="also run a round's parts between marker kernels, for an ncu trace (CUDA; see the docstring)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    import mlx.core as mx

    from dflash_core.kernels import DEFAULT_KERNELS, KernelOptions
    from dflash_core.loading import parameter_bytes
    from dflash_core.random_models import parse_shape, random_drafter, random_target

    name, tiny = parse_shape(args.shape)
    target = random_target(name, args.quant, tiny=tiny)
    drafter = random_drafter(name, target, tiny)
    report = {"device": mx.device_info().get("device_name"), "shape": args.shape, "quant": args.quant,
              "context": args.context, "date": time.strftime("%Y-%m-%d"), "rows": {}}
    trace = kernel_tracer(parameter_bytes(target.model)) if args.ncu else None
    # (Before 2026-12-05 "default" recorded step states: `step_states` is that now.)
    kernels = {"default": DEFAULT_KERNELS, "replay": KernelOptions(step_states=False),
               "step_states": KernelOptions(step_deltas=False), "unqueued": KernelOptions(queue_layers=False)}
    for path in args.paths.split(","):
        for n in args.rows:
            parts = profile(target.with_kernels(kernels[path]), drafter, n, args.context, args.repeat, trace)
            report["rows"][n if path == "default" else f"{n} {path}"] = parts
            print(f"rows {n} {path}: " + "  ".join(f"{k} {v['build_ms']:.1f}/{v['total_ms']:.1f}" for k, v in parts.items())
                    + "  (ms: build/total)", flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
