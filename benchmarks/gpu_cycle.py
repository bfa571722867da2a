"""What one DFlash cycle costs on the accelerator, at the real shapes of the supported targets.

Random-weight targets and drafters at real shapes (no downloads), bf16 and 4-bit. For each context
length, in one run: prefill tok/s; target-alone decode ms for this engine and for stock mlx-lm;
verify-16 ms (a 16-token forward with taps, then rollback, with and without the GatedDeltaNet
replay a partial acceptance needs); draft ms; and end-to-end tokens/s of the engine's own loop with
a FORCED acceptance of 3, 5 and 6.5 tokens per cycle (the target's choice is overridden to agree
with the drafts: this measures speed, not acceptance).

    python benchmarks/gpu_cycle.py --models qwen3.5-9b --quant bf16 --contexts 1024,8192 --out r.json

`--paths dflash,replay,mlx,mlx-qmm,unfused` measures each context with this project's CUDA paths
(block attention, dflash_core/kernels/attention.py; GatedDeltaNet rollback replaying recorded
step deltas; the 4-bit small-M matmul, dflash_core/kernels/matmul.py), with the rollback replaying the
recurrence instead, with MLX's fused attention, the replay and MLX's quantized matmul, with only
MLX's own matmuls swapped back in (no 4-bit kernel, no bf16 stream kernel, no stacked bf16 GEMM),
with a 4-bit kernel launch or bf16 product per weight instead of one per shared input, with MLX's
GEMM (cuBLASLt) for bf16 products instead of our stream kernel (`cublas`), with MLX's fused
attention (`fused`), and with the target's decode and verify attention as before the exact kernel
(dflash_core/kernels/attention_cuda.py): MLX's fused attention for one query, the stacked GEMMs for
a block (`stacked`), and with the exact attention's scalar kernel instead of its tensor-core one
(`scalar-attention`) or with 512 key slots per thread block instead of 128 (`chunk512`), all in
the same process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_core.engine import Engine  # noqa: E402
from dflash_core.kernels import (  # noqa: E402
    KernelOptions,
    backend,
    gated_delta,  # noqa: E402
)
from dflash_core.kernels import matmul as small_m  # noqa: E402
from dflash_core.prefix_cache import PrefixCache  # noqa: E402

# One copy of the real-shape builders, shared with `dflash bench --random-weights` (and, through
# these names, with gpu_profile.py).
from dflash_core.random_models import ByteTokenizer, ForcedAcceptance  # noqa: E402
from dflash_core.random_models import random_drafter as build_drafter  # noqa: E402
from dflash_core.random_models import random_target as build_target  # noqa: E402

FORCED = {"3": [2], "5": [4], "6.5": [5, 6]}  # accepted drafts per cycle -> tokens per cycle
# --paths label -> the kernel options its adapter and drafter run with.
PATHS = {
    "dflash": KernelOptions(),
    "replay": KernelOptions(step_states=False),
    "mlx": KernelOptions(block_attention=False, exact_attention=False, step_states=False, cuda_matmul=False),
    "mlx-qmm": KernelOptions(cuda_matmul=False),
    "unfused": KernelOptions(one_launch_per_input=False),
    "cublas": KernelOptions(bf16_stream=False),
    "fused": KernelOptions(block_attention=False, exact_attention=False),
    "stacked": KernelOptions(exact_attention=False),
    "scalar-attention": KernelOptions(tensor_core_attention=False),
    "chunk512": KernelOptions(attention_chunk=512),
    "chunk32": KernelOptions(attention_chunk=32),
    "chunk64": KernelOptions(attention_chunk=64),
    "fused-norms": KernelOptions(fused_norms=True),
    "load-warps4": KernelOptions(attention_load_warps=4),
    "column-copies": KernelOptions(stream_parts=False),
    "draft-after-read": KernelOptions(draft_ahead=False),
    "eager-drafter": KernelOptions(compiled_drafter=False),
    "drafter-stacked": KernelOptions(drafter_exact_attention=False),
    # The default before 2026-12-07: the verify's and the draft's column copies and the draft's
    # stacked attention, launches a cycle makes and the target alone does not (docs/performance.md,
    # "Fewer launches in the cycle").
    "cycle-copies": KernelOptions(stream_parts=False, drafter_exact_attention=False),
}


def parse_paths(parser: argparse.ArgumentParser, text: str) -> list[str]:
    """--paths' comma list of PATHS labels, in order (an unknown one: the parser's error)."""
    paths = text.split(",")
    if unknown := [p for p in paths if p not in PATHS]:
        parser.error(f"--paths: unknown {', '.join(unknown)} (known: {', '.join(PATHS)})")
    return paths


def weight_bytes_per_token(adapter) -> int:
    """Bytes a decode step reads: all weights but the embedding table (unless it is the LM
    head) and, for MoE, only the experts a token uses."""
    args = adapter.text_model.args
    total = 0
    for path, value in tree_flatten(adapter.model.parameters()):
        if "embed_tokens" in path and not getattr(args, "tie_word_embeddings", False):
            continue
        if "switch_mlp" in path or "experts" in path:
            total += value.nbytes * args.num_experts_per_tok // args.num_experts
        else:
            total += value.nbytes
    return total


def median_of(fn, repeats=3):
    return statistics.median(fn() for _ in range(repeats))


def per_iteration_ms(fn, iters=10, warmup=3) -> float:
    """Median ms of fn() (which returns the arrays to evaluate), synchronised every iteration."""
    times = []
    for i in range(warmup + iters):
        start = time.perf_counter()
        mx.eval(fn())
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def build_ms(build) -> float:
    """Host ms to build (not run) the graph of the array `build()` returns, which is then evaluated."""
    start = time.perf_counter()
    out = build()
    elapsed = time.perf_counter() - start
    mx.eval(out)
    return elapsed * 1e3


def stock_decode_ms(adapter, cache, steps=32) -> float:
    """mlx-lm's own model and caches, pipelined as mlx-lm's generate_step does."""
    model = adapter.model
    token = mx.array([[1]])
    logits = model(token, cache=cache)
    y = mx.argmax(logits[:, -1], axis=-1)
    mx.eval(y)
    start = time.perf_counter()
    for _ in range(steps):
        next_y = mx.argmax(model(y[None], cache=cache)[:, -1], axis=-1)
        mx.async_eval(next_y)
        y.item()
        y = next_y
    y.item()
    return (time.perf_counter() - start) / steps * 1e3


def run_context(name, adapter, drafter, context, decode_tokens, prefill_chunk=4096, rng_seed=0):
    mx.random.seed(rng_seed)
    prompt = mx.random.randint(0, adapter.vocab_size, (context,)).tolist()
    engine = Engine(adapter, None, drafter, prefill_chunk=prefill_chunk, prefix_cache=PrefixCache(16 << 30))
    engine.tokenizer = ByteTokenizer(adapter.vocab_size)
    result = {"context": context}

    def gen(eng, n, **kw):
        chunks = list(eng.generate(prompt, max_tokens=n, stop_token_ids=set(), **kw))
        return chunks[-1].stats

    warm = Engine(adapter, engine.tokenizer, drafter, prefill_chunk=prefill_chunk)
    list(warm.generate(prompt[:512], max_tokens=40, stop_token_ids=set()))  # kernels compiled and traced
    stats = gen(engine, 2)  # real prefill (and the snapshot later runs start from)
    result["prefill_tok_s"] = context / stats.prefill_seconds
    assert gen(engine, 2).prefill_tokens == 0

    def alone():
        s = gen(engine, decode_tokens, speculative=False)
        return s.decode_seconds / (s.generated_tokens - 1) * 1e3

    result["decode_ms"] = median_of(alone)
    snapshot = engine.prefix_cache.lookup(prompt, need_context=True)
    if adapter.family != "gemma4":  # the same cache classes mlx-lm uses
        result["stock_decode_ms"] = median_of(lambda: stock_decode_ms(adapter, snapshot.restore()[0]))

    # Micro: verify 16 + rollback (full acceptance: no replay; one token kept: GatedDeltaNet replay).
    taps = drafter.config.target_layer_ids
    block = mx.random.randint(0, adapter.vocab_size, (1, 16))

    def verify(keep):
        cache, _ = snapshot.restore()

        def step():
            out = adapter.forward(block, cache, taps, record=True)
            adapter.rollback(cache, out.rollback, keep=keep)
            return [out.logits, out.tapped_hidden] + [a for c in cache if c is not None for a in _arrays(c)]
        return per_iteration_ms(step)

    def verify_build_ms():
        cache, _ = snapshot.restore()
        return build_ms(lambda: adapter.forward(block, cache, taps, record=True).logits)

    result["verify16_graph_build_ms"] = median_of(verify_build_ms)
    result["verify16_full_accept_ms"] = verify(16)
    result["verify16_replay_ms"] = verify(7)

    def draft():
        _, context_cache = snapshot.restore()
        taps16 = mx.random.normal((1, 16, len(taps) * adapter.hidden_size)).astype(adapter.dtype)
        bonus = mx.array([1])

        def step():
            drafter.add_context(taps16[:, :5], context_cache)  # a cycle's accepted positions
            return [drafter.propose(bonus, adapter, context_cache)]
        return per_iteration_ms(step)

    result["draft_ms"] = draft()

    def draft_build_ms():  # the cycle's other graph
        _, context_cache = snapshot.restore()
        taps16 = mx.random.normal((1, 16, len(taps) * adapter.hidden_size)).astype(adapter.dtype)
        drafter.add_context(taps16[:, :5], context_cache)
        mx.eval([c.state for c in context_cache])
        return build_ms(lambda: drafter.propose(mx.array([1]), adapter, context_cache))

    def decode_build_ms():  # for comparison
        cache, _ = snapshot.restore()
        return build_ms(lambda: adapter.forward(block[:, :1], cache, ()).logits)

    result["draft_graph_build_ms"] = median_of(draft_build_ms, repeats=5)
    result["decode_graph_build_ms"] = median_of(decode_build_ms, repeats=5)
    for label, schedule in FORCED.items():
        forced = Engine(ForcedAcceptance(adapter, schedule), engine.tokenizer, drafter, prefill_chunk=prefill_chunk,
                        prefix_cache=engine.prefix_cache)

        def spec():
            s = gen(forced, decode_tokens * 4)
            return s.decode_seconds, s.cycles, s.generated_tokens, s.tokens_per_cycle

        runs = [spec() for _ in range(3)]
        seconds, cycles, tokens, per_cycle = sorted(runs)[1]
        result[f"forced_{label}"] = {"tok_s": (tokens - 1) / seconds, "cycle_ms": seconds / cycles * 1e3,
                                     "tokens_per_cycle": per_cycle}
    return result


def _arrays(cache):
    if hasattr(cache, "cache"):
        return [a for a in cache.cache if a is not None]
    return [a for a in (getattr(cache, "keys", None), getattr(cache, "values", None)) if a is not None]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="qwen3.5-9b,qwen3.5-27b,qwen3.6-35b-a3b,gemma-4-31b,qwen3-8b")
    parser.add_argument("--quant", default="bf16,4bit")
    parser.add_argument("--contexts", default="1024,8192,32768")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-chunk", type=int, default=4096,
                        help="tokens per prefill forward (the server's default is 2048; 4096 measured the tables)")
    parser.add_argument("--layers", type=int, help="truncate targets to this many layers (quick looks only)")
    parser.add_argument("--paths", default="dflash",
                        help="comma list of: dflash (this project's CUDA paths), replay (GatedDeltaNet rollback "
                             "by replay instead of recorded step states), mlx (MLX's fused attention, replay and "
                             "quantized matmul), mlx-qmm (dflash with MLX's own matmuls: no 4-bit kernel, no stacked "
                             "bf16 GEMM), unfused (dflash with a "
                             "4-bit launch or bf16 product per weight, not one per shared input), cublas (dflash with MLX's "
                             "GEMM for bf16 products instead of our stream kernel), fused (dflash with MLX's fused "
                             "attention), stacked (dflash with the target's attention as before the exact kernel), "
                             "scalar-attention (dflash with the exact attention's scalar kernel, not tensor cores), "
                             "chunk512 (dflash with 512 key slots per block of the exact attention, not 128), "
                             "fused-norms (dflash with a residual add and its norms in one launch of ours, not MLX's kernels), "
                             "load-warps4 (dflash with 4 warps loading each tile of the exact attention), column-copies (dflash "
                             "with each stacked projection's output columns of one product, which reshapes copy, not an "
                             "array of its own from the stream kernel), draft-after-read (dflash drafting each cycle after "
                             "its read, "
                             "not queued behind its verify), eager-drafter (dflash with the drafter's layers op by op, "
                             "not as compiled blocks), chunk32 / chunk64 (exact attention in chunks of 32 / 64 key "
                             "slots), drafter-stacked (a drafter's blocks through the stacked GEMMs over two "
                             "segments, not the exact attention kernel), cycle-copies (column-copies and drafter-stacked)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: checks this script on a CPU, measures nothing")
    args = parser.parse_args()
    paths = parse_paths(parser, args.paths)
    report = {"device": str(mx.default_device()), "backend": backend(), "gated_delta": gated_delta.active_path(),
              "small_m_matmul": small_m.active_path(),
              "mlx": mx.__version__, "date": time.strftime("%Y-%m-%d"), "results": []}
    print(json.dumps({k: v for k, v in report.items() if k != "results"}), flush=True)
    for name in args.models.split(","):
        for quant in args.quant.split(","):
            started = time.perf_counter()
            adapter = build_target(name, quant, args.layers, args.tiny)
            drafter = build_drafter(name, adapter, args.tiny)
            entry = {"model": name, "quant": quant, "layers": adapter.num_layers,
                     "weight_gb_per_token": weight_bytes_per_token(adapter) / 1e9, "contexts": []}
            for context in (int(c) for c in args.contexts.split(",")):
                for label in paths:
                    # The same weights (as stacked at load), run with this path's kernel options.
                    kernels = PATHS[label]
                    run = run_context(name, adapter.with_kernels(kernels), drafter.with_kernels(kernels), context,
                                      args.decode_tokens, args.prefill_chunk)
                    row = {"paths": label, **run}
                    row["weight_tb_s"] = entry["weight_gb_per_token"] / row["decode_ms"]  # GB/ms == TB/s
                    row["verify_over_decode"] = row["verify16_full_accept_ms"] / row["decode_ms"]
                    entry["contexts"].append(row)
                    print(json.dumps({"model": name, "quant": quant, **row}), flush=True)
            entry["seconds"] = time.perf_counter() - started
            report["results"].append(entry)
            del adapter, drafter
            mx.clear_cache()
            if args.out:
                args.out.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
